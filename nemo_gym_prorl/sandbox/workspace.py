"""A sandbox's workspace from the host's side: paths confined to it, and files moved in and out without leaving it.

Every backend gives its sandbox a workspace (`WORKSPACE`, /workspace, inside) and takes `write_file`/`read_file`
paths relative to it or absolute under it. Two ways to check such a path:

- `HostWorkspace`, for a workspace that is a host directory (a plain bwrap or Apptainer sandbox): `resolve()`
  rejects a path that leads outside, by `..` or through a symlink, and `write()`/`read()` walk to the file one
  directory at a time without following symlinks (`O_NOFOLLOW` at each step), so a link the sandbox swaps in after
  the check cannot redirect the host's I/O. As root, what it creates belongs to the sandbox's host uid.
- `lexical_relative()`, for a workspace the host cannot open itself (a fork's overlay, a NeMo Gym provider's): it
  only follows `..`; symlinks are left to whatever does the I/O inside.

`remove_tree()` removes a sandbox's host dirs, read-only ones its processes left behind included.
"""

from __future__ import annotations

import os
import posixpath
import shutil
import stat
from collections.abc import Callable
from pathlib import Path, PurePosixPath

from nemo_gym_prorl.sandbox.base import WORKSPACE, PathOutsideWorkspaceError


def lexical_relative(path: str, root: str = WORKSPACE, *, aliases: tuple[str, ...] = ()) -> PurePosixPath:
    """`path` (relative to `root`, or absolute under `root` or one of `aliases`) as a normalised path relative to
    `root`; PathOutsideWorkspaceError if it names `root` itself or leads out of it by `..`."""
    joined = PurePosixPath(posixpath.normpath(f"{root}/{_strip_root(path, (root, *aliases))}"))
    if joined == PurePosixPath(root):
        raise PathOutsideWorkspaceError(f"path {path!r} names the workspace itself, not a file in it")
    if not joined.is_relative_to(root):
        raise PathOutsideWorkspaceError(f"path {path!r} resolves outside {root} (via '..')")
    return joined.relative_to(root)


class HostWorkspace:
    """The host directory a sandbox sees at /workspace; see the module docstring."""

    def __init__(self, directory: Path, owner_uid: int | None = None) -> None:
        self.directory = directory
        self.owner_uid = owner_uid
        """Host uid (and gid) that what `write()` creates is given to; None: left to the caller."""

    def resolve(self, path: str) -> PurePosixPath:
        """`path` relative to the workspace, symlinks resolved; PathOutsideWorkspaceError if that leaves it."""
        root = os.path.realpath(self.directory)
        resolved = os.path.realpath(os.path.join(root, _strip_root(path, (WORKSPACE,))))
        if resolved == root:
            raise PathOutsideWorkspaceError(f"path {path!r} names the workspace itself, not a file in it")
        if not resolved.startswith(root + os.sep):
            raise PathOutsideWorkspaceError(f"path {path!r} resolves outside {WORKSPACE} (via '..' or a symlink)")
        return PurePosixPath(os.path.relpath(resolved, root))

    def write(self, path: str, data: bytes) -> None:
        """Write `data` at `path`, making its parent directories."""
        rel = self.resolve(path)
        dir_fd = self._open_dir(rel.parent.parts, create=True)
        try:
            fd = os.open(rel.name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644, dir_fd=dir_fd)
        finally:
            os.close(dir_fd)
        with open(fd, "wb") as f:
            if self.owner_uid is not None:
                os.fchown(fd, self.owner_uid, self.owner_uid)
            f.write(data)

    def read(self, path: str) -> bytes:
        rel = self.resolve(path)
        dir_fd = self._open_dir(rel.parent.parts, create=False)
        try:
            fd = os.open(rel.name, os.O_RDONLY | os.O_NOFOLLOW, dir_fd=dir_fd)
        finally:
            os.close(dir_fd)
        with open(fd, "rb") as f:
            return f.read()

    def _open_dir(self, parts: tuple[str, ...], create: bool) -> int:
        """Open the workspace subdirectory `parts` without following symlinks, so a link swapped in from inside
        after `resolve()` checked the path cannot redirect host-side I/O outside the workspace."""
        fd = os.open(self.directory, os.O_RDONLY | os.O_DIRECTORY)
        try:
            for part in parts:
                if create:
                    try:
                        os.mkdir(part, 0o755, dir_fd=fd)
                        if self.owner_uid is not None:
                            os.chown(part, self.owner_uid, self.owner_uid, dir_fd=fd, follow_symlinks=False)
                    except FileExistsError:
                        pass
                child = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
                os.close(fd)
                fd = child
        except BaseException:
            os.close(fd)
            raise
        return fd


def remove_tree(path: str | os.PathLike[str]) -> None:
    """`shutil.rmtree`, also through the directories without permissions a sandbox leaves behind (read-only ones
    its processes made, overlayfs's mode-000 `work/work`), which only matters when not running as root."""
    shutil.rmtree(path, onexc=_make_writable_and_retry)


def _strip_root(path: str, roots: tuple[str, ...]) -> PurePosixPath:
    """`path` relative to the first of `roots` it is under, as given when relative; outside all of them: an error."""
    pure = PurePosixPath(path)
    if not pure.is_absolute():
        return pure
    for root in roots:
        if pure.is_relative_to(root):
            return pure.relative_to(root)
    raise PathOutsideWorkspaceError(f"path {path!r} is outside {roots[0]}")


def _make_writable_and_retry(_func: Callable[..., object], path: str, exc: BaseException) -> None:
    """Give the owner full access to `path`'s directory (and to `path`, a directory) and remove `path` again."""
    if isinstance(exc, FileNotFoundError):
        return
    parent = os.path.dirname(path)
    os.chmod(parent, os.stat(parent).st_mode | stat.S_IRWXU)
    mode = os.lstat(path).st_mode
    if stat.S_ISDIR(mode):
        os.chmod(path, mode | stat.S_IRWXU)
        shutil.rmtree(path, onexc=_make_writable_and_retry)
    else:
        os.unlink(path)
