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
uses it); `unmount()` detaches it (the mount point is free at once), then a thread shuts the filesystem down (nothing
written back: the image goes next) and drops the last references, and the loop device goes with it. A process that
dies without closing its sandboxes leaves the mount: `unmount_under()` removes every mount below a dead sandbox's
temp dir before the orphan sweep removes the dir.

Making a disk costs ~15 ms (the image's metadata written, a loop device attached, the filesystem mounted), mostly
waiting on the kernel, not CPU. `DiskSpares` makes them ahead of need in a thread of its own, so a sandbox's start
only moves a ready mount into place (~0.1 ms).
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
from collections.abc import Callable
from pathlib import Path

from nemo_gym_prorl.sandbox.base import SandboxError

_IMAGE = "disk.img"
_MNT_DETACH = 2
_MS_NOSUID, _MS_NODEV, _MS_BIND, _MS_MOVE = 2, 4, 4096, 8192
_MKFS_OPTIONS = ["-q", "-F", "-O", "^has_journal", "-m", "0"]
_MOUNT_OPTIONS = b"noinit_itable,discard,nobarrier"
_LOOP_CTL_GET_FREE, _LOOP_CONFIGURE, _LO_FLAGS_AUTOCLEAR = 0x4C82, 0x4C0A, 4
_LOOP_INFO64 = "=5Q4I64s64s32s2Q"  # struct loop_info64
_EXT4_IOC_SHUTDOWN, _EXT4_GOING_FLAGS_NOLOGFLUSH = 0x8004587D, 2

log = logging.getLogger(__name__)


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
        self._image_fd: int | None = None
        self._root_fd: int | None = None

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
        except BaseException:
            os.close(fd)
            raise
        finally:
            # Nameless from now on: the image lives while the loop device or `fd` holds it, and a process that dies
            # without unmounting leaves no image behind once the orphan sweep has unmounted it.
            disk.image.unlink()
        disk._image_fd = fd
        try:  # the loop device detaches itself once neither its fd nor a mount holds it (autoclear)
            _mount(f"/dev/loop{loop[1]}", mount_point)
        except BaseException:
            disk._release_image()
            raise
        finally:
            os.close(loop[0])
        disk.mounted = True
        try:
            disk._root_fd = os.open(mount_point, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
            os.rmdir(mount_point / "lost+found")  # e2fsck's, useless here; an empty root is what a sandbox expects
        except BaseException:
            disk.unmount()
            raise
        return disk

    def move_to(self, mount_point: Path) -> None:
        """Mount the filesystem at `mount_point` (an existing empty directory) instead of where it is."""
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.mount(os.fsencode(self.mount_point), os.fsencode(mount_point), None, _MS_MOVE, None) != 0:
            error = ctypes.get_errno()
            if error != errno.EINVAL:  # EINVAL: the mount's parent is shared (a bind and a detach do instead)
                raise OSError(error, f"mount --move {self.mount_point} {mount_point}: {os.strerror(error)}")
            bind(self.mount_point, mount_point)
            _umount(self.mount_point)
        self.mount_point = mount_point

    def unmount(self, *, discard: bool = True) -> None:
        """Detach the filesystem (lazily: a process still holding a file in it keeps it alive, not the mount point);
        its loop device is released with it. `discard`: its content is thrown away, not written back first (see
        `shut_down`). Idempotent."""
        if self.mounted:
            _umount(self.mount_point)
            self.mounted = False
        self._release_image(discard)

    def _release_image(self, discard: bool = True) -> None:
        """Let go of the detached filesystem and its (nameless) image. The last references are the fds held here:
        closing them tears the filesystem and its loop device down (~10-20 ms) and frees the image's blocks on the
        host's filesystem (~50 ms), so a thread of its own does it (`discard`: after shutting the filesystem down),
        and closing a sandbox does not wait. The mount point is free at once."""
        root_fd, image_fd = self._root_fd, self._image_fd
        self._root_fd = self._image_fd = None
        if root_fd is not None or image_fd is not None:
            args = (root_fd if discard else None, [fd for fd in (root_fd, image_fd) if fd is not None])
            threading.Thread(target=_release, args=args, name="prorl-disk-release", daemon=True).start()


def _release(shut_down_fd: int | None, fds: list[int]) -> None:
    _lowest_priority()
    try:
        if shut_down_fd is not None:
            fcntl.ioctl(shut_down_fd, _EXT4_IOC_SHUTDOWN, struct.pack("I", _EXT4_GOING_FLAGS_NOLOGFLUSH))
    finally:
        for fd in fds:
            os.close(fd)


class DiskSpares:
    """Disks made ahead of need, so that a sandbox's start does not wait for one (see the module docstring).

    A thread of its own keeps `per_kind` spares ready for each of the last `kinds` (size, owner) pairs asked for,
    each in a directory of its own under one temp dir (`prefix`*, made in the process's temp dir as it was when this
    was made, and marked by `mark_owner`: the orphan sweep that knows the prefix removes what a killed process left).
    `take()` moves a spare's mount to where the sandbox wants it (~0.3 ms, so no thread is needed for it), or says
    that none is ready (the first of a kind, a burst of starts): the caller makes one then. The threads that make
    and release disks run at the lowest CPU priority, so that they yield to the sandboxes they serve. A disk serves
    one sandbox: a used one is unmounted, never wiped and handed
    out again (nothing of one sandbox reaches the next, and its blocks are freed on the host). `close()`, also run at
    exit, unmounts the spares and removes the temp dir; `take()` afterwards starts over. A forked child starts its
    own (the spares it inherits are its parent's)."""

    def __init__(self, prefix: str, mark_owner: Callable[[Path], None], *, per_kind: int = 2, kinds: int = 3) -> None:
        self._prefix, self._mark_owner = prefix, mark_owner
        self._per_kind, self._kinds = per_kind, kinds
        self._parent = tempfile.gettempdir()
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._reset()
        atexit.register(self.close)

    def _reset(self) -> None:
        self._pid = os.getpid()
        self._spares: collections.OrderedDict[tuple[int, int], list[SandboxDisk]] = collections.OrderedDict()
        self._unwanted: list[SandboxDisk] = []
        self._spent: list[Path] = []
        self._dir: Path | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._broken = False

    def take(self, size_mb: int, owner_uid: int | None, mount_point: Path) -> SandboxDisk | None:
        """A spare `size_mb` disk whose root `owner_uid` owns (None: we do), now mounted at `mount_point` (an
        existing empty directory); None when none is ready (more are made from now on)."""
        owner = owner_uid if owner_uid is not None else os.geteuid()
        kind = (size_mb, owner)
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
        if spare is not None:
            try:
                spare.move_to(mount_point)
            except OSError as e:
                log.warning("a spare sandbox disk could not be moved into place (%s); making one instead", e)
                self._discard(spare)
            else:
                with self._lock:  # its empty directory is the thread's to remove (host metadata writes can be slow)
                    self._spent.append(spare.image.parent)
                    self._wake.notify()
                return spare
        return None

    def close(self) -> None:
        """Stop making spares, unmount them and remove their temp dir (a sandbox's disk taken already stays)."""
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
            directory = self._dir
            self._reset()
        for disk in left:
            self._discard(disk)
        if directory is not None:
            unmount_under(directory)
            shutil.rmtree(directory, ignore_errors=True)

    def _keep_ready(self) -> None:
        _lowest_priority()
        while True:
            with self._lock:
                while not (self._stopping or self._unwanted or self._spent or self._short_kind()):
                    self._wake.wait()
                if self._stopping:
                    return
                unwanted, self._unwanted = self._unwanted, []
                spent, self._spent = self._spent, []
                kind = self._short_kind()
            for disk in unwanted:
                self._discard(disk)
            for entry in spent:
                _remove_spare_dir(entry)
            if kind is None:
                continue
            try:
                spare = self._make(*kind)
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
                self._discard(spare)

    def _short_kind(self) -> tuple[int, int] | None:
        """The most recently asked-for kind with fewer spares than wanted (with the lock held)."""
        for kind in reversed(self._spares):
            if len(self._spares[kind]) < self._per_kind:
                return kind
        return None

    def _make(self, size_mb: int, owner: int) -> SandboxDisk:
        if self._dir is None:
            self._dir = Path(tempfile.mkdtemp(prefix=self._prefix, dir=self._parent))
            self._mark_owner(self._dir)
        entry = Path(tempfile.mkdtemp(dir=self._dir))
        (entry / "mnt").mkdir()
        try:
            return SandboxDisk.create(entry, entry / "mnt", size_mb, owner)
        except BaseException:
            _remove_spare_dir(entry)
            raise

    @staticmethod
    def _discard(spare: SandboxDisk) -> None:
        spare.unmount()
        _remove_spare_dir(spare.image.parent)


def _lowest_priority() -> None:
    """Run the calling thread (alone) at nice 19."""
    with contextlib.suppress(OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)


def _remove_spare_dir(entry: Path) -> None:
    """Remove a spare's directory once its mount is gone from it (rmdir only: never anything inside a mount)."""
    with contextlib.suppress(OSError):
        (entry / "mnt").rmdir()
        entry.rmdir()


def shut_down(path: Path) -> None:
    """Shut the ext4 filesystem at `path` down without flushing anything (EXT4_IOC_SHUTDOWN, NOLOGFLUSH): every later
    access fails, and unmounting it no longer writes dirty pages back into the image that is about to be removed
    (measured here: an unmount in ~8 ms instead of 25-50 ms)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        fcntl.ioctl(fd, _EXT4_IOC_SHUTDOWN, struct.pack("I", _EXT4_GOING_FLAGS_NOLOGFLUSH))
    finally:
        os.close(fd)


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
