"""Linux system calls that Python's `os` module does not offer (the mount API of `disk.py`, `openat2`), made through
libc's `syscall()`. The numbers are x86_64's, which aarch64 shares for all of these."""

from __future__ import annotations

import ctypes
import functools
import os
import struct

SYS_OPENAT2 = 437
_RESOLVE_NO_MAGICLINKS, _RESOLVE_BENEATH = 0x02, 0x08


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def syscall(number: int, *args: object) -> int:
    """The system call's result; OSError with its errno when it fails."""
    result = _libc().syscall(number, *args)
    if result < 0:
        error = ctypes.get_errno()
        raise OSError(error, os.strerror(error))
    return result


def open_beneath(dir_fd: int, path: str, flags: int, mode: int = 0o644) -> int:
    """`openat2(dir_fd, path, flags)` resolving every component, symlinks and `..` included, without ever leaving
    `dir_fd`'s directory (RESOLVE_BENEATH: EXDEV instead) or following a /proc magic link. The kernel checks this
    during the lookup itself, so nothing that renames or swaps links inside the directory meanwhile can redirect it.
    The fd is close-on-exec. OSError names `path`."""
    creating = flags & os.O_CREAT or flags & os.O_TMPFILE == os.O_TMPFILE  # O_TMPFILE includes O_DIRECTORY's bit
    how = struct.pack("=QQQ", flags | os.O_CLOEXEC, mode if creating else 0, _RESOLVE_BENEATH | _RESOLVE_NO_MAGICLINKS)
    result = _libc().syscall(SYS_OPENAT2, dir_fd, os.fsencode(path), how, len(how))
    if result < 0:
        error = ctypes.get_errno()
        raise OSError(error, os.strerror(error), path)
    return result
