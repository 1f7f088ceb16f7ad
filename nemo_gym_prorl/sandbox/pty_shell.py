"""A persistent interactive bash in a pseudo-terminal, driven without blocking the event loop.

Each command is written to a file and sourced by the shell (cwd, variables and functions persist), then a random,
numbered marker carries `$?`. No readline and no echo: the output is exactly what the command printed. A timed-out
command is interrupted through the terminal (Ctrl-C, then Ctrl-\\); a shell that does not answer is restarted.
Spawning is fork-safe in a threaded process; how the child becomes a session leader with the pty as its
controlling terminal is the `ShellLauncher`'s business.

Design notes: docs/sandboxes.md#sandboxpty_shellpy
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import secrets
import shutil
import signal
import struct
import subprocess
import termios
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from nemo_gym_prorl.contracts.sandbox import ExecResult, SandboxError, with_note
from nemo_gym_prorl.sandbox.interrupts import interruptible_children
from nemo_gym_prorl.sandbox.limits import OutputCap

_SETUP = (
    "PS1=''; PS2=''; PS0=''; PROMPT_COMMAND=''; unset HISTFILE; set +o history +m; "
    "ulimit -S -c 0; bind 'set enable-bracketed-paste off' 2>/dev/null; "
)
_RESET_NOTE = "[new shell (the previous one exited or hung): cwd, variables and background processes were reset]"
_RESTARTED = (
    "the shell did not respond to Ctrl-C or Ctrl-\\ and was restarted: cwd, variables and background processes "
    "were reset"
)
_CTRL_C = b"\x03"
_CTRL_BACKSLASH = b"\x1c"
_POLL_S = 0.005
_KILL_WAIT_S = 2.0
DEFAULT_MAX_DRAINED_BYTES = 16 * 2**20


class _Capture:
    """Collects one request's output until its marker line, keeping at most `limit` bytes (head and tail).

    `done` resolves to the exit status printed with the marker, or to None if the shell went away first;
    `flooded` resolves once more than `drain_limit` bytes came without the marker.
    """

    def __init__(self, marker: bytes, limit: int, drain_limit: int | None = None) -> None:
        self._needle = b"\n" + marker + b":"
        self._pending = bytearray()
        self._kept = OutputCap(limit)
        self._drain_limit = drain_limit
        loop = asyncio.get_running_loop()
        self.done: asyncio.Future[int | None] = loop.create_future()
        self.flooded: asyncio.Future[None] = loop.create_future()

    @property
    def dropped(self) -> int:
        return self._kept.dropped

    def feed(self, data: bytes) -> None:
        if self.done.done():
            return
        self._pending += data
        start = self._pending.find(self._needle)
        if start < 0:
            # Keep a possible partial marker at the end; everything before it is output.
            cut = len(self._pending) - len(self._needle) + 1
            if cut > 0:
                self._keep(self._pending[:cut])
                del self._pending[:cut]
            return
        end = self._pending.find(b"\n", start + len(self._needle))
        if end < 0:
            return
        status = self._pending[start + len(self._needle) : end].rstrip(b"\r")
        self._keep(self._pending[:start])
        self._pending.clear()
        self.done.set_result(int(status) if status.isdigit() else None)

    def finish(self) -> None:
        """Stop collecting: what is pending is output, and the marker will not come."""
        if not self.done.done():
            self._keep(self._pending)
            self._pending.clear()
            self.done.set_result(None)

    def text(self) -> str:
        return self._kept.text()

    def _keep(self, data: bytes | bytearray) -> None:
        self._kept.add(data)
        if self._drain_limit is not None and self._kept.seen > self._drain_limit and not self.flooded.done():
            self.flooded.set_result(None)


class ShellLauncher:
    """How a shell's process starts on its pty, which processes belong to it, and which of its exits mean that the
    sandbox it ran in is gone.

    This default runs `argv` under `setsid --ctty`, counts the processes of its session as its own, and takes
    every exit as one a new shell may recover from (the next command starts one). `setup`: bash commands each new
    shell runs first, before any command it is given.
    """

    setup = ""

    def __init__(self, argv: Sequence[str], env: Mapping[str, str] | None = None) -> None:
        self.argv = list(argv)
        self.env = dict(env) if env is not None else None

    def spawn(self, tty: int) -> subprocess.Popen[bytes]:
        """Start the process with `tty` (the pty's slave end) as stdin, stdout, stderr and controlling terminal,
        taking Ctrl-C even if this process was started ignoring it (`interrupts.py`: a launcher of its own passes
        the same `preexec_fn`)."""
        setsid = shutil.which("setsid") or "/usr/bin/setsid"
        return subprocess.Popen(
            [setsid, "--ctty", *self.argv],
            stdin=tty, stdout=tty, stderr=tty, env=self.env, close_fds=True, preexec_fn=interruptible_children(),
        )  # fmt: skip

    def started(self) -> None:
        """Called (on the event loop) once a shell it spawned has answered its setup: what the launcher set up for
        the shell is in place by then."""

    def members(self, pid: int) -> set[int]:
        """The processes to kill before the leader `pid` when the shell is torn down."""
        return _session_members(pid) - {pid}

    def lost(self, returncode: int) -> str | None:
        """Why the sandbox is gone, when the leader ended by itself with `returncode` (as `subprocess` reports it:
        negative for a signal); None when a new shell may take over."""
        return None


class PtyShell:
    """A bash started from `argv` in a pty; `run()` executes commands in it one at a time.

    `argv` is the shell's command line, started by the default `ShellLauncher` with `env`, or a launcher of its
    own. `control_dir` is a host directory that the shell sees at `control_dir_inside` (the same path by default);
    command files are written there. The shell is restarted transparently after it exits or hangs, unless the
    launcher says its exit means the sandbox is gone: then this and every later call raises `SandboxError`.
    `close()` kills the shell and every process of its session.
    """

    def __init__(
        self,
        argv: Sequence[str] | ShellLauncher,
        control_dir: str | Path,
        control_dir_inside: str | None = None,
        *,
        env: Mapping[str, str] | None = None,
        max_output_bytes: int = 64_000,
        max_drained_bytes: int = DEFAULT_MAX_DRAINED_BYTES,
        grace_s: float = 1.0,
        start_timeout_s: float = 10.0,
        dimensions: tuple[int, int] = (24, 200),
    ) -> None:
        self._launcher = argv if isinstance(argv, ShellLauncher) else ShellLauncher(argv, env)
        self._control_dir = Path(control_dir)
        self._control_inside = control_dir_inside or str(self._control_dir)
        self._max_output = max_output_bytes
        self._max_drained = max(max_drained_bytes, max_output_bytes)
        self._grace_s = grace_s
        self._start_timeout_s = start_timeout_s
        self._dimensions = dimensions
        self._token = secrets.token_hex(8)
        self._seq = 0
        self._lock = asyncio.Lock()
        self._proc: _PtyChild | None = None
        self._pidfd: int | None = None
        self._capture: _Capture | None = None
        self._teardown_task: asyncio.Task[None] | None = None
        self._exit_status: int | None = None
        self._dirty = False
        self._replaced = False  # a shell was replaced outside run() (by start()): the next run says so
        self._closed = False
        self._exited_by_itself = False  # the current shell's process ended without our teardown
        self._lost: str | None = None  # why the sandbox is gone (the launcher's verdict on an exit), if it is

    @property
    def pid(self) -> int | None:
        """Host pid of the process started from `argv`, None while no shell is running."""
        return self._proc.pid if self._proc is not None else None

    @property
    def alive(self) -> bool:
        """True while the shell process runs (it may be busy with a command)."""
        return self._proc is not None and not self._gone()

    async def start(self) -> None:
        """Start the shell, or a new one if the last has exited; a no-op while one runs."""
        async with self._lock:
            if self._closed:
                raise SandboxError("shell is closed")
            self._replaced |= await self._ensure_shell()

    async def run(self, command: str, timeout: float) -> ExecResult:
        """Run `command` (any bash text, multi-line allowed); a timeout interrupts it and keeps the session."""
        async with self._lock:
            if self._closed:
                raise SandboxError("shell is closed")
            loop = asyncio.get_running_loop()
            started = loop.time()
            notes: list[str] = []
            # A new shell, or an earlier run cancelled mid-command that Ctrl-C could not end: state was reset.
            if await self._ensure_shell() or self._replaced or (self._dirty and await self._interrupt() is None):
                notes.append(_RESET_NOTE)
            self._replaced = False
            self._dirty = True
            self._seq += 1
            cmd_file = self._control_dir / f"cmd_{self._seq}.sh"
            cmd_file.write_text(command if command.endswith("\n") else command + "\n", encoding="utf-8")
            cmd_file.chmod(0o644)
            capture = self._expect(self._seq, self._max_output, self._max_drained)
            try:
                self._send(f". {self._control_inside}/{cmd_file.name} < /dev/null; {self._marker_cmd(self._seq)}")
                await asyncio.wait([capture.done, capture.flooded], timeout=timeout, return_when="FIRST_COMPLETED")
                flooded = capture.flooded.done() and not capture.done.done()
                capture.finish()
                self._capture = None
                status = capture.done.result()
                timed_out = False
                if status is not None:
                    self._dirty = False
                    exit_code: int | None = status
                elif self._proc is not None and not self._gone():
                    timed_out, exit_code = not flooded, None
                    how = await self._interrupt() or ("the shell was closed" if self._closed else _RESTARTED)
                    notes.append(
                        f"[output passed {self._max_drained} bytes: {how}]"
                        if flooded
                        else f"[timed out after {timeout:g}s: {how}]"
                    )
                else:
                    await self._teardown()
                    if self._lost is not None:
                        raise SandboxError(self._lost)
                    exit_code = None if self._closed else self._exit_status
                    notes.append(
                        "[the shell was closed while the command ran]"
                        if self._closed
                        else f"[the shell exited (status {exit_code}); the next command starts a fresh shell: "
                        "cwd, variables and background processes are reset]"
                    )
            finally:
                cmd_file.unlink(missing_ok=True)
            output = capture.text()
            if notes:
                output = with_note(output, "\n".join(notes) + "\n")
            return ExecResult(
                output=output,
                exit_code=exit_code,
                timed_out=timed_out,
                truncated=capture.dropped > 0,
                duration_s=loop.time() - started,
            )

    async def close(self) -> None:
        """Kill the shell and every process of its session, reap it, close its fds. Idempotent."""
        self._closed = True
        await self._teardown()

    # -- process lifecycle -------------------------------------------------------------------------------------

    async def _ensure_shell(self) -> bool:
        """Spawn a shell if none runs (reaping one that exited meanwhile); True when it replaced an earlier one.
        Raises SandboxError instead once an exit meant that the sandbox is gone."""
        if self._proc is not None and self._gone():
            await self._teardown()
        if self._lost is not None:
            raise SandboxError(self._lost)
        if self._proc is not None:
            return False
        had_shell = self._seq > 0
        await self._spawn()
        return had_shell

    async def _spawn(self) -> None:
        proc = _PtyChild.spawn(self._launcher, self._dimensions)
        loop = asyncio.get_running_loop()
        os.set_blocking(proc.fd, False)
        self._proc, self._pidfd, self._teardown_task, self._exit_status = proc, os.pidfd_open(proc.pid), None, None
        self._exited_by_itself = False
        loop.add_reader(proc.fd, self._on_readable)
        loop.add_reader(self._pidfd, self._on_process_exit)
        setup = _SETUP + (self._launcher.setup + "; " if self._launcher.setup else "")
        ok, output = await self._sync(setup.encode(), self._start_timeout_s)
        if not ok:
            await self._teardown()
            raise SandboxError(f"shell did not start ({' '.join(self._launcher.argv)}): {output.strip()!r}")
        self._dirty = False
        self._launcher.started()

    async def _interrupt(self) -> str | None:
        """Bring a busy shell back to its prompt: what did it, or None when the shell had to be restarted."""
        for key, name in ((_CTRL_C, "interrupted with Ctrl-C"), (_CTRL_BACKSLASH, "killed with Ctrl-\\")):
            if self._proc is None or self._gone():
                break
            if (await self._sync(key, self._grace_s))[0]:
                self._dirty = False
                return name
        await self._teardown()
        if not self._closed:
            await self._spawn()
        return None

    async def _sync(self, prefix: bytes, timeout: float) -> tuple[bool, str]:
        """Send `prefix` then a marker line; True once the marker is back. Ctrl-C/Ctrl-\\ flush queued input,
        so only the marker of the latest sync is awaited; older output is discarded."""
        self._seq += 1
        capture = self._expect(self._seq, 4096)
        self._send(self._marker_cmd(self._seq), prefix)
        await asyncio.wait([capture.done], timeout=timeout)
        capture.finish()
        self._capture = None
        return capture.done.result() is not None, capture.text()

    async def _teardown(self) -> None:
        """Kill the current shell's session and reap it; concurrent callers share one teardown."""
        if self._proc is None:
            return
        if self._teardown_task is None:
            self._teardown_task = asyncio.ensure_future(self._kill_and_reap(self._proc))
        await asyncio.shield(self._teardown_task)

    async def _kill_and_reap(self, proc: _PtyChild) -> None:
        """Kill the session's other members first so their parents (still alive) reap them, then the leader.

        Killing the leader first would orphan them, and an orphan is only reaped whenever the host's pid 1 gets
        to it. Under bwrap `--as-pid-1` the inner bash is such a member; its death takes its pid namespace along.
        """
        self._detach()
        members = self._launcher.members(proc.pid)
        _kill_all(members)
        loop = asyncio.get_running_loop()
        leader_exited = loop.create_future()  # a sandbox's leader (bwrap) exits once its members are gone
        pidfd = os.pidfd_open(proc.pid) if proc.popen.returncode is None else None  # not reaped: the pid is its own
        if pidfd is not None:
            loop.add_reader(pidfd, lambda: leader_exited.done() or leader_exited.set_result(None))
        try:
            await _poll_until(
                lambda: self._reap(proc) or not any(_exists(p) for p in members), _KILL_WAIT_S, leader_exited
            )
            if not self._reap(proc):
                _kill_all({proc.pid} | self._launcher.members(proc.pid))
                await _poll_until(lambda: self._reap(proc), _KILL_WAIT_S, leader_exited)
        finally:
            if pidfd is not None:
                loop.remove_reader(pidfd)
                os.close(pidfd)
        os.close(proc.fd)
        self._proc = None

    def _reap(self, proc: _PtyChild) -> bool:
        """Non-blocking waitpid of the leader; records its exit status (None when killed by a signal)."""
        code = proc.popen.poll()
        if code is None:
            return False
        self._exit_status = code if code >= 0 else None
        if self._exited_by_itself and not self._closed and self._lost is None:
            self._lost = self._launcher.lost(code)
        return True

    # -- pty I/O -----------------------------------------------------------------------------------------------

    def _marker_cmd(self, seq: int) -> str:
        return f"printf '\\n%s%s:%s\\n' PRORL_ {self._token}_{seq} \"$?\"\n"

    def _expect(self, seq: int, limit: int, drain_limit: int | None = None) -> _Capture:
        self._capture = _Capture(f"PRORL_{self._token}_{seq}".encode(), limit, drain_limit)
        return self._capture

    def _send(self, line: str, prefix: bytes = b"") -> None:
        """Write to the pty. Lines are short (the command itself is in a file), so this fits the tty buffer."""
        assert self._proc is not None
        data = prefix + line.encode()
        while data:
            try:
                data = data[os.write(self._proc.fd, data) :]
            except BlockingIOError:
                raise SandboxError("the shell's terminal input is full") from None
            except OSError:
                return  # the shell is gone; the reader will notice

    def _gone(self) -> bool:
        return self._pidfd is None

    def _on_readable(self) -> None:
        assert self._proc is not None
        try:
            data = os.read(self._proc.fd, 65536)
        except BlockingIOError:
            return
        except OSError:  # EIO: every slave end is closed
            data = b""
        if not data:  # every slave end is closed: the shell's process is gone
            self._exited_by_itself = True
            self._detach()
        elif self._capture is not None:
            self._capture.feed(data)

    def _on_process_exit(self) -> None:
        """The leader exited; take what it wrote before (orphans may keep the pty open, so EOF may never come)."""
        assert self._proc is not None
        while True:
            try:
                data = os.read(self._proc.fd, 65536)
            except OSError:
                break
            if not data:
                break
            if self._capture is not None:
                self._capture.feed(data)
        self._exited_by_itself = True
        self._detach()

    def _detach(self) -> None:
        """Stop watching the shell and end the pending request (its marker will not come)."""
        if self._pidfd is None or self._proc is None:
            return
        loop = asyncio.get_running_loop()
        loop.remove_reader(self._proc.fd)
        loop.remove_reader(self._pidfd)
        os.close(self._pidfd)
        self._pidfd = None
        if self._capture is not None:
            self._capture.finish()


class _PtyChild:
    """A process whose stdin, stdout, stderr and controlling terminal are a new pty; `fd` is the pty's master."""

    def __init__(self, popen: subprocess.Popen[bytes], fd: int) -> None:
        self.popen = popen
        self.fd = fd
        self.pid = popen.pid

    @classmethod
    def spawn(cls, launcher: ShellLauncher, dimensions: tuple[int, int]) -> _PtyChild:
        master, slave = os.openpty()
        try:
            attrs = termios.tcgetattr(slave)
            attrs[1] &= ~termios.ONLCR  # oflag: "\n" stays "\n" (no stty needed in the image)
            attrs[3] &= ~termios.ECHO  # lflag: the shell's input is not echoed back
            termios.tcsetattr(slave, termios.TCSANOW, attrs)
            fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", *dimensions, 0, 0))
            popen = launcher.spawn(slave)
        except OSError as e:
            os.close(master)
            raise SandboxError(f"cannot start shell {launcher.argv[0]!r}: {e}") from e
        except BaseException:
            os.close(master)
            raise
        finally:
            os.close(slave)
        return cls(popen, master)


def _session_members(sid: int) -> set[int]:
    """Host pids of the processes whose session id is `sid` (the shell is a session leader: `setsid --ctty`)."""
    members = set()
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid:  # after "pid (comm)": state ppid pgrp session
            members.add(int(entry.name))
    return members


def _kill_all(pids: set[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)


def _exists(pid: int) -> bool:
    return os.path.exists(f"/proc/{pid}")


async def _poll_until(predicate: Callable[[], bool], timeout: float, wake: asyncio.Future[None] | None = None) -> bool:
    """Reaping is not observable as an event for processes that are not our children: poll, within a deadline.
    `wake`, once done, checks again at once (an event that often makes the predicate true, like a child's exit)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        if asyncio.get_running_loop().time() >= deadline:
            return False
        if wake is None or wake.done():
            await asyncio.sleep(_POLL_S)
        else:
            await asyncio.wait([wake], timeout=_POLL_S)
    return True
