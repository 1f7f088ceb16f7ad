"""Sandbox images: a Debian root filesystem built with mmdebstrap, and the Apptainer SIF made from it.

`build_rootfs(spec)` builds a `minbase` Debian tree holding the packages the math, code and SWE tasks need, from the
host's configured apt sources (read through apt itself, so `.list` and deb822 files both count). The tree is
content-addressed: its directory name carries a hash of the suite, the package list and the apt sources, so a
second call with the same spec returns the same path without building. Builds go to a temp dir beside the cache
entry and are renamed into place when complete, under a file lock, so concurrent builders never see half a tree.
`IMAGES` names the specs tasks ask for: `default` (the math, code and SWE tasks) and `scientific` (that plus
pandas, matplotlib, scikit-learn and the rest of what BigCodeBench's tests import).

The same tree serves both backends: bubblewrap uses the directory itself (`SandboxSpec(image=str(rootfs))`) and
Apptainer either the directory or `build_sif(rootfs)`, a squashfs image cached next to it.

Cache: `$PRORL_IMAGE_CACHE`, else `~/.cache/nemo-gym-prorl/images`. `python -m nemo_gym_prorl.sandbox.images
--help` (or `prorl image build [--image scientific]`) builds from the command line.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import functools
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from nemo_gym_prorl.sandbox.apptainer_binary import find_apptainer

CACHE_ENV = "PRORL_IMAGE_CACHE"
DEFAULT_PACKAGES: tuple[str, ...] = (
    "python3",
    "python3-pytest",
    "python3-numpy",
    "git",
    "patch",
    "make",
    "gcc",
    "libc6-dev",
    "python3-dev",
    "python3-pip",
    "python3-setuptools",
    "python3-wheel",
    "python3-hatchling",
    "python3-setuptools-scm",
    "procps",
    "less",
)
"""Math (python3 with numpy), code (pytest) and SWE (git, patch, make, a C compiler with Python's headers for
repositories whose install builds C extensions, and pip with the common build backends, so a project installs
itself offline the way its packaging says: `pip install -e . --no-build-isolation`) tasks, and a usable shell.
The backends also rely on coreutils' `env` and util-linux's `setpriv` and `prlimit`, which every Debian minbase
holds."""

SCIENTIFIC_PACKAGES: tuple[str, ...] = (
    *DEFAULT_PACKAGES,
    "python3-pandas",
    "python3-matplotlib",
    "python3-sklearn",
    "python3-scipy",
    "python3-psutil",
    "python3-seaborn",
    "python3-wordcloud",
    "python3-statsmodels",
    "python3-sympy",
    "python3-nltk",
    "python3-requests",
    "python3-bs4",
    "python3-lxml",
    "python3-openpyxl",
    "python3-pil",
    "python3-tz",
    "python3-dateutil",
    "python3-yaml",
    "python3-regex",
    "python3-natsort",
    "python3-chardet",
    "python3-xmltodict",
    "python3-texttable",
)
"""BigCodeBench's libraries as far as Debian packages them (its rows' tests import pandas, matplotlib, seaborn,
scikit-learn, psutil, wordcloud, ...): the default packages plus the scientific stack. Not in Debian 12, so rows
that need them cannot pass here: tensorflow, keras, librosa, faker, textblob, blake3."""

MANIFEST = "etc/prorl-image.json"
"""Written into every rootfs (relative to its root) once the build completed: the spec and the apt sources."""

_FORMAT = 2  # bump when the way a tree is built changes in a way the key below does not see
# Run by mmdebstrap on the finished tree ($1): mount points for the sandboxes' binds (read-only trees cannot grow
# them later); a plain `agent` user for the unprivileged uid 1000 bwrap runs as; no apt lists or caches; and what
# Apptainer needs to start an instance from the directory itself (`apptainer build` adds the same to a SIF): an
# (empty) startscript and the start action, whose SIGCONT releases the container's init. Apptainer's other actions
# are built into it.
_CUSTOMIZE = """set -e
mkdir -p "$1/workspace" "$1/.prorl" "$1/.singularity.d/actions" "$1/.singularity.d/env" "$1/.singularity.d/libs"
grep -q '^agent:' "$1/etc/passwd" || echo 'agent:x:1000:1000:agent:/workspace:/bin/bash' >> "$1/etc/passwd"
grep -q '^agent:' "$1/etc/group" || echo 'agent:x:1000:' >> "$1/etc/group"
rm -rf "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/*.bin
printf '#!/bin/sh\\nkill -CONT 1\\n' > "$1/.singularity.d/actions/start"
printf '#!/bin/sh\\n' > "$1/.singularity.d/startscript"
chmod 755 "$1/.singularity.d/actions/start" "$1/.singularity.d/startscript"
"""
_DPKG_EXCLUDES = ("/usr/share/man/*", "/usr/share/info/*", "/usr/share/locale/*", "/usr/share/doc/*")


class ImageError(RuntimeError):
    """An image could not be built (the message says which step failed and why)."""


class ImageSpec(BaseModel):
    """What goes into a rootfs. Equal specs built from the same apt sources give the same cached tree."""

    model_config = ConfigDict(frozen=True)

    name: str = Field("prorl-base", pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$", description="prefix of the cache entry")
    suite: str | None = Field(None, description="Debian suite; None: the host's release (VERSION_CODENAME)")
    packages: tuple[str, ...] = Field(DEFAULT_PACKAGES, description="installed on top of the minbase variant")
    path_excludes: tuple[str, ...] = Field(
        (), description="dpkg path-exclude patterns: files of the packages left out, beside docs and manuals"
    )
    path_includes: tuple[str, ...] = Field((), description="dpkg path-include patterns kept from `path_excludes`")


IMAGES: dict[str, ImageSpec] = {
    "default": ImageSpec(),
    "scientific": ImageSpec(
        name="prorl-scientific",
        packages=SCIENTIFIC_PACKAGES,
        # Debian's wordcloud takes its one font from texlive-fonts-extra: 1.6 GB of TeX fonts. Keep that font
        # (dpkg recreates only an included file's own folder: each folder above it is named) and what TeX's
        # install scripts read (font maps, encodings), and build no TeX formats (they need the fonts).
        path_excludes=("/usr/share/texlive/texmf-dist/fonts/*", "/var/lib/tex-common/fmtutil-cnf/texlive/*"),
        path_includes=tuple(
            f"/usr/share/texlive/texmf-dist/fonts/{kept}" for kept in ("map*", "enc*", "truetype", "truetype/ascender*")
        ),
    ),
}
"""The images a task file (a code task's `verifier.image`) or `prorl image build --image NAME` names."""


def cache_dir() -> Path:
    """Where images are kept: `$PRORL_IMAGE_CACHE`, else `/var/cache/nemo-gym-prorl/images` for root (root's home
    is private, and bwrap reads images as an unprivileged user), else `~/.cache/nemo-gym-prorl/images`."""
    configured = os.environ.get(CACHE_ENV)
    if configured:
        return Path(configured).expanduser()
    if os.geteuid() == 0:
        return Path("/var/cache/nemo-gym-prorl/images")
    return Path.home() / ".cache" / "nemo-gym-prorl" / "images"


def host_release() -> str:
    """The host's Debian codename (e.g. `bookworm`)."""
    with contextlib.suppress(OSError):
        for line in Path("/etc/os-release").read_text().splitlines():
            key, _, value = line.partition("=")
            if key == "VERSION_CODENAME" and value.strip('"'):
                return value.strip('"')
    raise ImageError("cannot tell the host's Debian release: /etc/os-release has no VERSION_CODENAME")


@functools.cache
def apt_sources(suite: str) -> tuple[str, ...]:
    """One-line `deb` entries for `suite`, taken from the host's configured apt sources (read once per process).

    For the host's own release this is every configured entry of that release (updates and security included);
    for another suite, the host's main Debian mirror with that suite.
    """
    host = host_release()
    try:
        listing = subprocess.run(
            ["apt-get", "indextargets", "--format", "$(RELEASE)\t$(REPO_URI)\t$(COMPONENT)", "Identifier: Packages"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        raise ImageError(f"cannot read the host's apt sources (apt-get indextargets): {e}") from e
    components: dict[tuple[str, str], set[str]] = {}
    for line in listing.splitlines():
        parts = line.split("\t")
        if len(parts) == 3 and all(parts):
            components.setdefault((parts[0], parts[1]), set()).add(parts[2])
    if suite == host:
        chosen = {key: comps for key, comps in components.items() if key[0] == host or key[0].startswith(host + "-")}
    else:
        chosen = {(suite, uri): comps for (release, uri), comps in components.items() if release == host}
    if not chosen:
        raise ImageError(f"no apt source for {host!r} is configured on this host (see /etc/apt/sources.list.d/)")
    return tuple(sorted(f"deb {uri} {release} {' '.join(sorted(comps))}" for (release, uri), comps in chosen.items()))


def rootfs_path(spec: ImageSpec, *, cache: Path | None = None) -> Path:
    """Where `spec`'s tree is (or will be) cached; reads the host's apt sources, which are part of the key."""
    return _plan(spec, cache)[2]


def _plan(spec: ImageSpec, cache: Path | None) -> tuple[str, tuple[str, ...], Path]:
    suite = spec.suite or host_release()
    sources = apt_sources(suite)
    key = {
        "format": _FORMAT,
        "variant": "minbase",
        "recipe": [_CUSTOMIZE, *_DPKG_EXCLUDES],
        "suite": suite,
        "packages": sorted(set(spec.packages)),
        "sources": list(sources),
    }
    if spec.path_excludes or spec.path_includes:  # absent otherwise: the keys of trees built before stay valid
        key["paths"] = {"exclude": list(spec.path_excludes), "include": list(spec.path_includes)}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return suite, sources, (cache or cache_dir()) / f"{spec.name}-{suite}-{digest}"


def is_built(rootfs: Path) -> bool:
    return (rootfs / MANIFEST).is_file()


def build_rootfs(spec: ImageSpec | None = None, *, cache: Path | None = None) -> Path:
    """The rootfs directory for `spec`, built with mmdebstrap unless it is cached already."""
    spec = spec or ImageSpec()
    suite, sources, final = _plan(spec, cache)
    if is_built(final):
        return final
    with _locked(final):
        if is_built(final):  # another process built it while we waited
            return final
        _remove_stale_work(final)
        work = Path(tempfile.mkdtemp(prefix=f".tmp-{final.name}-", dir=final.parent))
        try:
            tree = work / "rootfs"
            _mmdebstrap(spec, suite, sources, tree, log=work / "mmdebstrap.log")
            manifest = {"spec": spec.model_dump(mode="json"), "suite": suite, "sources": list(sources)}
            (tree / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
            if final.exists():  # a stale, incomplete entry (no manifest): replace it
                shutil.rmtree(final)
            tree.rename(final)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return final


def sif_path(rootfs: Path) -> Path:
    """Where the SIF of `rootfs` is cached: beside it for trees in the cache, else keyed by the tree's path."""
    rootfs = rootfs.resolve()
    if is_built(rootfs):  # our trees never change after the build, so the name is key enough
        return rootfs.with_name(rootfs.name + ".sif")
    digest = hashlib.sha256(str(rootfs).encode()).hexdigest()[:12]
    return cache_dir() / "sif" / f"{rootfs.name}-{digest}.sif"


def build_sif(rootfs: Path, *, apptainer: str | None = None, force: bool = False) -> Path:
    """A SIF made from the directory `rootfs` with `apptainer build`, cached (see `sif_path`; `force` rebuilds)."""
    rootfs = Path(rootfs)
    if not rootfs.is_dir():
        raise ImageError(f"rootfs {rootfs} is not a directory")
    target = sif_path(rootfs)
    if target.is_file() and not force:
        return target
    binary = apptainer or find_apptainer()
    target.parent.mkdir(parents=True, exist_ok=True)
    with _locked(target):
        if target.is_file() and not force:
            return target
        _remove_stale_work(target)
        work = Path(tempfile.mkdtemp(prefix=f".tmp-{target.name}-", dir=target.parent))
        try:
            partial = work / target.name
            env = {**os.environ, "APPTAINER_TMPDIR": str(work)}
            argv = [binary, "-q", "build", "--mksquashfs-args", "-comp zstd", str(partial), str(rootfs)]
            _run_logged(argv, work / "build.log", "apptainer build", env=env)
            partial.replace(target)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return target


# -- internals -------------------------------------------------------------------------------------------------


def _mmdebstrap(spec: ImageSpec, suite: str, sources: Sequence[str], tree: Path, *, log: Path) -> None:
    if shutil.which("mmdebstrap") is None:
        raise ImageError("mmdebstrap is not installed; run scripts/install_apptainer.sh (it installs it)")
    argv = [
        "mmdebstrap",
        "--variant=minbase",
        "--format=directory",
        f"--include={','.join(sorted(set(spec.packages)))}",
        # A mirror snapshot's Release files may be past their Valid-Until date; apt on the host accepts them too.
        '--aptopt=Acquire::Check-Valid-Until "false"',
        '--aptopt=Acquire::Languages "none"',
        *(f"--dpkgopt=path-exclude={pattern}" for pattern in (*_DPKG_EXCLUDES, *spec.path_excludes)),
        *(f"--dpkgopt=path-include={pattern}" for pattern in ("/usr/share/doc/*/copyright", *spec.path_includes)),
        f"--customize-hook={_CUSTOMIZE}",
        suite,
        str(tree),
        *sources,
    ]
    _run_logged(argv, log, "mmdebstrap")


def _run_logged(argv: Sequence[str], log: Path, what: str, env: dict[str, str] | None = None) -> None:
    with log.open("wb") as out:
        try:
            proc = subprocess.run(
                argv, check=False, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env
            )
        except OSError as e:
            raise ImageError(f"{what} could not be started: {e}") from e
    if proc.returncode != 0:
        tail = log.read_text(errors="replace")[-3000:]
        raise ImageError(f"{what} failed (exit {proc.returncode}):\n{tail}")


def _remove_stale_work(entry: Path) -> None:
    """Remove temp dirs of earlier builds of `entry` that were killed mid-way (we hold its lock: none is live)."""
    for stale in entry.parent.glob(f".tmp-{entry.name}-*"):
        shutil.rmtree(stale, ignore_errors=True)


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive lock on `path`'s build, shared by all processes that use the same cache."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(f".{path.name}.lock"), "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def main(argv: Sequence[str] | None = None) -> int:
    """`prorl image build [--image NAME]`: build (or find cached) the rootfs, and with `--sif` its SIF; print their
    paths."""
    parser = argparse.ArgumentParser(prog="prorl image build", description=main.__doc__)
    parser.add_argument(
        "--image", choices=IMAGES, default="default", help="the named image to start from (default: %(default)s)"
    )
    parser.add_argument("--name", default=None, help="cache entry prefix (default: the named image's)")
    parser.add_argument("--suite", default=None, help="Debian suite (default: the host's release)")
    parser.add_argument(
        "--packages", default=None, help="comma-separated packages on top of minbase (default: the named image's)"
    )
    parser.add_argument("--add", default="", help="comma-separated packages added to --packages")
    parser.add_argument("--sif", action="store_true", help="also build the Apptainer SIF")
    parser.add_argument("--cache", type=Path, default=None, help=f"cache dir (default: ${CACHE_ENV} or ~/.cache/...)")
    args = parser.parse_args(argv)
    named = IMAGES[args.image]
    listed = named.packages if args.packages is None else args.packages.split(",")
    packages = tuple(p.strip() for p in [*listed, *args.add.split(",")] if p.strip())
    chosen = {"name": args.name or named.name, "suite": args.suite or named.suite, "packages": packages}
    spec = ImageSpec.model_validate(named.model_dump() | chosen)
    try:
        rootfs = build_rootfs(spec, cache=args.cache)
        print(f"rootfs: {rootfs}")
        if args.sif:
            print(f"sif: {build_sif(rootfs)}")
    except ImageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
