"""Sandbox backend on Apptainer: one persistent instance per sandbox, a PTY shell and programs exec'd into it.

`start()` runs `apptainer instance start --containall --no-home --writable-tmpfs --uts`, network off unless asked,
the workspace bound read-write (on a disk of its own, as root). The persistent shell (`PtyShell`) and every `exec()`
are `apptainer exec instance://NAME ...`; closing kills the instance's init, and every process with it. As root,
each process drops to uid 65534 with no capabilities under the filter of `seccomp.py`, in Apptainer's cgroups; a
watchdog kills the instance if we die. Instances are named `prorl-<owner pid>-<owner start time>-<random>`, and
`reap_orphan_instances()` stops only those whose owner is gone.

Design notes: docs/sandboxes.md#sandboxapptainerpy
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import glob
import json
import logging
import os
import platform
import pwd
import re
import secrets
import select
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from nemo_gym_prorl.contracts.sandbox import IMAGE_PATH, ExecResult, SandboxError, SandboxSpec, with_note
from nemo_gym_prorl.sandbox import disk, images, passwd, seccomp
from nemo_gym_prorl.sandbox.apptainer_binary import find_apptainer
from nemo_gym_prorl.sandbox.disk import SandboxDisk
from nemo_gym_prorl.sandbox.lifecycle import SandboxLifecycle, to_thread_to_the_end
from nemo_gym_prorl.sandbox.limits import OutputCap, rlimits
from nemo_gym_prorl.sandbox.pty_shell import PtyShell, ShellLauncher
from nemo_gym_prorl.sandbox.workspace import HostWorkspace, remove_tree

CONTROL_DIR = "/.prorl"
INSTANCE_PREFIX = "prorl-"
SANDBOX_UID = 65534
"""uid and gid of everything that runs inside a sandbox started by root."""

log = logging.getLogger(__name__)

_NAME_RE = re.compile(r"^prorl-(\d+)-(\d+)-[0-9a-f]{8}$")
_KEEP_CAPS = frozenset({"CAP_SETUID", "CAP_SETGID", "CAP_SETPCAP"})
# Every capability Apptainer knows; an entering process drops all but _KEEP_CAPS (naming them is how Apptainer
# takes a drop list; `--drop-caps ALL` would drop the ones we need for setpriv too).
_ALL_CAPS = (
    "CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_DAC_READ_SEARCH", "CAP_FOWNER", "CAP_FSETID", "CAP_KILL", "CAP_SETGID",
    "CAP_SETUID", "CAP_SETPCAP", "CAP_LINUX_IMMUTABLE", "CAP_NET_BIND_SERVICE", "CAP_NET_BROADCAST", "CAP_NET_ADMIN",
    "CAP_NET_RAW", "CAP_IPC_LOCK", "CAP_IPC_OWNER", "CAP_SYS_MODULE", "CAP_SYS_RAWIO", "CAP_SYS_CHROOT",
    "CAP_SYS_PTRACE", "CAP_SYS_PACCT", "CAP_SYS_ADMIN", "CAP_SYS_BOOT", "CAP_SYS_NICE", "CAP_SYS_RESOURCE",
    "CAP_SYS_TIME", "CAP_SYS_TTY_CONFIG", "CAP_MKNOD", "CAP_LEASE", "CAP_AUDIT_WRITE", "CAP_AUDIT_CONTROL",
    "CAP_SETFCAP", "CAP_MAC_OVERRIDE", "CAP_MAC_ADMIN", "CAP_SYSLOG", "CAP_WAKE_ALARM", "CAP_BLOCK_SUSPEND",
    "CAP_AUDIT_READ", "CAP_PERFMON", "CAP_BPF", "CAP_CHECKPOINT_RESTORE",
)  # fmt: skip
_START_TIMEOUT_S = 60.0
_STOP_WAIT_S = 5.0
_SECCOMP_FILE = "seccomp.json"
_PF_EXITING = 0x4  # a process's flag (in /proc/PID/stat) from the moment it begins to exit
_STARTUP_PIDS = 64  # room for Apptainer's own tasks until the shell is up and the pids limit is tightened


def list_instances(apptainer: str | None = None) -> dict[str, dict[str, Any]]:
    """This user's running Apptainer instances by name (`apptainer instance list --json`)."""
    proc = subprocess.run(
        [apptainer or find_apptainer(), "-q", "instance", "list", "--json"],
        check=False,
        capture_output=True,
        text=True,
        env=_host_env(),
    )
    if proc.returncode != 0:
        raise SandboxError(f"apptainer instance list failed: {proc.stderr.strip()}")
    return {entry["instance"]: entry for entry in json.loads(proc.stdout or "{}").get("instances") or []}


def reap_orphan_instances(apptainer: str | None = None) -> list[str]:
    """Stop the instances of sandboxes whose owner process is gone (its pid is free or names a newer process), and
    remove those sandboxes' temp dirs and instance logs; returns their names. Instances without our label, or whose
    owner still runs, are left alone. Call it when a service starts, to clean up after one that crashed."""
    binary = apptainer or find_apptainer()
    reaped = set()
    for name in list_instances(binary):
        if _is_orphan(name):
            _stop_instance_sync(binary, name)
            reaped.add(name)
    for leftover in Path(tempfile.gettempdir()).glob(f"{INSTANCE_PREFIX}*-*"):
        name = leftover.name.rsplit("-", 1)[0]  # <name>-<mkdtemp suffix>
        ours = leftover.is_dir() and not leftover.is_symlink() and leftover.stat().st_uid == os.geteuid()
        if ours and _is_orphan(name):
            if disk.available():
                disk.unmount_under(leftover)
            remove_tree(leftover)
            reaped.add(name)
    for log in _instance_logs(f"{INSTANCE_PREFIX}*"):
        name = log.name.rsplit(".", 1)[0]
        if _is_orphan(name):
            log.unlink(missing_ok=True)
            reaped.add(name)
    return sorted(reaped)


def _is_orphan(name: str) -> bool:
    """True for a name of ours whose owner (pid and start time, both in the name) no longer runs."""
    match = _NAME_RE.match(name)
    return match is not None and _process_start_time(int(match[1])) != int(match[2])


class ApptainerSandbox(SandboxLifecycle):
    """One Apptainer instance holding a persistent shell; see the module docstring for what it isolates."""

    def __init__(self, spec: SandboxSpec | None = None, *, apptainer: str | None = None) -> None:
        self.spec = spec or SandboxSpec()
        self._apptainer = apptainer
        self._as_root = os.geteuid() == 0
        owner = os.getpid()
        self.name = f"{INSTANCE_PREFIX}{owner}-{_process_start_time(owner)}-{secrets.token_hex(4)}"
        self._dir: Path | None = None
        self._control: Path | None = None
        self._shell: PtyShell | None = None
        self._starting: subprocess.Popen[bytes] | None = None
        self._execs: set[_Program] = set()
        self._init_fd: int | None = None
        self._monitor_fd: int | None = None
        self._instance_pid: int | None = None
        self._monitor_pid: int | None = None
        self._instance_requested = False
        self._started = False
        self._disk: SandboxDisk | None = None
        self._watchdog: subprocess.Popen[bytes] | None = None

    @property
    def workspace(self) -> Path | None:
        """Host directory mounted at `spec.workspace`; None before start and once closing. With a disk of its own, a
        path through this process's fd of the disk (`SandboxDisk.root`; not for `realpath`)."""
        if self._dir is None or self._close_task is not None:
            return None
        return (self._disk.root if self._disk is not None else self._dir / "disk") / "workspace"

    @property
    def temp_dir(self) -> Path | None:
        """The sandbox's one host temp dir (`<tmp>/<name>-*`: workspace and control dir); None before start."""
        return self._dir

    @property
    def pid(self) -> int | None:
        """Host pid of the process that runs the shell (Apptainer's parent of it), None while no shell runs."""
        return self._shell.pid if self._shell is not None else None

    @property
    def instance_pid(self) -> int | None:
        """Host pid of the instance's init, None before the instance is up."""
        return self._instance_pid

    async def start(self) -> None:
        if self._started or self._close_task is not None:
            raise SandboxError("sandbox already started")
        self._started = True
        try:
            self._apptainer = self._apptainer or find_apptainer()
            image = await asyncio.to_thread(self._resolve_image)
            self._make_dirs()
            limits = self.spec.limits
            if limits.disk_mb is not None and disk.available():
                await to_thread_to_the_end(self._make_disk, limits.disk_mb)
            else:
                self._make_writable_dirs()
            await self._start_instance(image)
            if self._disk is not None:  # the instance has its binds of it: off the critical path, as it is ~1 ms
                asyncio.get_running_loop().run_in_executor(None, self._detach_disk)
            self._home_in_passwd()
            assert self._control is not None
            self._shell = PtyShell(
                _InstanceShellLauncher(
                    self._enter_argv(["/bin/bash", "--norc", "--noprofile", "--noediting", "-i"]),
                    _host_env(),
                    self._lost,
                ),
                self._control,
                CONTROL_DIR,
                max_output_bytes=limits.max_output_bytes,
            )
            await self._shell.start()
            self._tighten_pids_limit()
        except BaseException:
            await self.close()
            raise
        self._arm_wall_clock()

    async def run(self, command: str, timeout: float) -> ExecResult:
        if self._shell is None:
            raise SandboxError("sandbox is not started")
        self._check_open()
        self._raise_if_lost()
        result = await self._shell.run(command, timeout)
        if self._expired:
            result.output += f"[{self._closed_reason()}]\n"
        return result

    async def exec(self, argv: list[str], timeout: float) -> ExecResult:
        if self._shell is None:
            raise SandboxError("sandbox is not started")
        self._check_open()
        self._raise_if_lost()
        if not argv:
            raise ValueError("exec needs a program to run")
        loop = asyncio.get_running_loop()
        started = loop.time()
        run = _Program(self._enter_argv(list(argv)), self.spec.limits.max_output_bytes)
        self._execs.add(run)
        try:
            status, timed_out = await run.wait(timeout)
        finally:
            self._execs.discard(run)
        self._raise_if_lost()  # the instance died while the program ran, and took it along
        output = run.output
        text = output.text()
        exit_code = status
        if timed_out:
            exit_code = None
            text = with_note(text, f"[timed out after {timeout:g}s: killed]\n")
        elif self._close_task is not None:
            exit_code = None
            text += f"[{self._closed_reason()}]\n"
        return ExecResult(
            output=text,
            exit_code=exit_code,
            timed_out=timed_out,
            truncated=output.dropped > 0,
            duration_s=loop.time() - started,
        )

    async def write_file(self, path: str, data: bytes) -> None:
        await asyncio.to_thread(self._host_workspace().write, path, data)

    async def read_file(self, path: str) -> bytes:
        return await asyncio.to_thread(self._host_workspace().read, path)

    def _raise_if_lost(self) -> None:
        """SandboxError, saying why, if the instance is gone while the sandbox is open."""
        reason = self._lost()
        if reason is not None:
            raise SandboxError(reason)

    def _lost(self) -> str | None:
        """Why the instance is gone while the sandbox is open, or None while it runs. Only the host (or the kernel's
        OOM killer) can end it: its init cannot be killed from inside its pid namespace, and Apptainer's monitor
        is outside it."""
        if self._init_fd is None or self._monitor_fd is None or self._close_task is not None:
            return None
        assert self._instance_pid is not None and self._monitor_pid is not None
        if _ending(self._monitor_pid, self._monitor_fd):
            return "the sandbox was killed: Apptainer's monitor of its instance was killed from the host"
        if _ending(self._instance_pid, self._init_fd):
            return (
                "the sandbox was killed: its instance's init was killed from the host (or by the kernel's OOM killer)"
            )
        return None

    # -- starting --------------------------------------------------------------------------------------------

    def _resolve_image(self) -> str:
        if self.spec.image is None:
            try:
                rootfs = images.rootfs_path(images.ImageSpec())
            except images.ImageError as e:
                raise SandboxError(f"cannot locate the default image: {e}") from e
            sif = images.sif_path(rootfs)
            if sif.is_file():
                return str(sif)
            if images.is_built(rootfs):
                return str(rootfs)
            raise SandboxError(
                f"the default image is not built ({rootfs}); build it with `prorl image build --sif` "
                "(python -m nemo_gym_prorl.sandbox.images --sif)"
            )
        image = Path(self.spec.image)
        if image.is_dir():
            for needed in (".singularity.d/startscript", ".singularity.d/actions/start"):
                if not (image / needed).is_file():
                    raise SandboxError(
                        f"{image} has no /{needed}, so Apptainer cannot start an instance from it: "
                        "build it with nemo_gym_prorl.sandbox.images.build_rootfs or use a SIF"
                    )
            return str(image)
        if image.is_file():
            return str(image)
        raise SandboxError(f"image {image} does not exist")

    def _make_dirs(self) -> None:
        """The sandbox's host dir `<tmp>/<name>-XXXX/` with `disk/` (the disk's mount point) and `control/`."""
        self._dir = Path(tempfile.mkdtemp(prefix=f"{self.name}-"))
        self._control = self._dir / "control"
        (self._dir / "disk").mkdir()
        self._control.mkdir(mode=0o755)
        self._control.chmod(0o755)
        if self._as_root:
            (self._dir / _SECCOMP_FILE).write_text(json.dumps(_seccomp_profile()))

    def _make_writable_dirs(self) -> None:
        """The workspace, and with a disk of its own a work dir for Apptainer's /tmp and /var/tmp (`--workdir`) and
        /dev/shm."""
        assert self._dir is not None
        for name in ("workspace", "scratch", "shm") if self._disk is not None else ("workspace",):
            (self._dir / "disk" / name).mkdir()
            if self._as_root:
                os.chown(self._dir / "disk" / name, SANDBOX_UID, SANDBOX_UID)
        if self._disk is not None:
            (self._dir / "disk/shm").chmod(0o1777)

    def _make_disk(self, size_mb: int) -> None:
        """The sandbox's writable space as a filesystem of its own, its size the sandbox's total (`disk.py`)."""
        assert self._dir is not None
        owner = SANDBOX_UID if self._as_root else None
        self._disk = SandboxDisk.create(self._dir, self._dir / "disk", size_mb, owner)
        self._make_writable_dirs()

    def _detach_disk(self) -> None:
        """Take the disk's mount point out of the host's mount namespace (`disk.py`): every later start of a sandbox
        of any backend would copy it, and bwrap reads the host's mount table once per bind. A failure leaves it
        attached until close, which is harmless but for that."""
        assert self._disk is not None
        try:
            self._disk.detach()
        except OSError as e:
            log.warning("could not detach a sandbox disk from the host (it stays until the sandbox closes): %s", e)

    async def _start_instance(self, image: str) -> None:
        assert self._dir is not None and self._control is not None and self._apptainer is not None
        argv = [self._apptainer, "-q", "instance", "start", "--containall", "--no-home", "--writable-tmpfs"]
        argv += ["--uts", "--hostname", "sandbox"]  # its own hostname, as in bwrap
        argv += [] if self.spec.network else ["--net", "--network", "none"]
        if self._as_root:
            limits = self.spec.limits
            argv += ["--security", f"seccomp:{_bind_path(self._dir / _SECCOMP_FILE)}"]
            argv += ["--no-privs", "--memory", f"{limits.memory_mb}M", "--memory-swap", f"{limits.memory_mb}M"]
            if limits.max_processes is not None:
                argv += ["--pids-limit", str(limits.max_processes + _STARTUP_PIDS)]
        if self._disk is not None:  # /tmp, /var/tmp and /dev/shm on the sandbox's disk: filling them is "disk full"
            argv += ["--workdir", _bind_path(self._dir / "disk/scratch")]
            argv += ["--bind", f"{_bind_path(self._dir / 'disk/shm')}:/dev/shm:rw"]
        argv += ["--bind", f"{_bind_path(self._dir / 'disk/workspace')}:{self.spec.workspace}:rw"]
        argv += ["--bind", f"{_bind_path(self._control)}:{CONTROL_DIR}:ro"]
        for bind in self.spec.binds:
            argv += ["--bind", f"{_bind_path(bind.source)}:{_bind_path(bind.target)}:{'rw' if bind.writable else 'ro'}"]
        argv += [image, self.name]
        # Run to completion even if our caller is cancelled meanwhile: close() waits for it, then stops the
        # instance, so a half-started instance is never left behind. Spawned without an await in between, so that
        # no cancellation can land after the process exists and before close() can see it.
        self._instance_requested = True
        self._starting = starting = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=_host_env(),
            start_new_session=True,
        )
        out, _ = await asyncio.shield(asyncio.to_thread(starting.communicate))
        if starting.returncode != 0:
            logs = [log.read_text(errors="replace") for log in _instance_logs(self.name) if log.suffix == ".err"]
            details = "\n".join(part.strip() for part in (*logs, out.decode(errors="replace")) if part.strip())
            raise SandboxError(f"apptainer instance start failed: {details}")
        entry = (await asyncio.to_thread(list_instances, self._apptainer)).get(self.name)
        if entry is None:
            raise SandboxError(f"apptainer started instance {self.name} but does not list it")
        self._open_instance_pidfds(int(entry["pid"]))
        self._start_watchdog()

    def _home_in_passwd(self) -> None:
        """As root, the sandbox runs as uid 65534, whose image entry has its home at /nonexistent: it gets the
        workspace, where HOME points (`passwd.py`), in the instance's writable layer, before anything of the
        sandbox runs. (Started as another user, the sandbox runs as that user, with the entry Apptainer gives it.)"""
        if not self._as_root or self._instance_pid is None:
            return
        root_fd = os.open(f"/proc/{self._instance_pid}/root", os.O_PATH | os.O_DIRECTORY)
        try:
            passwd.rewrite_beneath(root_fd, SANDBOX_UID, self.spec.workspace)
        finally:
            os.close(root_fd)

    def _start_watchdog(self) -> None:
        """The process that kills the instance if we die without closing it (`watchdog.py`)."""
        assert self._init_fd is not None
        self._watchdog = subprocess.Popen(
            [sys.executable, "-I", "-S", str(Path(__file__).with_name("watchdog.py")), str(self._init_fd)],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            pass_fds=(self._init_fd,),
            env=_host_env(),
        )

    def _open_instance_pidfds(self, init_pid: int) -> None:
        """pidfds of the container's init and of Apptainer's monitor (its parent): signalled and watched without
        any risk of hitting a recycled pid."""
        init_fd = os.pidfd_open(init_pid)
        try:
            monitor_pid = _parent_pid(init_pid)
            monitor_fd = os.pidfd_open(monitor_pid)
        except OSError:
            os.close(init_fd)
            raise
        self._init_fd, self._monitor_fd = init_fd, monitor_fd
        self._instance_pid, self._monitor_pid = init_pid, monitor_pid
        # Both pidfds are open now, so these pids cannot be reused; check that they still are the instance's.
        if _parent_pid(init_pid) != monitor_pid or f"[{self.name}]" not in _cmdline(monitor_pid):
            raise SandboxError(f"instance {self.name} exited right after it started")

    def _tighten_pids_limit(self) -> None:
        """Set the pids cgroup to `max_processes` plus Apptainer's own tasks in it, counted now that the shell runs:
        the init's threads (a Go runtime, as many as the host has CPUs) and the shell's Apptainer parent. Each
        `exec()` running at the same time adds its own Apptainer parent to the count."""
        limit = self.spec.limits.max_processes
        if not self._as_root or limit is None or self._instance_pid is None:
            return
        pids_dir = _cgroup_dir(self._instance_pid, "pids")
        if pids_dir is None:
            raise SandboxError(f"instance {self.name} has no pids cgroup")
        current = int((pids_dir / "pids.current").read_text())
        # The shell and the init (as one process, not its threads) count as the sandbox's: the pid namespace holds
        # at most `limit` processes.
        (pids_dir / "pids.max").write_text(str(limit + current - 2))

    def _enter_argv(self, program: list[str]) -> list[str]:
        """argv on the host that runs `program` inside the instance, with the sandbox's user, limits and env."""
        assert self._apptainer is not None
        limits = self.spec.limits
        argv = [self._apptainer, "-q", "exec", "--cleanenv", "--pwd", self.spec.workspace]
        if self._as_root:
            assert self._dir is not None
            argv += ["--security", f"seccomp:{self._dir / _SECCOMP_FILE}"]
            argv += ["--drop-caps", ",".join(cap for cap in _ALL_CAPS if cap not in _KEEP_CAPS)]
        argv += [f"instance://{self.name}"]
        if self._as_root:
            argv += ["/usr/bin/setpriv", f"--reuid={SANDBOX_UID}", f"--regid={SANDBOX_UID}", "--clear-groups"]
            argv += ["--inh-caps=-all", "--bounding-set=-all", "--no-new-privs", "--"]
        values = rlimits(limits)
        if self._as_root:
            values.pop("nproc", None)  # as uid 65534 in the host's user namespace it would count every sandbox
        argv += ["/usr/bin/prlimit", *(f"--{name}={soft}:{hard}" for name, (soft, hard) in values.items())]
        env = {"PATH": IMAGE_PATH, "HOME": self.spec.workspace, "LANG": "C.UTF-8", "TERM": "dumb", **self.spec.env}
        argv += ["--", "/usr/bin/env", "-i", *(f"{key}={value}" for key, value in env.items())]
        return argv + program

    # -- closing ---------------------------------------------------------------------------------------------

    async def _close(self) -> None:
        try:
            if self._shell is not None:
                await self._shell.close()
            for program in list(self._execs):
                program.kill()
            starting = self._starting
            if starting is not None and starting.poll() is None:
                try:
                    await asyncio.to_thread(starting.wait, _START_TIMEOUT_S)
                except subprocess.TimeoutExpired:
                    _kill_session(starting.pid)
                    await asyncio.to_thread(starting.wait)
            await self._stop_instance()
        finally:
            if self._watchdog is not None:  # its stdin closed, it kills the init (gone already) and exits
                assert self._watchdog.stdin is not None
                self._watchdog.stdin.close()
                await asyncio.to_thread(self._watchdog.wait)
            for fd in (self._init_fd, self._monitor_fd):
                if fd is not None:
                    os.close(fd)
            self._init_fd = self._monitor_fd = None
            remove_instance_logs(self.name)
            await asyncio.to_thread(self._remove_host_side)

    def _remove_host_side(self) -> None:
        """Remove the temp dir, then let the disk go (one thread hop; the dir first, as the kernel's teardown of the
        disk, which `unmount` starts, would slow down removing its mount point)."""
        try:
            if self._disk is not None:
                self._disk.detach()  # a no-op unless start failed before detaching it, or detaching failed
            if self._dir is not None and self._dir.exists():
                remove_tree(self._dir)
        finally:
            if self._disk is not None:
                self._disk.unmount()

    async def _stop_instance(self) -> None:
        """Kill the container's init (its pid namespace dies with it) and wait for Apptainer's monitor to clean up
        and exit. That is what `apptainer instance stop --signal KILL` does, without its one-second polling; the
        command itself is the fallback when the monitor does not finish, or when the pidfds were never opened."""
        if not self._instance_requested or self._apptainer is None:
            return
        if self._init_fd is not None and self._monitor_fd is not None:
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(self._init_fd, signal.SIGKILL)
            if await _wait_readable(self._monitor_fd, _STOP_WAIT_S):
                return
        else:  # start failed or was cancelled half-way: find the instance, if it came up, by its name
            if self.name not in await asyncio.to_thread(list_instances, self._apptainer):
                return
        await asyncio.to_thread(_stop_instance_sync, self._apptainer, self.name)
        if self._monitor_fd is not None and not await _wait_readable(self._monitor_fd, _STOP_WAIT_S):
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(self._monitor_fd, signal.SIGKILL)
            await _wait_readable(self._monitor_fd, _STOP_WAIT_S)

    # -- workspace I/O -----------------------------------------------------------------------------------------

    def _host_workspace(self) -> HostWorkspace:
        workspace = self.workspace
        if workspace is None:
            raise SandboxError("sandbox is not running")
        max_read = self.spec.limits.max_read_mb * 2**20
        owner = SANDBOX_UID if self._as_root else None
        return HostWorkspace(workspace, owner, max_read, inside=self.spec.workspace)


def _seccomp_profile() -> dict[str, Any]:
    """The filter of `seccomp.py` as an OCI seccomp profile, which Apptainer loads into each process it starts.

    Apptainer ignores a rule's `errnoRet` (every denial answers EPERM), and an EPERM from `clone3` would stop libc
    from falling back to `clone` (threads with it). So `clone3`, whose flags a filter cannot read, gets
    SCMP_ACT_TRACE: with no tracer attached (and none can be: ptrace is denied) the kernel answers ENOSYS, as bwrap's
    filter does, libc falls back to `clone`, and `clone` with a CLONE_NEW* flag, `unshare` and `setns` are denied."""
    deny: dict[str, Any] = {"action": "SCMP_ACT_ERRNO", "errnoRet": errno.EPERM}
    arches = {
        "x86_64": ["SCMP_ARCH_X86_64", "SCMP_ARCH_X86", "SCMP_ARCH_X32"],
        "aarch64": ["SCMP_ARCH_AARCH64", "SCMP_ARCH_ARM"],
    }.get(platform.machine(), [])
    rules = [{"names": list(seccomp.DENIED), **deny}]
    rules += [
        {
            "names": ["clone"],
            **deny,
            "args": [{"index": 0, "value": flag, "valueTwo": flag, "op": "SCMP_CMP_MASKED_EQ"}],
        }
        for flag in seccomp.CLONE_NEW_FLAGS
    ]
    rules += [
        {"names": ["ioctl"], **deny, "args": [{"index": 1, "value": request, "op": "SCMP_CMP_EQ"}]}
        for request in seccomp.TERMINAL_IOCTLS
    ]
    rules += [{"names": ["clone3"], "action": "SCMP_ACT_TRACE"}]  # no tracer can attach (ptrace is denied): ENOSYS
    return {"defaultAction": "SCMP_ACT_ALLOW", "architectures": arches, "syscalls": rules}


class _InstanceShellLauncher(ShellLauncher):
    """The default launcher (`argv` under `setsid --ctty` with `env`) that also tells a shell's exit that means the
    sandbox is gone, `lost()` saying why: its instance was killed (see `ApptainerSandbox._lost`). Any other exit is
    the shell's own (`exit`): a new shell takes over."""

    def __init__(self, argv: Sequence[str], env: Mapping[str, str], lost: Callable[[], str | None]) -> None:
        super().__init__(argv, env)
        self._lost = lost

    def lost(self, returncode: int) -> str | None:
        return self._lost()


class _Program:
    """One `apptainer exec` with its output on a pipe, watched through a pidfd.

    Not an asyncio subprocess: its `wait()` also waits for the pipe to close, which a background process the
    program leaves in the sandbox keeps open. Here the program is done when Apptainer's process exits; what it
    wrote is in the pipe by then and is read without waiting for the pipe's other holders.
    """

    def __init__(self, argv: list[str], max_output_bytes: int) -> None:
        self.output = OutputCap(max_output_bytes)
        read_end, write_end = os.pipe()
        try:
            self._proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=write_end,
                stderr=write_end,
                env=_host_env(),
                start_new_session=True,  # Apptainer's parent and the program share this session: killed together
            )
        except BaseException:
            os.close(read_end)
            raise
        finally:
            os.close(write_end)
        self._pipe = read_end
        self._pidfd = os.pidfd_open(self._proc.pid)
        os.set_blocking(self._pipe, False)
        asyncio.get_running_loop().add_reader(self._pipe, self._read)

    async def wait(self, timeout: float) -> tuple[int | None, bool]:
        """(exit status, timed out): 128 + N for a program killed by signal N, None on timeout. On timeout, or
        when cancelled, the program and its session are killed."""
        try:
            timed_out = not await _wait_readable(self._pidfd, timeout)
            if timed_out:
                self.kill()
                await _wait_readable(self._pidfd, _STOP_WAIT_S)
            status = self._proc.wait()  # exited (the pidfd said so): reaps at once
        finally:
            if self._proc.poll() is None:
                self.kill()
                await asyncio.shield(_wait_readable(self._pidfd, _STOP_WAIT_S))
                self._proc.wait()
            self._finish()
        if timed_out:
            return None, True
        return (128 - status if status < 0 else status), False  # killed by a signal: as a shell reports it

    def kill(self) -> None:
        if self._proc.returncode is None:  # not yet reaped: its pid, and so its session id, are still its own
            _kill_session(self._proc.pid)

    def _read(self) -> None:
        while True:
            try:
                chunk = os.read(self._pipe, 65536)
            except BlockingIOError:
                return
            if not chunk:
                asyncio.get_running_loop().remove_reader(self._pipe)
                return
            self.output.add(chunk)

    def _finish(self) -> None:
        """Take what is buffered in the pipe now, then stop reading it."""
        if self._pipe < 0:
            return
        self._read()
        asyncio.get_running_loop().remove_reader(self._pipe)
        os.close(self._pipe)
        os.close(self._pidfd)
        self._pipe = -1


def _host_env() -> dict[str, str]:
    """Environment of the Apptainer commands on the host: a PATH to find its helpers, nothing else of ours."""
    return {"PATH": os.environ.get("PATH", "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"), "LANG": "C"}


def _bind_path(path: str | os.PathLike[str]) -> str:
    text = str(path)
    if not os.path.isabs(text) or ":" in text or "," in text:
        raise SandboxError(f"bind path {text!r} must be absolute and hold no ':' or ','")
    return text


def _stop_instance_sync(apptainer: str, name: str) -> None:
    """`apptainer instance stop --force NAME` (SIGKILL to its init); an instance already gone is fine."""
    subprocess.run(
        [apptainer, "-q", "instance", "stop", "--force", name],
        check=False,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        env=_host_env(),
        timeout=60,
    )


def _instance_logs(name: str) -> list[Path]:
    """Apptainer's log files of this user's instance `name` (a glob pattern), which outlive the instance."""
    configdir = os.environ.get("APPTAINER_CONFIGDIR") or os.path.join(pwd.getpwuid(os.geteuid()).pw_dir, ".apptainer")
    return [
        Path(p) for p in glob.glob(os.path.join(glob.escape(configdir), "instances", "logs", "*", "*", f"{name}.*"))
    ]


def remove_instance_logs(name: str) -> None:
    """Remove Apptainer's log files of this user's (stopped) instance `name`, which outlive the instance."""
    for log in _instance_logs(name):
        log.unlink(missing_ok=True)


def _kill_session(sid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(sid, signal.SIGKILL)


def _ending(pid: int, pidfd: int) -> bool:
    """Whether the process `pid` (whose pidfd is `pidfd`) has exited or is exiting, without waiting.

    Its pidfd polls readable once it has exited; but a pid namespace's init exits only after every other process of
    the namespace is gone, so the shell, killed by its death, may be seen gone first. From the moment a process
    begins to exit, the kernel marks it PF_EXITING (/proc/PID/stat), which is what closes that gap. The pidfd is
    polled first: it keeps saying whether `pid` still is that process."""
    poller = select.poll()
    poller.register(pidfd, select.POLLIN)
    if poller.poll(0):
        return True
    fields = _stat_fields(pid)
    return fields is None or fields[0] in (b"Z", b"X") or bool(int(fields[6]) & _PF_EXITING)


async def _wait_readable(fd: int, timeout: float) -> bool:
    """Wait until a pidfd reports its process's exit (an event, not a poll); False on timeout."""
    loop = asyncio.get_running_loop()
    exited = loop.create_future()
    loop.add_reader(fd, lambda: exited.done() or exited.set_result(True))
    try:
        await asyncio.wait_for(exited, timeout)
        return True
    except TimeoutError:
        return False
    finally:
        loop.remove_reader(fd)


def _cgroup_dir(pid: int, controller: str) -> Path | None:
    """The cgroup v1 directory of `pid` for `controller`, where this process sees that hierarchy mounted."""
    relative = None
    with contextlib.suppress(OSError), open(f"/proc/{pid}/cgroup") as f:
        for line in f:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            if controller in controllers.split(","):
                relative = path
    if relative is None:
        return None
    with open("/proc/self/mountinfo") as f:
        for line in f:
            before, _, after = line.partition(" - ")
            fields, (fstype, _source, options) = before.split(), (after.split() + ["", "", ""])[:3]
            if fstype == "cgroup" and controller in options.split(",") and relative.startswith(fields[3]):
                candidate = Path(fields[4], os.path.relpath(relative, fields[3]))
                if candidate.is_dir():
                    return candidate
    return None


def _stat_fields(pid: int) -> list[bytes] | None:
    """Fields of /proc/PID/stat after "pid (comm)": state, ppid, pgrp, session, ..., starttime is index 19."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()
    except OSError:
        return None


def _process_start_time(pid: int) -> int | None:
    fields = _stat_fields(pid)
    return int(fields[19]) if fields else None


def _parent_pid(pid: int) -> int:
    fields = _stat_fields(pid)
    if fields is None:
        raise ProcessLookupError(pid)
    return int(fields[1])


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""
