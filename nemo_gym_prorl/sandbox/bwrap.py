"""Sandbox backend on bubblewrap: a read-only root, a private workspace, no network, no privileges, bounded.

The host's /usr and /etc (secrets hidden) or an image's rootfs, read-only; a fresh /proc, /dev and /tmp; the
workspace read-write at `spec.workspace`. As root, bwrap runs as uid 65534 in a user namespace of its own and the
sandbox's user (uid 1000) has no capabilities, under the filter of `seccomp.py`; rlimits, cgroups and a disk of its
own bound it (`limits.py`, `disk.py`). The shell is the pid namespace's init: killing it ends everything. `exec()`
joins the running sandbox through the `limits.py` helper; `fork(n)` gives n sandboxes an overlayfs each over one
snapshot of the workspace, copied with the sandbox frozen.

Design notes: docs/sandboxes.md#sandboxbwrappy
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import logging
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path, PurePosixPath
from typing import Any

from nemo_gym_prorl.contracts.sandbox import (
    IMAGE_PATH,
    ExecResult,
    FileTooLargeError,
    NotARegularFileError,
    PathOutsideWorkspaceError,
    SandboxError,
    SandboxSpec,
    with_note,
)
from nemo_gym_prorl.sandbox import disk, passwd
from nemo_gym_prorl.sandbox.disk import SandboxDisk
from nemo_gym_prorl.sandbox.interrupts import interruptible_children
from nemo_gym_prorl.sandbox.lifecycle import SandboxLifecycle, to_thread_to_the_end
from nemo_gym_prorl.sandbox.limits import (
    CGROUP_PREFIX,
    OutputCap,
    SandboxCgroup,
    join_argv,
    rlimits,
    ulimit_command,
)
from nemo_gym_prorl.sandbox.pty_shell import DEFAULT_MAX_DRAINED_BYTES, PtyShell, ShellLauncher, _poll_until
from nemo_gym_prorl.sandbox.seccomp import bpf_program
from nemo_gym_prorl.sandbox.workspace import (
    HostWorkspace,
    lexical_relative,
    overlay_changes,
    remove_tree,
    too_large_message,
)

log = logging.getLogger(__name__)

CONTROL_DIR = "/.prorl"
TEMP_PREFIX = CGROUP_PREFIX  # host temp dirs and cgroups share the name "prorl-sbx-*"
_NOBODY = 65534
_INNER_UID = 1000
_SHELL = ["/bin/bash", "--norc", "--noprofile", "--noediting", "-i"]
_ETC_HIDDEN = (
    "shadow", "shadow-", "gshadow", "gshadow-", "ssh", "ssl/private", "sudoers", "sudoers.d", "security/opasswd",
    "machine-id", "subuid", "subgid", "apt/auth.conf", "apt/auth.conf.d", "pip.conf", "xdg/pip", "npmrc",
    "gitconfig", "wgetrc", "docker", "containerd", "kubernetes", "wireguard", "NetworkManager/system-connections",
    "credstore", "credstore.encrypted",
)  # fmt: skip
_ETC_OWN = {
    "passwd": "root:x:0:0:root:/root:/usr/sbin/nologin\nsandbox:x:1000:1000:sandbox:/workspace:/bin/bash\n"
    "nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n",
    "group": "root:x:0:\nsandbox:x:1000:\nnogroup:x:65534:\n",
    "hosts": "127.0.0.1\tlocalhost sandbox\n::1\tlocalhost ip6-localhost ip6-loopback\n",
    "hostname": "sandbox\n",
}
# $1: seccomp program; then cgroup.procs files up to "--"; then the command. Runs as the caller (root: may join), a
# session leader: reopening its pty makes that the session's controlling terminal.
_ENTER = (
    'bpf=$1; shift; while [ "$1" != -- ]; do echo $$ > "$1" || exit 125; shift; done; shift; '
    'exec 0<>/proc/self/fd/0; exec "$@" 3< "$bpf"'
)
_MOUNT_OVERLAY = 'mount -t overlay prorl-overlay -o "$1" "$2" || exit 125; shift 2; exec "$@"'
_KILL_WAIT_S = 5.0
_FILE_IO_TIMEOUT_S = 60.0


class BwrapSandbox(SandboxLifecycle):
    """One bubblewrap sandbox holding a persistent shell; see the module docstring for what it isolates."""

    def __init__(
        self, spec: SandboxSpec | None = None, *, bwrap: str = "bwrap", _snapshot: _Snapshot | None = None
    ) -> None:
        self.spec = spec or SandboxSpec()
        self._bwrap = bwrap
        self._as_root = os.geteuid() == 0
        self._snapshot = _snapshot
        self._root: Path | None = None
        self._cgroup: SandboxCgroup | None = None
        self._shell: PtyShell | None = None
        self._started = False
        self._hand_over_to: Path | None = None
        self._hand_over_snapshot: _Snapshot | None = None
        self._handed_over = False
        self._disk: SandboxDisk | None = None

    @property
    def temp_dir(self) -> Path | None:
        """The sandbox's one host temp dir (workspace, control dir, overlay layers); None before start."""
        return self._root

    @property
    def workspace(self) -> Path | None:
        """Host directory mounted at `spec.workspace`, while the sandbox runs (see `writable_dir`). None otherwise, and
        for a fork, whose workspace is an overlay that only its own mount namespace sees."""
        writable = self.writable_dir
        return writable / "workspace" if writable is not None and self._snapshot is None else None

    @property
    def writable_dir(self) -> Path | None:
        """Host path of what the sandbox writes: its workspace (`workspace`), or a fork's overlay layers (`upper`,
        `work`), and with a disk of its own its /tmp (`tmp`). A disk's is a path through this process's fd of it
        (`SandboxDisk.root`), valid while the sandbox runs: None before start and once it closes (that fd is closed
        then, and its number may name another sandbox's disk later)."""
        if self._root is None or self._close_task is not None:
            return None
        return self._disk.root if self._disk is not None else self._root / "disk"

    @property
    def pid(self) -> int | None:
        """Host pid of the outer bwrap process, None while no shell runs."""
        return self._shell.pid if self._shell is not None else None

    @property
    def cgroup(self) -> SandboxCgroup | None:
        """The sandbox's cgroups, None where cgroup v1 is not writable (only rlimits bound it then)."""
        return self._cgroup

    async def start(self) -> None:
        if self._started:
            raise SandboxError("sandbox already started")
        self._started = True
        if self._snapshot is not None:
            self._snapshot.acquire()
        limits = self.spec.limits
        try:
            _sweep_once()
            self._root = Path(tempfile.mkdtemp(prefix=TEMP_PREFIX))
            _write_owner(self._root, [])
            self._prepare_host_dirs()
            if limits.disk_mb is not None and disk.available():
                await self._make_disk(limits.disk_mb)
            else:
                self._make_writable_dirs()
            self._cgroup = SandboxCgroup.create(self._root.name, limits)
            if self._cgroup is not None:
                _write_owner(self._root, list(self._cgroup.dirs.values()))
            self._shell = PtyShell(
                _BwrapLauncher(self._argv(), ulimit_command(rlimits(limits)), self._disk, self._root / "disk"),
                self._root / "control",
                CONTROL_DIR,
                max_output_bytes=limits.max_output_bytes,
            )
            await self._shell.start()
        except BaseException:
            await self.close()
            raise
        self._arm_wall_clock()

    async def run(self, command: str, timeout: float) -> ExecResult:
        shell = self._running_shell()
        result = await shell.run(command, timeout)
        if self._expired:
            result.output += f"[{self._closed_reason()}]\n"
        return result

    async def exec(self, argv: list[str], timeout: float) -> ExecResult:
        """Run `argv` in this sandbox beside the shell (see the module docstring); the shell's state is untouched.
        A timeout kills the program's process group."""
        if not argv:
            raise ValueError("exec needs a program to run")
        result, _ = await self._join("exec", {"argv": list(argv)}, timeout=timeout)
        return result

    async def write_file(self, path: str, data: bytes) -> None:
        host = self._host_workspace()
        if host is not None:
            await asyncio.to_thread(host.write, path, data)
        else:
            await self._join_file_io("write", lexical_relative(path, self.spec.workspace), data)

    async def read_file(self, path: str) -> bytes:
        host = self._host_workspace()
        if host is not None:
            return await asyncio.to_thread(host.read, path)
        return await self._join_file_io("read", lexical_relative(path, self.spec.workspace), b"")

    async def fork(self, n: int, *, close: bool = False) -> list[BwrapSandbox]:
        """n started sandboxes, each with a copy-on-write copy of this one's workspace as it is now (and this
        one's spec). Closing this sandbox does not affect them. Start them all or none.

        `close=True`: close this sandbox first (whatever happens next) and hand its workspace to the forks as it
        is, moved instead of copied (a fork's own workspace, an overlay, is still copied)."""
        if n < 1:
            raise ValueError("fork needs n >= 1")
        self._running_shell()
        snapshot_root = Path(tempfile.mkdtemp(prefix=TEMP_PREFIX + "snap-"))
        try:
            snapshot = _Snapshot(snapshot_root)
        except BaseException:
            shutil.rmtree(snapshot_root)
            raise
        snapshot.acquire()  # held by this call until the forks hold it
        try:
            if close and self._snapshot is None:
                self._hand_over_to, self._hand_over_snapshot = snapshot.path, snapshot
            else:
                await self._copy_workspace_to(snapshot.path)
            if close:
                await self.close()
                if self._hand_over_to is not None and not self._handed_over:
                    raise SandboxError("the sandbox closed without handing its workspace over")
            forks = [BwrapSandbox(self.spec, bwrap=self._bwrap, _snapshot=snapshot) for _ in range(n)]
            try:
                results = await asyncio.gather(*(f.start() for f in forks), return_exceptions=True)
                failures = [r for r in results if isinstance(r, BaseException)]
                if failures:
                    raise failures[0]
            except BaseException:
                await asyncio.gather(*(f.close() for f in forks), return_exceptions=True)
                raise
            return forks
        finally:
            if snapshot.release():
                await asyncio.to_thread(snapshot.remove)

    # -- start -------------------------------------------------------------------------------------------------

    def _prepare_host_dirs(self) -> None:
        """Lay out the temp dir: workspace (or overlay layers), control dir, seccomp program, files for /etc."""
        assert self._root is not None
        root = self._root
        root.chmod(0o711)  # bwrap runs as uid 65534 and must reach what it binds
        for name in ("disk", "merged") if self._snapshot is not None else ("disk",):
            (root / name).mkdir(mode=0o755)
            if self._as_root:
                os.chown(root / name, _NOBODY, _NOBODY)
        (root / "control").mkdir(mode=0o755)
        (root / "seccomp.bpf").write_bytes(bpf_program())
        if self.spec.image is None:
            (root / "empty").write_bytes(b"")
            (root / "empty").chmod(0o444)
            (root / "emptydir").mkdir(mode=0o555)
        etc = dict(_ETC_OWN) if self.spec.image is None else {}
        if (users := self._passwd()) is not None:
            etc["passwd"] = users
        for name, text in etc.items():
            (root / f"etc-{name}").write_text(text)
            (root / f"etc-{name}").chmod(0o444)

    def _passwd(self) -> str | None:
        """/etc/passwd for the sandbox, ours or its image's, with the sandbox user's home at the workspace, where HOME
        points (`passwd.py`); None for an image without one."""
        text: str | None = _ETC_OWN["passwd"]
        if self.spec.image is not None:
            try:
                image_fd = os.open(self.spec.image, os.O_PATH | os.O_DIRECTORY)
            except OSError:
                return None  # not a directory: _root_fs_args says so
            try:
                text = passwd.read_beneath(image_fd)
            finally:
                os.close(image_fd)
        return None if text is None else passwd.with_home(text, _INNER_UID, self.spec.workspace)

    def _make_writable_dirs(self) -> None:
        """What the sandbox writes to, in `disk`: the workspace or a fork's overlay layers, and with a disk of its
        own also /tmp (on that disk: filling it is "disk full", not memory)."""
        assert self._root is not None
        names = ["workspace"] if self._snapshot is None else ["upper", "work"]
        for name in names + (["tmp"] if self._disk is not None else []):
            (self._root / "disk" / name).mkdir(mode=0o1777 if name == "tmp" else 0o755)
            if self._as_root:
                os.chown(self._root / "disk" / name, _NOBODY, _NOBODY)
        if self._disk is not None:
            (self._root / "disk/tmp").chmod(0o1777)

    async def _make_disk(self, size_mb: int) -> None:
        """Give the sandbox's writable space a filesystem of its own (`disk.py`), mounted at `disk`: a spare made
        ahead, or else one made now (in a thread)."""
        assert self._root is not None
        owner = _NOBODY if self._as_root else None
        self._disk = _DISK_SPARES.take(size_mb, owner, self._root / "disk")
        if self._disk is None:
            await to_thread_to_the_end(self._make_new_disk, size_mb, owner)
        self._make_writable_dirs()

    def _make_new_disk(self, size_mb: int, owner: int | None) -> None:
        assert self._root is not None
        self._disk = SandboxDisk.create(self._root, self._root / "disk", size_mb, owner)

    def _argv(self) -> list[str]:
        assert self._root is not None
        root, limits = self._root, self.spec.limits
        procs = self._cgroup.procs_files if self._cgroup is not None else []
        argv = ["sh", "-c", _ENTER, "prorl-sbx", str(root / "seccomp.bpf"), *procs, "--"]
        argv += ["setpriv", f"--reuid={_NOBODY}", f"--regid={_NOBODY}", "--clear-groups", "--"] if self._as_root else []
        argv += ["unshare", "--user", "--map-root-user", *(["--mount"] if self._snapshot is not None else []), "--"]
        if self._snapshot is not None:
            layers = {"lowerdir": self._snapshot.path, "upperdir": root / "disk/upper", "workdir": root / "disk/work"}
            for path in layers.values():
                if any(c in str(path) for c in ",:\\"):
                    raise SandboxError(f"cannot use {path} as an overlay layer (',', ':' or '\\' in the path)")
            # userxattr: overlayfs keeps its whiteouts and opaque dirs in user.* xattrs, which a user namespace
            # may write (trusted.* it may not: without this, removing or renaming a lower directory fails).
            options = ",".join([*(f"{key}={path}" for key, path in layers.items()), "userxattr"])
            argv += ["sh", "-c", _MOUNT_OVERLAY, "prorl-sbx", options, str(root / "merged")]
        argv += [self._bwrap, "--unshare-all", "--unshare-user", "--cap-drop", "ALL"]
        argv += ["--uid", str(_INNER_UID), "--gid", str(_INNER_UID), "--hostname", "sandbox"]
        argv += ["--share-net"] if self.spec.network else []
        argv += ["--die-with-parent", "--as-pid-1", "--seccomp", "3"]
        image_is_root = self._image_is_root()
        argv += self._root_fs_args(image_is_root)
        # tmpfs counts against the memory limit: each at most a quarter of it, so filling them is "disk full",
        # not the OOM killer. With a disk of its own, /tmp is on it.
        size = str(limits.memory_mb * 2**20 // 4)
        argv += ["--proc", "/proc", "--dev", "/dev", "--size", size, "--tmpfs", "/dev/shm"]
        if self._disk is not None:
            argv += ["--bind", str(root / "disk/tmp"), "/tmp"]
        else:
            argv += ["--size", size, "--tmpfs", "/tmp"]
        workspace = root / ("merged" if self._snapshot is not None else "disk/workspace")
        argv += ["--bind", str(workspace), self.spec.workspace, "--ro-bind", str(root / "control"), CONTROL_DIR]
        for bind in self.spec.binds:
            if not os.path.exists(bind.source):
                raise SandboxError(f"bind source {bind.source!r} does not exist")
            self._check_reachable(bind.source)
            if not PurePosixPath(bind.target).is_absolute():
                raise SandboxError(f"bind target {bind.target!r} is not an absolute path")
            argv += ["--bind" if bind.writable else "--ro-bind", bind.source, bind.target]
        if not image_is_root:
            argv += ["--remount-ro", "/"]  # "/" itself is bwrap's tmpfs
        argv += ["--chdir", self.spec.workspace, "--clearenv"]
        for key, value in self._env().items():
            argv += ["--setenv", key, value]
        return [*argv, "--", *_SHELL]

    def _root_fs_args(self, image_is_root: bool) -> list[str]:
        assert self._root is not None
        image = self.spec.image
        if image is None:
            args = ["--ro-bind", "/usr", "/usr"]
            for link in ("bin", "sbin", "lib", "lib64"):
                args += ["--symlink", f"usr/{link}", f"/{link}"]
            args += ["--ro-bind", "/etc", "/etc"]
            for path in _hidden_etc_paths():
                args += ["--ro-bind", str(self._root / ("emptydir" if os.path.isdir(path) else "empty")), path]
            for name in _ETC_OWN:
                args += ["--ro-bind", str(self._root / f"etc-{name}"), f"/etc/{name}"]
            return args
        if not os.path.isdir(image):
            raise SandboxError(f"bwrap backend needs a rootfs directory as image, not {image!r}")
        self._check_reachable(image)
        if not os.path.exists(os.path.join(image, "bin/bash")) and not os.path.exists(
            os.path.join(image, "usr/bin/bash")
        ):
            raise SandboxError(f"image {image!r} has no bash (/bin/bash), which the sandbox's shell needs")
        own_passwd = ["--ro-bind", str(self._root / "etc-passwd"), "/etc/passwd"]
        if not (self._root / "etc-passwd").exists():
            own_passwd = []
        if image_is_root:
            return ["--ro-bind", image, "/", *own_passwd]
        args = []
        mounted_over = ("proc", "dev", "tmp", "sys", "workspace", CONTROL_DIR.lstrip("/"), self.spec.workspace[1:])
        for entry in sorted(os.scandir(image), key=lambda e: e.name):
            if entry.name in mounted_over:
                continue
            if entry.is_symlink():
                args += ["--symlink", os.readlink(entry.path), f"/{entry.name}"]
            else:
                args += ["--ro-bind", entry.path, f"/{entry.name}"]
        return args + own_passwd

    def _image_is_root(self) -> bool:
        """Whether the image can be `/` itself: it has a directory for each mount point over it (a read-only
        tree cannot grow them)."""
        image = self.spec.image
        if image is None:
            return False
        binds = (bind.target for bind in self.spec.binds)
        targets = ["/proc", "/dev", "/tmp", self.spec.workspace, CONTROL_DIR, *binds]
        return all(os.path.isdir(os.path.join(image, target.lstrip("/"))) for target in targets)

    def _check_reachable(self, path: str) -> None:
        """As root, bwrap runs as uid 65534 and can bind only what other users may reach: say so before it fails."""
        if not self._as_root:
            return
        current = os.path.abspath(path)
        while True:
            mode = os.stat(current).st_mode
            if stat.S_ISDIR(mode) and not mode & stat.S_IXOTH:
                raise SandboxError(
                    f"{path!r} is out of reach of the sandbox's host uid {_NOBODY}: {current} is mode "
                    f"{stat.S_IMODE(mode):o}; keep images and bind sources where other users can read them"
                )
            if current == "/":
                return
            current = os.path.dirname(current)

    def _env(self) -> dict[str, str]:
        return {"PATH": IMAGE_PATH, "HOME": self.spec.workspace, "LANG": "C.UTF-8", "TERM": "dumb", **self.spec.env}

    # -- exec and file I/O through the join helper -------------------------------------------------------------

    async def _join(
        self, op: str, extra: dict[str, Any], *, timeout: float, data: bytes = b""
    ) -> tuple[ExecResult, bytes]:
        """Run the join helper for `op` ("exec", "read", "write"); output capped, timeout kills the program."""
        shell = self._running_shell()
        if not shell.alive:
            await shell.start()  # the shell exited since the last command: its namespaces are what we join
        assert self._root is not None
        init = _init_pid(shell.pid)
        request = {
            "op": op,
            "pid": init,
            "host_uid": _NOBODY if self._as_root else None,
            "cgroup_procs": self._cgroup.procs_files if self._cgroup is not None else [],
            "seccomp": str(self._root / "seccomp.bpf"),
            "rlimits": rlimits(self.spec.limits),
            "cwd": self.spec.workspace,
            "env": self._env(),
            **extra,
        }
        limit = self.spec.limits.max_output_bytes if op == "exec" else None
        return await _run_helper(join_argv(sys.executable, request), data, timeout, limit)

    async def _join_file_io(self, op: str, rel: PurePosixPath, data: bytes) -> bytes:
        path = f"{self.spec.workspace}/{rel}"
        max_read = self.spec.limits.max_read_mb * 2**20
        result, raw = await self._join(op, {"path": path, "max_read": max_read}, timeout=_FILE_IO_TIMEOUT_S, data=data)
        if result.exit_code == 0:
            return raw
        code, _, message = raw.decode(errors="replace").partition(":")
        if code == "outside":
            raise PathOutsideWorkspaceError(f"path {str(rel)!r} resolves outside {self.spec.workspace} (via a symlink)")
        if code == "special":
            raise NotARegularFileError(errno.EINVAL, f"a {message}, not a regular file; refused", path)
        if code == "large":
            raise FileTooLargeError(errno.EFBIG, too_large_message(int(message), max_read), path)
        if code.isdigit():
            raise OSError(int(code), message.strip(), path)
        raise SandboxError(f"{op} of {path} failed: {result.output.strip()} (exit {result.exit_code})")

    # -- fork --------------------------------------------------------------------------------------------------

    async def changed_paths(self, limit: int = 10_000) -> list[str] | None:
        """For a fork: the workspace paths it changed since it was forked (its overlay's upper dir holds exactly
        those, `overlay_changes`), None past `limit` of them. None for a sandbox that is no fork."""
        writable = self.writable_dir
        if self._snapshot is None or writable is None:
            return None
        return await asyncio.to_thread(overlay_changes, writable / "upper", limit)

    async def _copy_workspace_to(self, target: Path) -> None:
        """Copy this sandbox's workspace as its processes see it (a fork's is its overlay) into `target`, with every
        process of the sandbox frozen meanwhile: `cp` follows no symlink, but a directory the sandbox swapped for a
        symlink between `cp`'s look and its open (`renameat2(RENAME_EXCHANGE)` in a loop) would have it copy
        whatever the link points at on the host."""
        if self._snapshot is None:
            source = str(self.workspace)
        else:
            shell = self._running_shell()
            if not shell.alive:
                await shell.start()
            source = f"/proc/{_init_pid(shell.pid)}/root{self.spec.workspace}"
        argv = ["cp", "-a", "--reflink=auto", f"{source}/.", f"{target}/"]
        async with self._frozen():
            returncode, stderr = await _run_to_completion(argv)
        if returncode != 0:
            raise SandboxError(f"could not snapshot the workspace: {stderr.strip()}")
        if self._as_root:
            os.chown(target, _NOBODY, _NOBODY)
        target.chmod(0o755)

    @contextlib.asynccontextmanager
    async def _frozen(self) -> AsyncIterator[None]:
        """Every process of the sandbox stopped for the duration: by the cgroup freezer, else (no cgroups: rootless)
        by SIGSTOP to each process of its pid namespace until none is left running."""
        cgroup = self._cgroup
        if cgroup is not None and cgroup.can_freeze:
            try:
                if not await _poll_until(cgroup.freeze, _KILL_WAIT_S):
                    raise SandboxError(f"could not freeze the sandbox's processes (cgroup {cgroup.dirs['freezer']})")
                yield
            finally:
                cgroup.thaw()
            return
        namespace = _pid_namespace(_init_pid(self._running_shell().pid))
        stopped: set[int] = set()

        def all_stopped() -> bool:  # a stopped process starts no other: done once a look finds no other
            members = _namespace_members(namespace)
            for pid in members - stopped:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGSTOP)
            stopped.update(members)
            return all(_state(pid) in (b"T", b"Z", b"X", None) for pid in members)

        try:
            if not await _poll_until(all_stopped, _KILL_WAIT_S):
                raise SandboxError("could not stop the sandbox's processes")
            yield
        finally:
            for pid in stopped:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)

    # -- close -------------------------------------------------------------------------------------------------

    def _running_shell(self) -> PtyShell:
        self._check_open()
        if self._shell is None:
            raise SandboxError("sandbox is not started")
        return self._shell

    async def _close(self) -> None:
        killed = False
        try:
            if self._shell is not None:
                await self._shell.close()
            killed = True
        finally:
            try:
                if self._cgroup is not None:
                    await self._remove_cgroup(self._cgroup)
                if killed and self._hand_over_to is not None and self._root is not None:  # nothing inside runs now
                    await asyncio.to_thread(self._hand_over, self._hand_over_to)
            finally:
                await asyncio.to_thread(self._remove_host_side)
                if self._snapshot is not None and self._started and self._snapshot.release():
                    await asyncio.to_thread(self._snapshot.remove)

    def _remove_host_side(self) -> None:
        """Remove the temp dir, then let the disk go (one thread hop: each costs ~0.2 ms of a close). The dir goes
        first: the kernel's teardown of the disk, which `unmount` starts, would slow down removing its mount point."""
        try:
            if self._disk is not None:
                self._disk.detach()  # a no-op unless a new shell's start left it attached
            if self._root is not None and self._root.exists():
                _remove_owned_dir(self._root)
        finally:
            if self._disk is not None:  # a disk handed over to forks stays intact: they read it
                self._disk.unmount(discard=not self._handed_over)

    def _hand_over(self, target: Path) -> None:
        """Give the workspace to a snapshot: its directory moved there, or its disk mounted there as well."""
        assert self._root is not None
        if self._disk is None:
            os.rename(self._root / "disk/workspace", target)
        else:
            self._disk.mount_copy(target, "workspace")
            assert self._hand_over_snapshot is not None
            self._hand_over_snapshot.holds_mount = True
        self._handed_over = True

    @staticmethod
    async def _remove_cgroup(cgroup: SandboxCgroup) -> None:
        """Kill what is left in the cgroup (processes that left the shell's session) and remove it."""

        def gone() -> bool:
            cgroup.kill()
            return cgroup.remove_now()

        if not await _poll_until(gone, _KILL_WAIT_S):
            raise SandboxError(f"cgroup {cgroup.dirs} still has processes {sorted(cgroup.pids())} after SIGKILL")

    # -- host-side file I/O (plain workspace) ------------------------------------------------------------------

    def _host_workspace(self) -> HostWorkspace | None:
        """The workspace as a host directory; None for a fork, whose files only its own mount namespace sees (so
        they go through the join helper, which resolves symlinks inside)."""
        if self._root is None or self._close_task is not None:
            raise SandboxError("sandbox is not running")
        if self._snapshot is not None:
            return None
        max_read = self.spec.limits.max_read_mb * 2**20
        owner = _NOBODY if self._as_root else None
        assert self.workspace is not None
        return HostWorkspace(self.workspace, owner, max_read, inside=self.spec.workspace)


class _BwrapLauncher(ShellLauncher):
    """Starts a sandbox's chain (`argv`, beginning with `_ENTER`) on its pty; see "Start-up" in the module docstring.

    Its processes are those of the sandbox's pid namespace, which die with their init; and the sandbox is gone when
    bwrap was killed, or its init was: SIGKILL from inside the sandbox cannot reach its init (the kernel protects a
    pid namespace's init), so that came from the host or the kernel's OOM killer. (A shell that ends with
    `exit 137` reads the same.) Any other exit is the shell's own (`exit`): a new sandbox shell takes over.
    """

    def __init__(self, argv: list[str], setup: str, disk: SandboxDisk | None, disk_mount_point: Path) -> None:
        super().__init__(argv, {"PATH": IMAGE_PATH})
        self.setup = setup
        self._disk, self._disk_mount_point = disk, disk_mount_point

    def spawn(self, tty: int) -> subprocess.Popen[bytes]:
        if self._disk is not None:  # bwrap binds the disk by its path (a new shell after the first needs it back)
            self._disk.attach(self._disk_mount_point)
        return subprocess.Popen(
            self.argv, stdin=tty, stdout=tty, stderr=tty, env=self.env, close_fds=True, start_new_session=True,
            preexec_fn=interruptible_children(),
        )  # fmt: skip

    def started(self) -> None:
        """The sandbox has its own bind of its disk now: take the disk's mount point out of the host's namespace
        (`disk.py`: every later bwrap start would copy it), in a thread, as the kernel takes ~1 ms to detach."""
        if self._disk is not None:
            detaching = asyncio.get_running_loop().run_in_executor(None, self._disk.detach)
            detaching.add_done_callback(_log_failed_detach)

    def members(self, pid: int) -> set[int]:
        try:
            return {_init_pid(pid)}
        except SandboxError:  # still starting up, bwrap not there yet
            return super().members(pid)

    def lost(self, returncode: int) -> str | None:
        if returncode < 0:
            return f"the sandbox was killed: bwrap got {signal.Signals(-returncode).name}"
        if returncode == 128 + signal.SIGKILL:
            return "the sandbox was killed: its init got SIGKILL from the host (or the kernel's OOM killer)"
        return None


def _log_failed_detach(detaching: asyncio.Future[None]) -> None:
    if not detaching.cancelled() and detaching.exception() is not None:
        log.warning("could not detach a sandbox disk from the host (it stays until the sandbox closes): %s",
                    detaching.exception())


class _Snapshot:
    """A frozen copy of a workspace (`tree`, in a temp dir of its own) that forks use as their overlay's lower
    layer; removed with its last user."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.root.chmod(0o711)
        _write_owner(root, [])
        self.path = root / "tree"
        self.path.mkdir()
        self._users = 0
        self.holds_mount = False
        """Whether `tree` is a disk handed over by a closed sandbox (`disk.py`), to unmount before removal."""

    def acquire(self) -> None:
        self._users += 1

    def release(self) -> bool:
        """Drop one user; True when that was the last, and the caller must `remove()` the snapshot."""
        self._users -= 1
        return self._users == 0

    def remove(self) -> None:
        if self.holds_mount:
            disk.shut_down(self.path)
            disk.unmount_under(self.path)
            self.holds_mount = False
        if self.root.exists():
            _remove_owned_dir(self.root)


_OWNER_FILE = ".owner"


def _write_owner(root: Path, cgroup_dirs: list[str]) -> None:
    """Record who made `root` (pid and start time) and its cgroups, for `sweep_orphans`."""
    pid = os.getpid()
    lines = [f"{pid} {_start_time(pid)}", *cgroup_dirs]
    (root / (_OWNER_FILE + ".new")).write_text("\n".join(lines) + "\n")
    (root / (_OWNER_FILE + ".new")).rename(root / _OWNER_FILE)


def _remove_owned_dir(root: Path) -> None:
    """Remove a dir `_write_owner` marked, its owner record last: a process killed halfway through leaves a dir the
    sweep still finds (with its cgroups and mounts), never an unmarked one nobody will remove."""
    for entry in os.scandir(root):
        if entry.name != _OWNER_FILE:
            if entry.is_dir(follow_symlinks=False):
                remove_tree(entry.path)
            else:
                os.unlink(entry.path)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(root / _OWNER_FILE)
    os.rmdir(root)


def _start_time(pid: int | str) -> str:
    with open(f"/proc/{pid}/stat", "rb") as f:
        return f.read().rsplit(b")", 1)[1].split()[19].decode()  # field 22: start time in clock ticks


_DISK_SPARES = disk.DiskSpares()
"""Disks made ahead of sandboxes' starts (`disk.DiskSpares`)."""


def sweep_orphans(temp_root: str | None = None) -> list[str]:
    """Remove the temp dirs and cgroups of sandboxes whose owning process died without closing them (SIGKILL,
    power loss of the service, not of the host): their processes died with it (`--die-with-parent`), this removes
    the rest. Returns the temp dirs removed. Safe beside live services: only dead owners' leftovers are touched."""
    removed = []
    for entry in os.scandir(temp_root or tempfile.gettempdir()):
        if not entry.name.startswith(TEMP_PREFIX):
            continue
        try:
            owner, *cgroup_dirs = Path(entry.path, _OWNER_FILE).read_text().splitlines()
            pid, start = owner.split()
        except (OSError, ValueError):
            continue  # not a sandbox dir, or one being made right now
        try:
            if _start_time(pid) == start:
                continue  # the owner lives
        except OSError:
            pass
        cgroup = SandboxCgroup({path: path for path in cgroup_dirs if os.path.isdir(path)})
        cgroup.kill()
        cgroup.remove_now()
        if disk.available():
            disk.unmount_under(entry.path)
        with contextlib.suppress(FileNotFoundError):  # another process may be sweeping it too
            remove_tree(entry.path)
        removed.append(entry.path)
    return removed


@functools.cache
def _sweep_once() -> None:
    """The first sandbox a process starts sweeps what dead processes left behind."""
    with contextlib.suppress(OSError):
        sweep_orphans()


def _pid_namespace(pid: int) -> str:
    return os.readlink(f"/proc/{pid}/ns/pid")


def _namespace_members(namespace: str) -> set[int]:
    """Host pids of the processes in the pid namespace `namespace` (as `_pid_namespace` names it)."""
    found = set()
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if os.readlink(f"/proc/{entry.name}/ns/pid") == namespace:
                    found.add(int(entry.name))
    return found


def _state(pid: int) -> bytes | None:
    """A process's state letter (/proc/PID/stat), None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0]
    except OSError:
        return None


def _init_pid(bwrap_pid: int | None) -> int:
    """Host pid of the sandbox's init: the one child of the outer bwrap process."""
    try:
        with open(f"/proc/{bwrap_pid}/task/{bwrap_pid}/children") as f:
            children = f.read().split()
    except (FileNotFoundError, ProcessLookupError):
        children = []
    if len(children) != 1:
        raise SandboxError(f"cannot find the sandbox's init process (bwrap pid {bwrap_pid}, children {children})")
    return int(children[0])


async def _run_helper(argv: list[str], data: bytes, timeout: float, limit: int | None) -> tuple[ExecResult, bytes]:
    """Run the join helper: stdin `data`; stdout (the program's output) capped at `limit` (None: kept whole and
    returned as bytes too); stderr the helper's own complaint. Timeout or a flood of output: SIGTERM (the helper
    kills the program's group), then SIGKILL. Cancellation does the same before it propagates."""
    loop = asyncio.get_running_loop()
    started = loop.time()
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    try:
        proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=out_w, stderr=err_w, close_fds=True)
    except BaseException:
        for fd in (out_r, err_r):
            os.close(fd)
        raise
    finally:
        os.close(out_w)
        os.close(err_w)
    kept = OutputCap(limit) if limit is not None else None
    whole = bytearray()
    flooded = loop.create_future()
    exited = loop.create_future()
    pidfd = os.pidfd_open(proc.pid)

    def drain() -> None:
        while True:
            try:
                chunk = os.read(out_r, 65536)
            except BlockingIOError:
                return
            if not chunk:
                loop.remove_reader(out_r)
                return
            if kept is None:
                whole.extend(chunk)
            else:
                kept.add(chunk)
                if kept.seen > max(DEFAULT_MAX_DRAINED_BYTES, limit or 0) and not flooded.done():
                    flooded.set_result(None)

    def on_exit() -> None:
        loop.remove_reader(pidfd)
        exited.set_result(None)

    os.set_blocking(out_r, False)
    loop.add_reader(out_r, drain)
    loop.add_reader(pidfd, on_exit)
    assert proc.stdin is not None
    feeder = asyncio.ensure_future(asyncio.to_thread(_feed, proc.stdin, data))  # ends when the helper does
    timed_out = False
    note = ""
    try:
        await asyncio.wait([exited, flooded], timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        if not exited.done():
            timed_out = not flooded.done()
            note = f"[timed out after {timeout:g}s: killed]" if timed_out else "[output too long: killed]"
            await _stop(proc, exited)
        # What the program wrote before it ended is in the pipe now; its children may hold the pipe open, so
        # stop here instead of waiting for EOF.
        drain()
    finally:
        if proc.poll() is None:
            await _stop(proc, exited)
        await asyncio.gather(feeder, return_exceptions=True)
        loop.remove_reader(out_r)
        loop.remove_reader(pidfd)
        os.close(pidfd)
        os.close(out_r)
        with os.fdopen(err_r, "rb") as err:
            os.set_blocking(err.fileno(), False)
            complaint = (err.read() or b"").decode(errors="replace").strip()
    if complaint:
        raise SandboxError(complaint)
    if kept is None:
        output, truncated = "", False
    else:
        output, truncated = kept.text(), kept.dropped > 0
    if note:
        output = with_note(output, note + "\n")
    result = ExecResult(
        output=output,
        exit_code=None if note else proc.returncode,
        timed_out=timed_out,
        truncated=truncated,
        duration_s=loop.time() - started,
    )
    return result, bytes(whole)


async def _run_to_completion(argv: list[str]) -> tuple[int, str]:
    """Run a host command to its end; cancelled, it is killed and reaped before the cancellation goes on (so
    nothing writes into a directory the caller is about to remove)."""
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        _, stderr = await asyncio.to_thread(proc.communicate)
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    return proc.returncode, stderr.decode(errors="replace")


def _feed(stdin: Any, data: bytes) -> None:
    with contextlib.suppress(BrokenPipeError):
        stdin.write(data)
    with contextlib.suppress(BrokenPipeError):
        stdin.close()


async def _stop(proc: subprocess.Popen[bytes], exited: asyncio.Future[None]) -> None:
    """SIGTERM the helper (it SIGKILLs the program's process group and exits), SIGKILL it if it lingers; reap."""
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(signal.SIGTERM)
    try:
        await asyncio.wait_for(asyncio.shield(exited), _KILL_WAIT_S)
    except TimeoutError:
        proc.kill()
    await asyncio.to_thread(proc.wait)


@functools.cache
def _hidden_etc_paths() -> tuple[str, ...]:
    """Paths under the host's /etc to hide: the known credential files, and whatever other users may not read."""
    hidden = [f"/etc/{name}" for name in _ETC_HIDDEN if os.path.lexists(f"/etc/{name}")]
    for dirpath, dirnames, filenames in os.walk("/etc"):
        if any(dirpath == h or dirpath.startswith(h + "/") for h in hidden):
            dirnames[:] = []
            continue
        for name in [*dirnames, *filenames]:
            path = os.path.join(dirpath, name)
            try:
                st = os.lstat(path)
            except OSError:
                continue
            if stat.S_ISLNK(st.st_mode) or st.st_mode & stat.S_IROTH or path in hidden:
                continue
            hidden.append(path)
        dirnames[:] = [d for d in dirnames if os.path.join(dirpath, d) not in hidden]
    return tuple(sorted(set(hidden)))
