"""A sandbox's writable space with a total size the kernel enforces: an ext4 filesystem in a sparse image file.

A `SandboxDisk` is a fresh ext4 filesystem of `disk_mb` in a nameless sparse file on a loop device: past its size,
writes inside fail with ENOSPC and nothing more. It is made detached (`fsmount`) and attached (`attach()`) only
while something on the host needs its path, since every bwrap start copies the host's mount table; `DiskSpares`
makes disks ahead of need. It needs root (`available()`); without it, sandboxes get only the per-file limit.
`unmount_under()` clears the mounts a dead sandbox left.

Design notes (why not tmpfs or quotas; measurements): docs/sandboxes.md#sandboxdiskpy
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import ctypes
import errno
import fcntl
import functools
import logging
import os
import shutil
import struct
import subprocess
import tempfile
import threading
from pathlib import Path

from nemo_gym_prorl.contracts.sandbox import SandboxError
from nemo_gym_prorl.sandbox.syscalls import syscall

_MNT_DETACH = 2
_MKFS_OPTIONS = ["-q", "-F", "-O", "^has_journal", "-m", "0"]
_MOUNT_FLAGS = (b"noinit_itable", b"discard", b"nobarrier")
_LOOP_CTL_GET_FREE, _LOOP_CONFIGURE, _LO_FLAGS_AUTOCLEAR = 0x4C82, 0x4C0A, 4
_LOOP_INFO64 = "=5Q4I64s64s32s2Q"  # struct loop_info64
_EXT4_IOC_SHUTDOWN, _EXT4_GOING_FLAGS_NOLOGFLUSH = 0x8004587D, 2
# The mount API of Linux >= 5.2 (x86_64 and aarch64 share these syscall numbers).
_SYS_OPEN_TREE, _SYS_MOVE_MOUNT, _SYS_FSOPEN, _SYS_FSCONFIG, _SYS_FSMOUNT = 428, 429, 430, 431, 432
_FSOPEN_CLOEXEC, _FSMOUNT_CLOEXEC, _MOVE_MOUNT_F_EMPTY_PATH, _AT_FDCWD = 1, 1, 4, -100
_OPEN_TREE_CLONE, _OPEN_TREE_CLOEXEC, _AT_EMPTY_PATH = 1, os.O_CLOEXEC, 0x1000
_FSCONFIG_SET_FLAG, _FSCONFIG_SET_STRING, _FSCONFIG_CMD_CREATE = 0, 1, 6
_MOUNT_ATTR_NOSUID, _MOUNT_ATTR_NODEV = 2, 4

log = logging.getLogger(__name__)


@functools.cache
def available() -> bool:
    """Whether this process can give sandboxes a disk of their own: root, with mkfs.ext4 and loop devices."""
    return os.geteuid() == 0 and shutil.which("mkfs.ext4") is not None and os.path.exists("/dev/loop-control")


class SandboxDisk:
    """One sandbox's filesystem; see the module docstring. `make()` it detached, then `attach()` it."""

    def __init__(self) -> None:
        self.mount_point: Path | None = None
        """Where the disk is attached in this mount namespace; None while detached."""
        self._image_fd: int | None = None
        self._mount_fd: int | None = None  # the detached mount: what `attach()` mounts copies of
        self._root_fd: int | None = None
        self._lock = threading.Lock()  # attach and detach may run in threads of their own

    @property
    def root(self) -> Path:
        """The disk's root directory as a path that this process and its children can use, attached or not
        (through /proc, by this process's fd of it). Not for `realpath`: it names the fd, not a host path."""
        assert self._root_fd is not None, "a disk made by make() and not unmounted"
        return Path(f"/proc/{os.getpid()}/fd/{self._root_fd}")

    @classmethod
    def make(cls, directory: Path, size_mb: int, owner_uid: int | None) -> SandboxDisk:
        """A detached `size_mb` filesystem whose root `owner_uid` owns (None: we do), its image on `directory`'s
        filesystem. On failure nothing is left."""
        disk = cls()
        owner = owner_uid if owner_uid is not None else os.geteuid()
        try:
            disk._image_fd = fd = _nameless_file(directory)
            os.ftruncate(fd, size_mb * 2**20)
            for offset, data in _formatted(size_mb, owner):
                os.pwrite(fd, data, offset)
            loop, number = _attach_loop(fd)
            try:
                disk._mount_fd = _mount_detached(f"/dev/loop{number}")
            finally:
                os.close(loop)  # the filesystem holds the loop device now; it detaches itself with it (autoclear)
            os.rmdir("lost+found", dir_fd=disk._mount_fd)  # e2fsck's, useless here; a sandbox expects an empty root
            disk._root_fd = os.open(".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=disk._mount_fd)
        except BaseException:
            disk._close_fds([disk._root_fd, disk._mount_fd, disk._image_fd])
            raise
        return disk

    @classmethod
    def create(cls, directory: Path, mount_point: Path, size_mb: int, owner_uid: int | None) -> SandboxDisk:
        """`make()` a disk and `attach()` it at `mount_point`."""
        disk = cls.make(directory, size_mb, owner_uid)
        try:
            disk.attach(mount_point)
        except BaseException:
            disk.unmount()
            raise
        return disk

    def attach(self, mount_point: Path) -> None:
        """Mount the disk at `mount_point` (an existing empty directory) until `detach()`; a no-op while attached."""
        with self._lock:
            if self.mount_point is None:
                self.mount_copy(mount_point)
                self.mount_point = mount_point

    def detach(self) -> None:
        """Take the disk away from its mount point (lazily: mounts of it elsewhere, a sandbox's binds, and open files
        keep it alive); `root` still reaches it. A no-op while detached."""
        with self._lock:
            if self.mount_point is not None:
                _umount(self.mount_point)
                self.mount_point = None

    def mount_copy(self, target: Path, subdir: str = "") -> None:
        """Mount the disk's directory `subdir` (its root by default) at `target` as well: a mount of its own, which
        the caller unmounts (`unmount_under`)."""
        assert self._mount_fd is not None, "a disk made by make() and not unmounted"
        flags = _OPEN_TREE_CLONE | _OPEN_TREE_CLOEXEC | (0 if subdir else _AT_EMPTY_PATH)
        try:
            copy = syscall(_SYS_OPEN_TREE, self._mount_fd, os.fsencode(subdir), flags)
        except OSError as e:
            raise SandboxError(f"cannot copy the sandbox disk's mount: {e.strerror}") from e
        try:
            syscall(_SYS_MOVE_MOUNT, copy, b"", _AT_FDCWD, os.fsencode(target), _MOVE_MOUNT_F_EMPTY_PATH)
        except OSError as e:
            raise SandboxError(f"cannot mount the sandbox disk at {target}: {e.strerror}") from e
        finally:
            os.close(copy)

    def unmount(self, *, discard: bool = True) -> None:
        """Detach the filesystem (lazily: a process still holding a file in it keeps it alive, not the mount point)
        and drop it; its loop device is released with it. `discard`: its content is thrown away, not written back
        first (see `shut_down`). Copies of it mounted elsewhere (`mount_copy`) stay until unmounted. Idempotent;
        its references are dropped even when the detach fails (the mount point then keeps the filesystem)."""
        try:
            self.detach()
        finally:
            fds = [self._root_fd, self._mount_fd, self._image_fd]
            shut_down_fd = self._root_fd if discard else None
            self._root_fd = self._mount_fd = self._image_fd = None
            if any(fd is not None for fd in fds):
                # The last references: closing them tears the filesystem and its loop device down (~10-20 ms) and
                # frees the image's blocks on the host (~50 ms), so a thread of its own does it and closing does not
                # wait.
                release = threading.Thread(target=self._release, args=(shut_down_fd, fds), name="prorl-disk-release")
                release.daemon = True
                release.start()

    @staticmethod
    def _release(shut_down_fd: int | None, fds: list[int | None]) -> None:
        _lowest_priority()
        try:
            if shut_down_fd is not None:
                fcntl.ioctl(shut_down_fd, _EXT4_IOC_SHUTDOWN, struct.pack("I", _EXT4_GOING_FLAGS_NOLOGFLUSH))
        finally:
            SandboxDisk._close_fds(fds)

    @staticmethod
    def _close_fds(fds: list[int | None]) -> None:
        for fd in fds:
            if fd is not None:
                os.close(fd)


class DiskSpares:
    """Disks made ahead of need, so that a sandbox's start only attaches one (see the module docstring).

    A thread of its own, at the lowest CPU priority (it yields to the sandboxes it serves), keeps `per_kind`
    detached disks ready for each of the last `kinds` (size, owner) pairs asked for, their images on the filesystem
    of the process's temp dir as it was when this was made. `take()` attaches one where the sandbox wants it, or
    says that none is ready (the first of a kind, a burst of starts): the caller makes one then. A disk serves one
    sandbox: a used one is unmounted, never wiped and handed out again. Spares are detached, so nothing of them
    outlives the process; `close()` (also run at exit) drops them sooner, and `take()` afterwards starts over. A
    forked child makes its own (the ones it inherits are its parent's)."""

    def __init__(self, *, per_kind: int = 2, kinds: int = 3) -> None:
        self._per_kind, self._kinds = per_kind, kinds
        self._directory = Path(tempfile.gettempdir())
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._reset()
        atexit.register(self.close)

    def _reset(self) -> None:
        self._pid = os.getpid()
        self._spares: collections.OrderedDict[tuple[int, int], list[SandboxDisk]] = collections.OrderedDict()
        self._unwanted: list[SandboxDisk] = []
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._broken = False

    def take(self, size_mb: int, owner_uid: int | None, mount_point: Path) -> SandboxDisk | None:
        """A spare `size_mb` disk whose root `owner_uid` owns (None: we do), now mounted at `mount_point` (an
        existing empty directory); None when none is ready (more are made from now on)."""
        kind = (size_mb, owner_uid if owner_uid is not None else os.geteuid())
        with self._lock:
            if self._pid != os.getpid():
                self._reset()
            spares = self._spares.pop(kind, [])
            self._spares[kind] = spares  # the most recently asked for
            while len(self._spares) > self._kinds:
                self._unwanted += self._spares.popitem(last=False)[1]
            spare = spares.pop() if spares else None
            if not self._broken and not self._stopping and self._thread is None:
                self._thread = threading.Thread(target=self._keep_ready, name="prorl-disk-spares", daemon=True)
                self._thread.start()
            self._wake.notify()
        if spare is None:
            return None
        try:
            spare.attach(mount_point)
        except BaseException:
            spare.unmount()
            raise
        return spare

    def close(self) -> None:
        """Stop making spares and drop them (a disk a sandbox took stays)."""
        with self._lock:
            if self._pid != os.getpid():
                return
            self._stopping = True
            self._wake.notify()
            thread = self._thread
        if thread is not None:
            thread.join()
        with self._lock:
            left = self._unwanted + [disk for spares in self._spares.values() for disk in spares]
            self._reset()
        for disk in left:
            disk.unmount()

    def _keep_ready(self) -> None:
        _lowest_priority()
        while True:
            with self._lock:
                while not (self._stopping or self._unwanted or self._short_kind()):
                    self._wake.wait()
                if self._stopping:
                    return
                unwanted, self._unwanted = self._unwanted, []
                kind = self._short_kind()
            for disk in unwanted:
                disk.unmount()
            if kind is None:
                continue
            try:
                spare = SandboxDisk.make(self._directory, *kind)
            except Exception:
                log.warning("cannot make spare sandbox disks; each sandbox makes its own", exc_info=True)
                with self._lock:
                    self._broken, self._thread = True, None
                return
            with self._lock:
                if kind in self._spares and not self._stopping:
                    self._spares[kind].append(spare)
                    spare = None
            if spare is not None:
                spare.unmount()

    def _short_kind(self) -> tuple[int, int] | None:
        """The most recently asked-for kind with fewer spares than wanted (with the lock held)."""
        for kind in reversed(self._spares):
            if len(self._spares[kind]) < self._per_kind:
                return kind
        return None


def _lowest_priority() -> None:
    """Run the calling thread (alone) at nice 19."""
    with contextlib.suppress(OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)


def shut_down(path: Path) -> None:
    """Shut the ext4 filesystem at `path` down without flushing anything (EXT4_IOC_SHUTDOWN, NOLOGFLUSH): every later
    access fails, and unmounting it no longer writes dirty pages back into the image that is about to be removed
    (measured here: an unmount in ~8 ms instead of 25-50 ms)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        fcntl.ioctl(fd, _EXT4_IOC_SHUTDOWN, struct.pack("I", _EXT4_GOING_FLAGS_NOLOGFLUSH))
    finally:
        os.close(fd)


def _nameless_file(directory: Path) -> int:
    """An open, nameless regular file on `directory`'s filesystem (O_TMPFILE; else made and unlinked at once)."""
    try:
        return os.open(directory, os.O_TMPFILE | os.O_RDWR | os.O_CLOEXEC, 0o600)
    except OSError as e:
        if e.errno not in (errno.EOPNOTSUPP, errno.EISDIR):
            raise
    fd, name = tempfile.mkstemp(dir=directory)
    os.unlink(name)
    return fd


@functools.cache
def _formatted(size_mb: int, owner: int) -> tuple[tuple[int, bytes], ...]:
    """The data extents (offset, bytes) of a freshly made `size_mb` filesystem whose root `owner` owns: `mkfs.ext4`
    runs once per size and owner (~2 MB of metadata for 4 GiB), each disk writes those extents into its own sparse
    image instead of running it again. (All such filesystems share a UUID, which ext4 does not mind.)"""
    with tempfile.TemporaryDirectory(prefix="prorl-mkfs-") as tmp:
        image = os.path.join(tmp, "disk.img")
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


def _mount_detached(device: str) -> int:
    """The ext4 filesystem on `device` as a detached mount (nosuid, nodev): its fd."""
    fs = syscall(_SYS_FSOPEN, b"ext4", _FSOPEN_CLOEXEC)
    try:
        syscall(_SYS_FSCONFIG, fs, _FSCONFIG_SET_STRING, b"source", device.encode(), 0)
        for flag in _MOUNT_FLAGS:
            syscall(_SYS_FSCONFIG, fs, _FSCONFIG_SET_FLAG, flag, None, 0)
        syscall(_SYS_FSCONFIG, fs, _FSCONFIG_CMD_CREATE, None, None, 0)
        return syscall(_SYS_FSMOUNT, fs, _FSMOUNT_CLOEXEC, _MOUNT_ATTR_NOSUID | _MOUNT_ATTR_NODEV)
    except OSError as e:
        raise SandboxError(f"cannot mount {device} (ext4): {e.strerror}") from e
    finally:
        os.close(fs)


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
