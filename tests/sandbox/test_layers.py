"""npm package layers for real: Codex CLI's npm package installed by the host's npm into the image cache, its static
native binary run from the read-only layer in a bubblewrap sandbox of an image without node; a package npm cannot
install, or one whose command needs node, is an ImageError naming it and leaves no layer behind."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from nemo_gym_prorl.contracts.sandbox import BindMount, SandboxSpec
from nemo_gym_prorl.sandbox import open_sandbox
from nemo_gym_prorl.sandbox.images import ImageError
from nemo_gym_prorl.sandbox.layers import BIN, MANIFEST, build_npm_layer, npm_layer_path

CODEX = "@openai/codex@0.171.0"  # the version tasks/swe/offline_codex_harness.yaml pins


def test_the_layer_key_is_the_pinned_list_not_its_order() -> None:
    assert npm_layer_path([CODEX, "a@1.0.0"]) == npm_layer_path(["a@1.0.0", CODEX])
    assert npm_layer_path([CODEX]) != npm_layer_path(["@openai/codex@0.170.0"])
    assert npm_layer_path([CODEX]).name.startswith("npm-")


async def test_codex_runs_from_its_npm_layer_in_a_sandbox_whose_image_has_no_node(rootfs: Path) -> None:
    layer = build_npm_layer([CODEX])
    manifest = json.loads((layer / MANIFEST).read_text())
    assert manifest["npm"] == [CODEX] and "@openai/codex@0.171.0" in manifest["installed"]
    assert manifest["installed"] == sorted(manifest["installed"]) and len(manifest["installed"]) == 2
    assert (layer / BIN / "codex").resolve().read_bytes()[:4] == b"\x7fELF"  # the native binary, not codex.js
    bind = BindMount(source=str(layer), target="/.layer")
    spec = SandboxSpec(image=str(rootfs), binds=[bind], env={"PATH": f"/.layer/{BIN}:/usr/bin:/bin"})
    async with open_sandbox("bwrap", spec) as sandbox:
        result = await sandbox.exec(["sh", "-c", "command -v node || codex --version"], timeout=60)
    assert (result.exit_code, result.output.strip()) == (0, "codex-cli 0.171.0")


@pytest.mark.parametrize(
    ("package", "error"),
    [
        ("@openai/codex@0.0.0-nope", r"^npm install @openai/codex@0\.0\.0-nope failed \(exit 1\):"),
        # semver's command is bin/semver.js: a node script, with no native executable beside it
        ("semver@7.6.3", (r"^npm layer: command 'semver' has no native executable in its packages for linux-\w+: "
                          r"it needs node, which the image lacks$")),
    ],
)  # fmt: skip
def test_a_package_npm_cannot_install_or_that_needs_node_is_an_image_error_and_leaves_no_layer(
    tmp_path: Path, package: str, error: str
) -> None:
    with pytest.raises(ImageError, match=error):
        build_npm_layer([package], cache=tmp_path)
    left = [p.name for p in (tmp_path / "layers").iterdir() if not p.name.endswith(".lock")]
    assert left == []  # no layer, no half-built tree to be taken for one
