"""Where a SWE instance's repository comes from, as a tar of its tree (no history) ready to stage.

``repo_source`` of a row:

- ``sdist:NAME==VERSION#sha256=HEX``: a PyPI source distribution, pinned by version and hash. Fetched once with
  ``pip download --no-deps --no-binary :all:`` into the cache, checked against the hash, and unpacked into a
  normalised tar (sorted entries, fixed owner and time, modes 644/755): the same bytes on every machine. The
  offline suite under ``tasks/swe/`` is built on these, so the repository ships no sdists and runs offline once
  the cache holds them. ``prorl swe generate --sdists DIR`` takes them from a local folder instead of PyPI.
- ``git:PATH``: a local git repository; its tree at the row's ``base_commit`` (``git archive``).
- unset: the image already holds the repository at ``/testbed`` (SWE-bench, SWE-Gym and R2E-Gym images); its tree
  is taken out of the image once (``swe_stage.image_tree``) and cached under ``images/``.

Cache: ``$PRORL_SWE_CACHE``, else ``~/.cache/nemo-gym-prorl/swe``.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import io
import os
import re
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Iterator
from pathlib import Path

CACHE_ENV = "PRORL_SWE_CACHE"
_SDIST = re.compile(r"^sdist:(?P<name>[A-Za-z0-9_.-]+)==(?P<version>[A-Za-z0-9_.+-]+)#sha256=(?P<sha>[0-9a-f]{64})$")


class RepoSourceError(RuntimeError):
    """A repository source that cannot be materialised; the message says which and why."""


def cache_dir() -> Path:
    root = os.environ.get(CACHE_ENV)
    return Path(root) if root else Path.home() / ".cache" / "nemo-gym-prorl" / "swe"


def sdist_source(name: str, version: str, sha256: str) -> str:
    return f"sdist:{name}=={version}#sha256={sha256}"


def check_source(source: str | None) -> None:
    """Raise ValueError for a source string no kind matches (so a row is refused before any sandbox)."""
    if source is None or _SDIST.match(source) or source.startswith("git:"):
        return
    raise ValueError(f"repo_source {source!r} is neither 'sdist:NAME==VERSION#sha256=HEX' nor 'git:PATH'")


def tree_tar(source: str, base_commit: str = "", sdists: Path | None = None) -> bytes:
    """The repository's tree at its base as an uncompressed tar (paths relative to the repository root); an sdist
    not in the cache yet comes from the folder `sdists` when given, else from PyPI."""
    check_source(source)
    if source.startswith("git:"):
        return _git_tree(source.removeprefix("git:"), base_commit)
    match = _SDIST.match(source)
    assert match is not None
    return _sdist_tree(match["name"], match["version"], match["sha"], sdists).read_bytes()


@functools.lru_cache(maxsize=64)
def _git_tree(path: str, commit: str) -> bytes:
    if not commit:
        raise RepoSourceError(f"git source {path}: the row has no base_commit")
    result = subprocess.run(["git", "-C", path, "archive", "--format=tar", commit], capture_output=True, timeout=300)
    if result.returncode != 0:
        raise RepoSourceError(f"git archive {commit} in {path} failed: {result.stderr.decode(errors='replace')}")
    return result.stdout


def _sdist_tree(name: str, version: str, sha256: str, sdists: Path | None) -> Path:
    root = cache_dir()
    tree = root / "trees" / f"{name}-{version}-{sha256[:16]}.tar"
    if tree.is_file():
        return tree
    root.mkdir(parents=True, exist_ok=True)
    with _locked(root / ".lock"):
        if not tree.is_file():
            archive = fetch_sdist(name, version, sha256, sdists)
            tree.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(tree, normalised_tree(archive))
    return tree


def fetch_sdist(name: str, version: str, sha256: str, sdists: Path | None = None) -> Path:
    """The sdist archive in the cache, on first use copied from the folder `sdists` (the file whose hash is
    `sha256`) or else downloaded with pip and checked against `sha256`."""
    target = cache_dir() / "sdists" / sha256
    for existing in target.glob("*") if target.is_dir() else []:
        if _sha256(existing) == sha256:
            return existing
    target.mkdir(parents=True, exist_ok=True)
    if sdists is not None:
        local = next((f for f in sorted(sdists.iterdir()) if f.is_file() and _sha256(f) == sha256), None)
        if local is None:
            raise RepoSourceError(f"no sdist of {name}=={version} with sha256 {sha256} in {sdists}")
        write_atomic(target / local.name, local.read_bytes())
        return target / local.name
    with tempfile.TemporaryDirectory(dir=target) as tmp:
        argv = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
                f"{name}=={version}", "-d", tmp]  # fmt: skip
        result = subprocess.run(argv, capture_output=True, text=True, timeout=600)
        files = list(Path(tmp).iterdir())
        if result.returncode != 0 or len(files) != 1:
            raise RepoSourceError(f"pip download {name}=={version} failed: {result.stderr.strip()[-2000:]}")
        got = _sha256(files[0])
        if got != sha256:
            raise RepoSourceError(f"sdist {files[0].name}: sha256 {got}, expected {sha256} (pinned in the row)")
        final = target / files[0].name
        os.replace(files[0], final)
    return final


def normalised_tree(archive: Path) -> bytes:
    """The sdist's files under its top directory as a tar with sorted names, owner 0, time 0, modes 644/755."""
    out = io.BytesIO()
    with tarfile.open(archive) as src, tarfile.open(fileobj=out, mode="w", format=tarfile.GNU_FORMAT) as dst:
        members = [m for m in src.getmembers() if m.isfile() and "/" in m.name]
        for member in sorted(members, key=lambda m: m.name):
            rel = member.name.split("/", 1)[1]
            if not rel or rel.startswith("/") or ".." in rel.split("/"):
                continue
            info = tarfile.TarInfo(rel)
            info.size, info.mode, info.mtime = member.size, 0o755 if member.mode & 0o111 else 0o644, 0
            data = src.extractfile(member)
            assert data is not None
            dst.addfile(info, data)
    return out.getvalue()


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def write_atomic(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    with open(path, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
