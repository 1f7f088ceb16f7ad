"""A sandbox's writable space with a total size the kernel enforces: an ext4 filesystem in a sparse image file.

`limits.file_size_mb` caps each file a process writes; nothing in it caps their sum. `SandboxDisk.create()` writes
a freshly formatted ext4 filesystem of `disk_mb` into a sparse file in the sandbox's temp dir (no journal, no reserved
blocks, inode tables left uninitialised, the root directory owned by the sandbox's host uid; `mkfs.ext4` runs once
per size, each sandbox copies its ~2 MB of metadata) and mounts it through a loop device (autoclear) at the
directory the sandbox writes to. Writing past its size is "No space left on device" inside the sandbox and nothing
more; the host's filesystem only holds the blocks actually written (the image is sparse and mounted with `discard`,
so deleted files give their blocks back).

Why this and not the alternatives: a size-capped tmpfs is memory (a 2 GiB workspace would be 2 GiB of RAM per
sandbox); project quotas need the host filesystem mounted with `prjquota` (it is not here, and it cannot be changed
from a service); a loop-mounted image costs a few milliseconds at start and at close (attach and mount; unmount) and
needs root. Without root (`available()` is False) sandboxes get no total, only the per-file limit.

The mount lives in the host's mount namespace while the sandbox runs (the sandboxes bind it, and host-side file I/O
uses it); `unmount()` detaches it and the loop device goes with it. A process that dies without closing its
sandboxes leaves the mount: `unmount_under()` removes every mount below a dead sandbox's temp dir before the orphan
sweep removes the dir.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import functools
import os
import shutil
import struct
import subprocess
import tempfile
from pathlib import Path

from nemo_gym_prorl.sandbox.base import SandboxError

_IMAGE = "disk.img"
_MNT_DETACH = 2
_MS_NOSUID, _MS_NODEV, _MS_BIND = 2, 4, 4096
_MKFS_OPTIONS = ["-q", "-F", "-O", "^has_journal", "-m", "0"]
_MOUNT_OPTIONS = b"noinit_itable,discard"
_LOOP_CTL_GET_FREE, _LOOP_CONFIGURE, _LO_FLAGS_AUTOCLEAR = 0x4C82, 0x4C0A, 4
_LOOP_INFO64 = "=5Q4I64s64s32s2Q"  # struct loop_info64


@functools.cache
def available() -> bool:
    """Whether this process can give sandboxes a disk of their own: root, with mkfs.ext4 and loop devices."""
    return os.geteuid() == 0 and shutil.which("mkfs.ext4") is not None and os.path.exists("/dev/loop-control")


class SandboxDisk:
    """One sandbox's filesystem image, mounted at `mount_point`; see the module docstring."""

    def __init__(self, image: Path, mount_point: Path) -> None:
        self.image = image
        self.mount_point = mount_point
        self.mounted = False

    @classmethod
    def create(cls, directory: Path, mount_point: Path, size_mb: int, owner_uid: int | None) -> SandboxDisk:
        """Make a `size_mb` filesystem in `directory` (the sandbox's temp dir) and mount it at `mount_point` (an
        existing empty directory), its root owned by `owner_uid` (None: by us). On failure nothing stays mounted."""
        disk = cls(directory / _IMAGE, mount_point)
        owner = owner_uid if owner_uid is not None else os.geteuid()
        fd = os.open(disk.image, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            os.ftruncate(fd, size_mb * 2**20)
            for offset, data in _formatted(size_mb, owner):
                os.pwrite(fd, data, offset)
            loop = _attach_loop(fd)
        finally:
            os.close(fd)
        try:  # the loop device detaches itself once neither its fd nor a mount holds it (autoclear)
            _mount(f"/dev/loop{loop[1]}", mount_point)
        finally:
            os.close(loop[0])
        disk.mounted = True
        try:
            os.rmdir(mount_point / "lost+found")  # e2fsck's, useless here; an empty root is what a sandbox expects
        except BaseException:
            disk.unmount()
            raise
        return disk

    def unmount(self) -> None:
        """Detach the filesystem (lazily: a process still holding a file in it keeps it alive, not the mount point);
        its loop device is released with it. Idempotent."""
        if self.mounted:
            _umount(self.mount_point)
            self.mounted = False


@functools.cache
def _formatted(size_mb: int, owner: int) -> tuple[tuple[int, bytes], ...]:
    """The data extents (offset, bytes) of a freshly made `size_mb` filesystem whose root `owner` owns: `mkfs.ext4`
    runs once per size and owner (~2 MB of metadata for 4 GiB), each sandbox writes those extents into its own sparse
    image instead of running it again. (All such filesystems share a UUID, which ext4 does not mind.)"""
    with tempfile.TemporaryDirectory(prefix="prorl-mkfs-") as tmp:
        image = os.path.join(tmp, _IMAGE)
        with open(image, "wb") as f:
            f.truncate(size_mb * 2**20)
        _run(["mkfs.ext4", *_MKFS_OPTIONS, "-E", f"nodiscard,lazy_itable_init=1,root_owner={owner}:{owner}", image])
        extents = []
        fd = os.open(image, os.O_RDONLY)
        try:
            offset = 0
            while True:
                try:
                    offset = os.lseek(fd, offset, os.SEEK_DATA)
                except OSError:  # ENXIO: no data past offset
                    break
                end = os.lseek(fd, offset, os.SEEK_HOLE)
                extents.append((offset, os.pread(fd, end - offset, offset)))
                offset = end
        finally:
            os.close(fd)
    return tuple(extents)


def _attach_loop(fd: int) -> tuple[int, int]:
    """A free loop device backed by `fd`, with autoclear: (its open fd, its number)."""
    config = struct.pack("=II", fd, 0) + struct.pack(_LOOP_INFO64, *([0] * 8), _LO_FLAGS_AUTOCLEAR, b"", b"", b"", 0, 0)
    config += bytes(64)
    for _ in range(100):  # another process may take the free device between the two calls
        control = os.open("/dev/loop-control", os.O_RDWR | os.O_CLOEXEC)
        try:
            number = fcntl.ioctl(control, _LOOP_CTL_GET_FREE)
        finally:
            os.close(control)
        loop = os.open(f"/dev/loop{number}", os.O_RDWR | os.O_CLOEXEC)
        try:
            fcntl.ioctl(loop, _LOOP_CONFIGURE, config)
        except OSError as e:
            os.close(loop)
            if e.errno == errno.EBUSY:
                continue
            raise SandboxError(f"cannot set up loop device /dev/loop{number}: {e}") from e
        return loop, number
    raise SandboxError("cannot find a free loop device (every one taken when tried)")


def _mount(device: str, target: Path) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    flags = _MS_NOSUID | _MS_NODEV
    if libc.mount(device.encode(), os.fsencode(target), b"ext4", flags, _MOUNT_OPTIONS) != 0:
        error = ctypes.get_errno()
        raise SandboxError(f"cannot mount {device} (ext4) at {target}: {os.strerror(error)}")


def bind(source: Path, target: Path) -> None:
    """Mount what is mounted at `source` at `target` as well (both stay until each is unmounted)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.mount(os.fsencode(source), os.fsencode(target), None, _MS_BIND, None) != 0:
        error = ctypes.get_errno()
        raise OSError(error, f"mount --bind {source} {target}: {os.strerror(error)}")


def unmount_under(path: str | os.PathLike[str]) -> list[str]:
    """Detach every mount at or below `path` in this mount namespace, deepest first; returns their mount points."""
    prefix = os.path.realpath(path)
    found = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            point = _unescape(line.split()[4])
            if point == prefix or point.startswith(prefix + "/"):
                found.append(point)
    for point in sorted(found, key=len, reverse=True):
        _umount(Path(point))
    return found


def _umount(point: Path) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.umount2(os.fsencode(point), _MNT_DETACH) != 0:
        error = ctypes.get_errno()
        if error != 22:  # EINVAL: not a mount point (any more)
            raise OSError(error, f"umount2({point}): {os.strerror(error)}")


def _unescape(field: str) -> str:
    """A mountinfo path field with its octal escapes (\\040 for a space, ...) decoded."""
    return field.encode().decode("unicode_escape") if "\\" in field else field


def _run(argv: list[str]) -> None:
    proc = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SandboxError(f"{' '.join(argv)} failed (exit {proc.returncode}): {proc.stderr.strip()}")
