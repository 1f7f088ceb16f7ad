"""A sandbox's workspace from the host's side: paths confined to it, and files moved in and out without leaving it.

Every backend gives its sandbox a workspace (at `SandboxSpec.workspace` inside, /workspace unless set) and takes
`write_file`/`read_file` paths relative to it or absolute under it. Two ways to check such a path:

- `HostWorkspace`, for a workspace the host can open (a plain bwrap or Apptainer sandbox): every path is looked
  up by the kernel beneath the workspace's directory (`openat2` with RESOLVE_BENEATH): symlinks and `..` are
  followed as the sandbox would follow them, and one that leads outside is refused during the lookup itself, so
  no link the sandbox swaps in meanwhile can redirect the host's I/O. The file itself is opened without blocking and
  used only if it is a regular file (`open_regular`): a FIFO the sandbox made would otherwise hold a host thread
  forever. Reads are capped (`read_capped`). As root, what it creates belongs to the sandbox's host uid.
- `lexical_relative()`, for a workspace the host cannot open itself (a fork's overlay, a NeMo Gym provider's): it
  only follows `..`; symlinks are left to whatever does the I/O inside.

`overlay_changes()` lists what a fork changed; `remove_tree()` removes a sandbox's host dirs, read-only ones too.
"""

from __future__ import annotations

import contextlib
import errno
import os
import posixpath
import shutil
import stat
from collections.abc import Callable, Iterator
from pathlib import Path, PurePosixPath
from typing import BinaryIO

from nemo_gym_prorl.contracts.sandbox import (
    WORKSPACE,
    FileTooLargeError,
    NotARegularFileError,
    PathOutsideWorkspaceError,
)
from nemo_gym_prorl.sandbox.limits import file_kind
from nemo_gym_prorl.sandbox.syscalls import open_beneath


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
    """The host directory a sandbox sees as its workspace; see the module docstring."""

    def __init__(
        self, directory: Path, owner_uid: int | None = None, max_read_bytes: int | None = None, inside: str = WORKSPACE
    ) -> None:
        self.directory = directory
        self.inside = inside
        """Where the sandbox sees the directory (`SandboxSpec.workspace`): absolute paths under it are accepted."""
        self.owner_uid = owner_uid
        """Host uid (and gid) that what `write()` creates is given to; None: left to the caller."""
        self.max_read_bytes = max_read_bytes
        """Largest file `read()` returns; None: no limit."""

    def write(self, path: str, data: bytes) -> None:
        """Write `data` at `path`, making its parent directories."""
        rel = self._relative(path)
        with self._opened_root() as root:
            self._make_parents(root, rel)
            fd = open_regular(root, str(rel), os.O_WRONLY | os.O_CREAT, path, self.inside)
        with open(fd, "wb") as f:
            os.ftruncate(fd, 0)  # not O_TRUNC: what is there is checked to be a regular file first
            if self.owner_uid is not None:
                os.fchown(fd, self.owner_uid, self.owner_uid)
            f.write(data)

    def read(self, path: str) -> bytes:
        """The file at `path`, at most `max_read_bytes` of it (FileTooLargeError past that)."""
        rel = self._relative(path)
        with self._opened_root() as root:
            fd = open_regular(root, str(rel), os.O_RDONLY, path, self.inside)
        with open(fd, "rb") as f:
            return read_capped(f, self.max_read_bytes, path)

    def _relative(self, path: str) -> PurePosixPath:
        rel = _strip_root(path, (self.inside,))
        if posixpath.normpath(rel) == ".":
            raise PathOutsideWorkspaceError(f"path {path!r} names the workspace itself, not a file in it")
        return rel

    @contextlib.contextmanager
    def _opened_root(self) -> Iterator[int]:
        fd = os.open(self.directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            yield fd
        finally:
            os.close(fd)

    def _make_parents(self, root: int, rel: PurePosixPath) -> None:
        """Make the missing directories on the way to `rel`, each in its parent as looked up beneath `root`."""
        parts = rel.parent.parts
        for depth, part in enumerate(parts):
            try:
                os.close(_open_beneath(root, "/".join(parts[: depth + 1]), os.O_RDONLY | os.O_DIRECTORY, self.inside))
                continue
            except FileNotFoundError:
                pass
            parent = _open_beneath(root, "/".join(parts[:depth]) or ".", os.O_RDONLY | os.O_DIRECTORY, self.inside)
            try:
                os.mkdir(part, 0o755, dir_fd=parent)
                if self.owner_uid is not None:
                    os.chown(part, self.owner_uid, self.owner_uid, dir_fd=parent, follow_symlinks=False)
            except FileExistsError:
                pass
            finally:
                os.close(parent)


def open_regular(root: int, rel: str, flags: int, shown: str, inside: str = WORKSPACE) -> int:
    """Open `rel`, looked up beneath the directory `root` (`_open_beneath`), with `flags`, without blocking whatever
    the sandbox put there, and return the fd (blocking again) only if it is a regular file. A FIFO, socket or
    device: NotARegularFileError; a directory: IsADirectoryError (`shown` names the path, `inside` the workspace
    in errors)."""
    try:
        fd = _open_beneath(root, rel, flags | os.O_NONBLOCK | os.O_NOCTTY, inside, shown)
    except OSError as e:
        if e.errno == errno.ENXIO:  # a FIFO without a reader (opened to write), a socket
            raise NotARegularFileError(errno.ENXIO, "not a regular file (a FIFO or socket); refused", shown) from None
        raise
    try:
        mode = os.fstat(fd).st_mode
        if stat.S_ISDIR(mode):
            raise IsADirectoryError(errno.EISDIR, "Is a directory", shown)
        if not stat.S_ISREG(mode):
            raise NotARegularFileError(errno.EINVAL, f"a {file_kind(mode)}, not a regular file; refused", shown)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _open_beneath(root: int, rel: str, flags: int, inside: str, shown: str | None = None) -> int:
    """`open_beneath`, with a way out of the workspace (`..` or a symlink, EXDEV) as PathOutsideWorkspaceError."""
    try:
        return open_beneath(root, rel, flags)
    except OSError as e:
        if e.errno == errno.EXDEV:
            raise PathOutsideWorkspaceError(
                f"path {shown or rel!r} resolves outside {inside} (via '..' or a symlink)"
            ) from None
        if shown is not None:
            e.filename = shown
        raise


def read_capped(f: BinaryIO, limit: int | None, shown: str) -> bytes:
    """All of the open regular file `f`, or FileTooLargeError when it holds more than `limit` bytes (its size is
    checked before reading: a sparse file costs no disk but would cost its whole size in memory)."""
    size = os.fstat(f.fileno()).st_size
    if limit is None:
        return f.read()
    if size <= limit:
        data = f.read(limit + 1)  # it may have grown since
        if len(data) <= limit:
            return data
        size = len(data)
    raise FileTooLargeError(errno.EFBIG, too_large_message(size, limit), shown)


def too_large_message(size: int, limit: int) -> str:
    return (
        f"{size} bytes, more than the {limit} bytes a file read takes (limits.max_read_mb); read parts of it with "
        "a command (head, tail, sed -n, split)"
    )


_OPAQUE_XATTR = "user.overlay.opaque"  # with `userxattr`, as forks mount their overlays


def overlay_changes(upper: Path, limit: int) -> list[str] | None:
    """The paths (relative to the workspace, sorted) an overlay's upper dir `upper` holds: every file, symlink and
    whiteout (a deletion) in it, and each directory that replaced the lower one whole (opaque), not its contents;
    None when there are more than `limit` entries. What a fork changed since its snapshot is exactly these. Each
    directory is opened by its fd, never following a symlink: the sandbox may swap one in meanwhile."""
    changed: list[str] = []
    seen = 0
    stack = [("", os.open(upper, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC))]
    try:
        while stack:
            rel, fd = stack.pop()
            try:
                for entry in os.scandir(fd):
                    seen += 1
                    if seen > limit:
                        return None
                    path = f"{rel}{entry.name}"
                    if not entry.is_dir(follow_symlinks=False):
                        changed.append(path)
                        continue
                    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
                    try:
                        child = os.open(entry.name, flags, dir_fd=fd)
                    except OSError:  # swapped for something else since the look: count it changed
                        changed.append(path)
                        continue
                    if _opaque(child):
                        changed.append(path)
                        os.close(child)
                    else:
                        stack.append((f"{path}/", child))
            finally:
                os.close(fd)
    finally:
        for _, fd in stack:
            os.close(fd)
    return sorted(changed)


def _opaque(dir_fd: int) -> bool:
    try:
        return os.getxattr(dir_fd, _OPAQUE_XATTR) == b"y"
    except OSError:
        return False


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
