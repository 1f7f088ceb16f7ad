"""Package layers: a harness's pip or npm packages installed on the host, bound read-only into its sandboxes.

A harness (mini-swe-agent, Codex CLI, ...) needs packages the Debian image lacks, and the sandbox has no network to
fetch them. Building an image variant per harness costs an mmdebstrap run (~20 s, 180 MB) and a copy of the base
tree; a layer is only what the package manager adds, cached by a hash of the pinned list and what it was built for,
built under the images' lock like a rootfs, with a manifest of what was installed. pip: `pip install --target` with
wheels for the image's Python and glibc (read from its python3 link and dpkg status), on PYTHONPATH as `site/`.
npm: `npm install` of packages that carry a native executable for this platform (Codex CLI's static musl binary),
linked into the layer's `bin/`, so the image needs no node. Pinned top-level packages, resolved at build time: the
cache key is the list, so a built layer never changes under a task.
"""

from __future__ import annotations

import hashlib
import json
import platform
import re
import shutil
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from nemo_gym_prorl.sandbox.images import (
    ImageError,
    _locked,
    _remove_stale_work,
    _run_logged,
    cache_dir,
)

MANIFEST = "prorl-layer.json"
"""Written into a layer once its packages are installed: the list, what it was built for, what got installed."""
SITE = "site"
BIN = "bin"
"""A layer's native commands (npm): on PATH in the sandbox."""


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
    return _cached("pip", {"pip": sorted(packages), "python": python, "platform": _platforms(glibc)[0]}, cache)


def build_pip_layer(packages: Sequence[str], rootfs: Path, *, cache: Path | None = None) -> Path:
    """The layer holding `packages` for `rootfs`'s Python, built with pip unless cached; its `site/` goes on
    PYTHONPATH. Raises ImageError naming pip's failure."""
    python, glibc = image_python(rootfs), image_glibc(rootfs)

    def install(tree: Path, work: Path) -> dict[str, Any]:
        argv = [
            sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-compile",
            "--target", str(tree / SITE), "--only-binary=:all:", "--implementation", "cp",
            "--python-version", python, *(f"--platform={tag}" for tag in _platforms(glibc)), *packages,
        ]  # fmt: skip
        _run_logged(argv, work / "pip.log", f"pip install {' '.join(packages)}")
        frozen = sorted(p.name.removesuffix(".dist-info") for p in (tree / SITE).glob("*.dist-info"))
        return {"pip": list(packages), "python": python, "platform": _platforms(glibc)[0], "installed": frozen}

    return _built(layer_path(packages, python, glibc, cache=cache), install)


def npm_layer_path(packages: Sequence[str], *, cache: Path | None = None) -> Path:
    return _cached("npm", {"npm": sorted(packages), "platform": _npm_platform()}, cache)


def build_npm_layer(packages: Sequence[str], *, cache: Path | None = None) -> Path:
    """The layer holding `packages` (`name@version`) installed by the host's npm unless cached, each command they
    declare linked in `bin/` to the native executable of that name their platform packages carry (what the
    package's node launcher would exec). Raises ImageError naming npm's failure, or a command with no native
    executable (it needs node, which the image lacks)."""

    def install(tree: Path, work: Path) -> dict[str, Any]:
        argv = [
            "npm", "install", "--prefix", str(tree), "--no-save", "--no-audit", "--no-fund", "--ignore-scripts",
            "--no-update-notifier", "--loglevel=error", "--cache", str(work / "npm-cache"), *packages,
        ]  # fmt: skip
        _run_logged(argv, work / "npm.log", f"npm install {' '.join(packages)}")
        modules = tree / "node_modules"
        commands = {name: _native(modules, name) for package in packages for name in _commands(modules, package)}
        (tree / BIN).mkdir()
        for name, target in commands.items():
            (tree / BIN / name).symlink_to(Path("..") / target.relative_to(tree))
        lock = json.loads((modules / ".package-lock.json").read_text())["packages"]
        installed = sorted(f"{path.removeprefix('node_modules/')}@{info.get('version')}" for path, info in lock.items()
                           if path)  # fmt: skip
        return {"npm": list(packages), "platform": _npm_platform(), "installed": installed,
                "bin": {name: str(target.relative_to(tree)) for name, target in commands.items()}}  # fmt: skip

    return _built(npm_layer_path(packages, cache=cache), install)


def _cached(kind: str, key: dict[str, Any], cache: Path | None) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return (cache or cache_dir()) / "layers" / f"{kind}-{digest}"


def _built(final: Path, install: Callable[[Path, Path], dict[str, Any]]) -> Path:
    """`final`, unless cached built by `install(tree, work)` into a temp tree under the lock and renamed into place
    with the manifest it returns: a failed or killed build leaves nothing that passes for a layer."""
    if (final / MANIFEST).is_file():
        return final
    with _locked(final):
        if (final / MANIFEST).is_file():
            return final
        _remove_stale_work(final)
        work = Path(tempfile.mkdtemp(prefix=f".tmp-{final.name}-", dir=final.parent))
        try:
            tree = work / "layer"
            tree.mkdir()
            manifest = install(tree, work)
            (tree / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
            if final.exists():
                shutil.rmtree(final)
            tree.rename(final)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return final


def _commands(modules: Path, package: str) -> list[str]:
    """The command names an installed npm package declares (its package.json `bin`)."""
    name = package.rpartition("@")[0]
    meta = json.loads((modules / name / "package.json").read_text())
    declared = meta.get("bin") or {}
    return [name.rpartition("/")[2]] if isinstance(declared, str) else sorted(declared)


def _native(modules: Path, command: str) -> Path:
    """The native executable named `command` inside the installed packages (a platform package's `bin/`)."""
    found = sorted(p for p in modules.glob(f"**/bin/{command}") if p.is_file() and not p.is_symlink() and _is_elf(p))
    if not found:
        raise ImageError(f"npm layer: command {command!r} has no native executable in its packages for "
                         f"{_npm_platform()}: it needs node, which the image lacks")  # fmt: skip
    return found[0]


def _is_elf(path: Path) -> bool:
    with path.open("rb") as f:
        return f.read(4) == b"\x7fELF"


def _npm_platform() -> str:
    """The platform npm picks optional dependencies for here, and the sandbox runs them on (the host's kernel)."""
    return f"{sys.platform}-{platform.machine()}"


def _platforms(glibc: str) -> list[str]:
    """The wheel platform tags a glibc `2_36` runs, newest first: pip takes a custom platform literally."""
    major, minor = (int(part) for part in glibc.split("_"))
    machine = platform.machine()
    legacy = [f"manylinux{name}_{machine}" for name, since in (("2014", 17), ("2010", 12), ("1", 5)) if minor >= since]
    return [*(f"manylinux_{major}_{m}_{machine}" for m in range(minor, 4, -1)), *legacy]
