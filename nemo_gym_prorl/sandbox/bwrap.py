"""Sandbox backend on bubblewrap: the host's /usr and /etc read-only, a private temp workspace, no network.

Layout inside: `/usr`, `/etc` (read-only, host's), `/bin`, `/lib`, `/lib64` (symlinks into /usr), fresh `/proc`,
`/dev`, `/tmp`; the workspace (a host temp dir) read-write at /workspace; the shell's control dir read-only at
/.prorl. Every namespace is unshared (network shared only with `spec.network`); the user is uid 1000 with no
capabilities. As root, bwrap is started as uid 65534 (`setpriv`), so files on the bind mounts are not root's
either. The shell is the pid namespace's init (`--as-pid-1`): killing it kills everything inside, and bwrap reaps
it, so nothing is left for the host's pid 1.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path, PurePosixPath
from typing import Self

from nemo_gym_prorl.sandbox.base import WORKSPACE, ExecResult, SandboxError, SandboxSpec
from nemo_gym_prorl.sandbox.pty_shell import PtyShell

CONTROL_DIR = "/.prorl"
_NOBODY = 65534
_INNER_UID = 1000
_PATH = "/usr/local/bin:/usr/bin:/bin"


class BwrapSandbox:
    """One bubblewrap sandbox holding a persistent shell; see the module docstring for what it isolates."""

    def __init__(self, spec: SandboxSpec | None = None, *, bwrap: str = "bwrap") -> None:
        self.spec = spec or SandboxSpec()
        self._bwrap = bwrap
        self._as_root = os.geteuid() == 0
        self._workspace: Path | None = None
        self._control: Path | None = None
        self._shell: PtyShell | None = None
        self._wall_timer: asyncio.TimerHandle | None = None
        self._close_task: asyncio.Task[None] | None = None
        self._expired = False

    @property
    def workspace(self) -> Path | None:
        """Host directory mounted at /workspace (None before start)."""
        return self._workspace

    @property
    def pid(self) -> int | None:
        """Host pid of the outer bwrap process, None while no shell runs."""
        return self._shell.pid if self._shell is not None else None

    async def start(self) -> None:
        if self._shell is not None or self._close_task is not None:
            raise SandboxError("sandbox already started")
        self._workspace = Path(tempfile.mkdtemp(prefix="prorl-sbx-"))
        self._control = Path(tempfile.mkdtemp(prefix="prorl-sbx-ctl-"))
        try:
            self._control.chmod(0o755)
            if self._as_root:
                os.chown(self._workspace, _NOBODY, _NOBODY)
            limits = self.spec.limits
            self._shell = PtyShell(
                self._argv(),
                self._control,
                CONTROL_DIR,
                env={"PATH": _PATH},
                max_output_bytes=limits.max_output_bytes,
            )
            await self._shell.start()
        except BaseException:
            await self.close()
            raise
        self._wall_timer = asyncio.get_running_loop().call_later(limits.wall_clock_s, self._expire)

    async def run(self, command: str, timeout: float) -> ExecResult:
        if self._shell is None:
            raise SandboxError("sandbox is not started")
        if self._close_task is not None:
            raise SandboxError(self._closed_reason())
        result = await self._shell.run(command, timeout)
        if self._expired:
            result.output += f"[{self._closed_reason()}]\n"
        return result

    async def write_file(self, path: str, data: bytes) -> None:
        await asyncio.to_thread(self._write, self._relative(path), data)

    async def read_file(self, path: str) -> bytes:
        return await asyncio.to_thread(self._read, self._relative(path))

    async def close(self) -> None:
        """Kill the sandbox and remove its dirs. Idempotent; finishes even if the caller is cancelled meanwhile."""
        if self._close_task is None:
            self._close_task = asyncio.ensure_future(self._close())
        await asyncio.shield(self._close_task)

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- internals ---------------------------------------------------------------------------------------------

    def _argv(self) -> list[str]:
        assert self._workspace is not None and self._control is not None
        limits = self.spec.limits
        argv = ["setpriv", f"--reuid={_NOBODY}", f"--regid={_NOBODY}", "--clear-groups", "--"] if self._as_root else []
        argv += ["prlimit", f"--as={limits.memory_mb * 1024 * 1024}", "--core=0", "--", self._bwrap]
        argv += ["--unshare-all", "--unshare-user", "--uid", str(_INNER_UID), "--gid", str(_INNER_UID)]
        argv += ["--share-net"] if self.spec.network else []
        argv += ["--die-with-parent", "--as-pid-1"]
        argv += ["--ro-bind", "/usr", "/usr", "--symlink", "usr/bin", "/bin", "--symlink", "usr/lib", "/lib"]
        argv += ["--symlink", "usr/lib64", "/lib64", "--ro-bind", "/etc", "/etc"]
        argv += ["--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp"]
        argv += ["--bind", str(self._workspace), WORKSPACE, "--ro-bind", str(self._control), CONTROL_DIR]
        argv += ["--chdir", WORKSPACE, "--clearenv"]
        env = {"PATH": _PATH, "HOME": WORKSPACE, "LANG": "C.UTF-8", "TERM": "dumb", **self.spec.env}
        for key, value in env.items():
            argv += ["--setenv", key, value]
        return [*argv, "--", "/usr/bin/bash", "--norc", "--noprofile", "--noediting", "-i"]

    def _expire(self) -> None:
        self._expired = True
        if self._close_task is None:
            self._close_task = asyncio.ensure_future(self._close())

    def _closed_reason(self) -> str:
        if self._expired:
            return f"sandbox killed: wall-clock limit of {self.spec.limits.wall_clock_s:g}s reached"
        return "sandbox is closed"

    async def _close(self) -> None:
        if self._wall_timer is not None:
            self._wall_timer.cancel()
        try:
            if self._shell is not None:
                await self._shell.close()
        finally:
            for path in (self._workspace, self._control):
                if path is not None and path.exists():
                    shutil.rmtree(path, onexc=_make_writable_and_retry)

    def _relative(self, path: str) -> PurePosixPath:
        """`path` as a workspace-relative path, rejecting anything that leaves the workspace (`..`, symlinks)."""
        if self._workspace is None or self._close_task is not None:
            raise SandboxError("sandbox is not running")
        pure = PurePosixPath(path)
        if pure.is_absolute():
            if not pure.is_relative_to(WORKSPACE):
                raise ValueError(f"path {path!r} is outside {WORKSPACE}")
            pure = pure.relative_to(WORKSPACE)
        root = os.path.realpath(self._workspace)
        resolved = os.path.realpath(os.path.join(root, pure))
        if resolved == root:
            raise ValueError(f"path {path!r} names the workspace itself, not a file in it")
        if not resolved.startswith(root + os.sep):
            raise ValueError(f"path {path!r} resolves outside {WORKSPACE} (via '..' or a symlink)")
        return PurePosixPath(os.path.relpath(resolved, root))

    def _open_dir(self, parts: tuple[str, ...], create: bool) -> int:
        """Open the workspace subdirectory `parts` without following symlinks, so a link swapped in by the
        sandbox after `_relative` checked the path cannot redirect host-side I/O outside the workspace."""
        assert self._workspace is not None
        fd = os.open(self._workspace, os.O_RDONLY | os.O_DIRECTORY)
        try:
            for part in parts:
                if create:
                    try:
                        os.mkdir(part, 0o755, dir_fd=fd)
                        if self._as_root:
                            os.chown(part, _NOBODY, _NOBODY, dir_fd=fd, follow_symlinks=False)
                    except FileExistsError:
                        pass
                child = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
                os.close(fd)
                fd = child
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _write(self, rel: PurePosixPath, data: bytes) -> None:
        dir_fd = self._open_dir(rel.parent.parts, create=True)
        try:
            fd = os.open(rel.name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644, dir_fd=dir_fd)
        finally:
            os.close(dir_fd)
        with open(fd, "wb") as f:
            if self._as_root:
                os.fchown(fd, _NOBODY, _NOBODY)
            f.write(data)

    def _read(self, rel: PurePosixPath) -> bytes:
        dir_fd = self._open_dir(rel.parent.parts, create=False)
        try:
            fd = os.open(rel.name, os.O_RDONLY | os.O_NOFOLLOW, dir_fd=dir_fd)
        finally:
            os.close(dir_fd)
        with open(fd, "rb") as f:
            return f.read()


def _make_writable_and_retry(func: Callable[[str], object], path: str, _exc: BaseException) -> None:
    """rmtree helper: the sandbox may leave read-only directories behind (matters when not running as root)."""
    parent = os.path.dirname(path)
    os.chmod(parent, os.stat(parent).st_mode | stat.S_IWUSR | stat.S_IXUSR)
    func(path)
