"""Package layers: pip packages installed on the host for an image's Python, bound read-only into its sandboxes.

A harness (mini-swe-agent, ...) needs packages the Debian image lacks, and the sandbox has no network to fetch
them. Building an image variant per harness costs an mmdebstrap run (~20 s, 180 MB) and a copy of the base tree;
a layer is only what pip adds: `pip install --target` with wheels for the image's Python version and glibc (read
from the image's own dpkg status and python3 link), no compiling, cached by a hash of the pinned list, the
interpreter and the platform, built under the images' lock like a rootfs. The sandbox binds it and puts its
`site/` on PYTHONPATH. Pinned top-level packages, resolved by pip at build time: the cache key is the list, so a
built layer never changes under a task.
"""

from __future__ import annotations

import hashlib
import json
import platform
import re
import shutil
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from nemo_gym_prorl.sandbox.images import (
    ImageError,
    _locked,
    _remove_stale_work,
    _run_logged,
    cache_dir,
)

MANIFEST = "prorl-layer.json"
"""Written into a layer once pip finished: the packages, the target interpreter and platform, and pip's freeze."""
SITE = "site"


def image_python(rootfs: Path) -> str:
    """The image's python3 version, `3.11`, from the interpreter its /usr/bin/python3 names."""
    link = rootfs / "usr" / "bin" / "python3"
    match = re.fullmatch(r"python(3\.\d+)", Path(link.readlink()).name if link.is_symlink() else "")
    if match is None:
        raise ImageError(f"image {rootfs}: /usr/bin/python3 is not a link to a python3.X interpreter")
    return match.group(1)


def image_glibc(rootfs: Path) -> str:
    """The image's glibc version, `2_36`, from its dpkg status (the manylinux tag its wheels may carry)."""
    status = (rootfs / "var" / "lib" / "dpkg" / "status").read_text(errors="replace")
    match = re.search(r"^Package: libc6\n(?:[^\n]+\n)*?Version: (\d+)\.(\d+)", status, re.MULTILINE)
    if match is None:
        raise ImageError(f"image {rootfs}: no libc6 version in its dpkg status")
    return f"{match.group(1)}_{match.group(2)}"


def layer_path(packages: Sequence[str], python: str, glibc: str, *, cache: Path | None = None) -> Path:
    key = {"pip": sorted(packages), "python": python, "platform": _platforms(glibc)[0]}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return (cache or cache_dir()) / "layers" / f"pip-{digest}"


def build_pip_layer(packages: Sequence[str], rootfs: Path, *, cache: Path | None = None) -> Path:
    """The layer holding `packages` for `rootfs`'s Python, built with pip unless cached; its `site/` goes on
    PYTHONPATH. Raises ImageError naming pip's failure."""
    python, glibc = image_python(rootfs), image_glibc(rootfs)
    final = layer_path(packages, python, glibc, cache=cache)
    if (final / MANIFEST).is_file():
        return final
    with _locked(final):
        if (final / MANIFEST).is_file():
            return final
        _remove_stale_work(final)
        work = Path(tempfile.mkdtemp(prefix=f".tmp-{final.name}-", dir=final.parent))
        try:
            tree = work / "layer"
            argv = [
                sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-compile",
                "--target", str(tree / SITE), "--only-binary=:all:", "--implementation", "cp",
                "--python-version", python, *(f"--platform={tag}" for tag in _platforms(glibc)), *packages,
            ]  # fmt: skip
            _run_logged(argv, work / "pip.log", f"pip install {' '.join(packages)}")
            frozen = sorted(p.name.removesuffix(".dist-info") for p in (tree / SITE).glob("*.dist-info"))
            manifest = {
                "pip": list(packages),
                "python": python,
                "platform": _platforms(glibc)[0],
                "installed": frozen,
            }
            (tree / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
            if final.exists():
                shutil.rmtree(final)
            tree.rename(final)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return final


def _platforms(glibc: str) -> list[str]:
    """The wheel platform tags a glibc `2_36` runs, newest first: pip takes a custom platform literally."""
    major, minor = (int(part) for part in glibc.split("_"))
    machine = platform.machine()
    legacy = [f"manylinux{name}_{machine}" for name, since in (("2014", 17), ("2010", 12), ("1", 5)) if minor >= since]
    return [*(f"manylinux_{major}_{m}_{machine}" for m in range(minor, 4, -1)), *legacy]
