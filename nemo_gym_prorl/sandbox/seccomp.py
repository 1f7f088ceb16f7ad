"""The system-call filter every sandboxed process runs under, compiled once with libseccomp (via `pyseccomp`).

Default: allow. Denied with EPERM: what a process needs to leave its namespaces or reach the kernel beyond its
own sandbox — debugging other processes (ptrace, process_vm_*, pidfd_getfd, kcmp), mounting (mount, umount2,
pivot_root, chroot, the new mount API), new or other namespaces (unshare, setns, clone with a CLONE_NEW* flag),
the kernel keyring, bpf, perf_event_open, kernel modules and kexec, io_uring (its operations are not filtered),
userfaultfd, open_by_handle_at, clock/swap/reboot/quota/syslog/acct, and the terminal ioctls TIOCSTI/TIOCLINUX
(typing into a terminal). `clone3` answers ENOSYS: its flags are behind a pointer a filter cannot read, and libc
falls back to `clone`, whose flags are checked. 32-bit and x32 calls are filtered the same way on x86-64.

`bpf_program()` is what bubblewrap's `--seccomp FD` reads (classic BPF, `struct sock_filter[]`); `load_bpf()`
installs those same bytes into the calling process (used when a program joins a running sandbox).
"""

from __future__ import annotations

import ctypes
import errno
import functools
import os

DENIED = (
    # other processes' memory
    "ptrace", "process_vm_readv", "process_vm_writev", "pidfd_getfd", "kcmp",
    # mounts and roots
    "mount", "umount", "umount2", "pivot_root", "chroot", "open_tree", "move_mount", "fsopen", "fsconfig",
    "fsmount", "fspick", "mount_setattr",
    # namespaces
    "unshare", "setns",
    # kernel keyring
    "keyctl", "add_key", "request_key",
    # kernel programs, tracing, modules, kexec
    "bpf", "perf_event_open", "init_module", "finit_module", "delete_module", "kexec_load", "kexec_file_load",
    # unfiltered or abusable kernel interfaces
    "io_uring_setup", "io_uring_enter", "io_uring_register", "userfaultfd", "open_by_handle_at",
    "name_to_handle_at", "lookup_dcookie", "uselib", "nfsservctl", "iopl", "ioperm", "vhangup",
    # host-wide state
    "syslog", "acct", "swapon", "swapoff", "reboot", "quotactl", "quotactl_fd", "settimeofday", "clock_settime",
    "clock_adjtime", "sethostname", "setdomainname",
)  # fmt: skip

CLONE_NEW_FLAGS = (
    0x00020000,  # CLONE_NEWNS
    0x02000000,  # CLONE_NEWCGROUP
    0x04000000,  # CLONE_NEWUTS
    0x08000000,  # CLONE_NEWIPC
    0x10000000,  # CLONE_NEWUSER
    0x20000000,  # CLONE_NEWPID
    0x40000000,  # CLONE_NEWNET
)
TERMINAL_IOCTLS = (0x5412, 0x541C)  # TIOCSTI, TIOCLINUX
_CLONE_NEW_FLAGS, _TERMINAL_IOCTLS = CLONE_NEW_FLAGS, TERMINAL_IOCTLS  # earlier names (apptainer.py uses them)

_PR_SET_NO_NEW_PRIVS = 38
_PR_SET_SECCOMP = 22
_SECCOMP_MODE_FILTER = 2
_SOCK_FILTER_SIZE = 8  # struct sock_filter { u16 code; u8 jt; u8 jf; u32 k; }


@functools.cache
def bpf_program() -> bytes:
    """The compiled filter, as `struct sock_filter[]` bytes."""
    import pyseccomp as sc  # imported here: the helper that joins a sandbox loads bytes and needs only ctypes

    filt = sc.SyscallFilter(defaction=sc.ALLOW)
    if sc.system_arch() == sc.Arch.X86_64:
        for arch in (sc.Arch.X86, sc.Arch.X32):
            filt.add_arch(arch)
    deny = sc.ERRNO(errno.EPERM)
    for name in DENIED:
        try:
            number = sc.resolve_syscall(sc.Arch.NATIVE, name)
        except OSError:  # pragma: no cover - not a system call on this architecture
            continue
        if number < 0:  # pragma: no cover - libseccomp knows the name but this architecture lacks the call
            continue
        filt.add_rule(deny, name)
    for flag in CLONE_NEW_FLAGS:
        filt.add_rule(deny, "clone", sc.Arg(0, sc.MASKED_EQ, flag, flag))
    filt.add_rule(sc.ERRNO(errno.ENOSYS), "clone3")
    for request in TERMINAL_IOCTLS:
        filt.add_rule(deny, "ioctl", sc.Arg(1, sc.MASKED_EQ, 0xFFFFFFFF, request))
    read_end, write_end = os.pipe()
    try:
        with open(write_end, "wb", closefd=True) as sink:
            filt.export_bpf(sink)
        chunks = []
        while chunk := os.read(read_end, 65536):
            chunks.append(chunk)
    finally:
        os.close(read_end)
    program = b"".join(chunks)
    if not program or len(program) % _SOCK_FILTER_SIZE:
        raise RuntimeError(f"libseccomp exported a malformed filter ({len(program)} bytes)")
    return program


def load_bpf(program: bytes) -> None:
    """Install `program` (as from `bpf_program()`) into this process: no_new_privs, then the filter. Irreversible,
    inherited by children and kept across execve."""

    class _SockFprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    libc = ctypes.CDLL(None, use_errno=True)
    buffer = ctypes.create_string_buffer(program, len(program))
    fprog = _SockFprog(len(program) // _SOCK_FILTER_SIZE, ctypes.cast(buffer, ctypes.c_void_p))
    if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")
    if libc.prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_SECCOMP)")
