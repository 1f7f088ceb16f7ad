"""PtyShell against a real bash in a real pty (no sandbox around it): what is the pty's own — restarting a shell that
hangs or was killed, interrupting a flood, spawning safely, the controlling terminal, closing a bare session.

The shell's behaviour that holds inside every sandbox too (state, exit codes, output, timeouts, cancellation) is
tested over PtyShell alone and each backend in test_sandbox_backends.py.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import warnings
from collections.abc import AsyncIterator
from pathlib import Path

import psutil
import pytest
from sandbox_helpers import process_tree, wait_until

from nemo_gym_prorl.contracts.sandbox import SandboxError
from nemo_gym_prorl.sandbox.pty_shell import PtyShell

BASH = ["bash", "--norc", "--noprofile", "--noediting", "-i"]


@pytest.fixture
async def shell(tmp_path: Path) -> AsyncIterator[PtyShell]:
    sh = PtyShell(BASH, tmp_path, env={"PATH": "/usr/bin:/bin", "TERM": "dumb"}, max_output_bytes=10_000, grace_s=0.5)
    await sh.start()
    try:
        yield sh
    finally:
        await sh.close()


async def test_unresponsive_shell_is_restarted(shell: PtyShell) -> None:
    result = await shell.run("trap '' INT QUIT; sleep 100", 1)
    assert result.timed_out and "restarted" in result.output
    after = await shell.run("echo ok", 5)
    assert after.output == "ok\n" and after.exit_code == 0


async def test_close_kills_everything_and_is_idempotent(shell: PtyShell) -> None:
    result = await shell.run("sleep 1000 & echo $!", 5)
    assert shell.pid is not None
    processes = process_tree(shell.pid)
    assert int(result.output) in {p.pid for p in processes}
    await shell.close()
    await shell.close()
    assert not [p for p in processes if p.is_running()]
    with pytest.raises(SandboxError):
        await shell.run("echo hi", 5)


async def test_output_flood_is_interrupted_promptly(tmp_path: Path) -> None:
    sh = PtyShell(BASH, tmp_path, env={"PATH": "/usr/bin:/bin"}, max_output_bytes=1000, max_drained_bytes=1_000_000)
    await sh.start()
    try:
        result = await sh.run("echo first; yes", 60)
        assert result.exit_code is None and result.truncated and not result.timed_out and result.duration_s < 10
        assert result.output.startswith("first\ny\ny\n")
        assert "[output passed 1000000 bytes: interrupted" in result.output
        assert (await sh.run("echo ok", 5)).output == "ok\n"
    finally:
        await sh.close()


# A service started as a background job of a script inherits SIGINT and SIGQUIT ignored: its shells' commands must
# still take Ctrl-C (the shell keeps its state), whether the shell is spawned on the main thread or another one.
_BACKGROUND_SERVICE = """
import asyncio, sys, threading
from nemo_gym_prorl.sandbox.pty_shell import PtyShell

async def main():
    sh = PtyShell(["bash", "--norc", "--noprofile", "--noediting", "-i"], sys.argv[1], env={"PATH": "/usr/bin:/bin"})
    await sh.start()
    try:
        await sh.run("KEPT=yes", 5)
        print((await sh.run("sleep 100", 1)).output, end="|")
        print((await sh.run("echo $KEPT", 5)).output, end="")
    finally:
        await sh.close()

if sys.argv[2] == "main":
    asyncio.run(main())
else:
    worker = threading.Thread(target=asyncio.run, args=(main(),))
    worker.start()
    worker.join()
"""


@pytest.mark.parametrize("thread", ["main", "other"])
def test_commands_take_ctrl_c_in_a_service_started_ignoring_it(tmp_path: Path, thread: str) -> None:
    script = tmp_path / "service.py"
    script.write_text(_BACKGROUND_SERVICE)
    background_job = f'"$0" {script} {tmp_path} {thread} & grep SigIgn /proc/$!/status; wait $!'
    done = subprocess.run(["bash", "-c", background_job, sys.executable], capture_output=True, text=True, timeout=60)
    ignored, result = done.stdout.split("\n", 1)
    assert int(ignored.split()[1], 16) & 0b110 == 0b110, "the job did not start with SIGINT and SIGQUIT ignored"
    interrupted, kept = result.split("|")
    assert "restarted" not in interrupted and kept == "yes\n", done.stdout + done.stderr


async def test_spawn_is_fork_safe_in_a_threaded_process(tmp_path: Path) -> None:
    """Python >= 3.12 warns when a multi-threaded process forks and then runs Python in the child (pty.fork(),
    which ptyprocess uses); the shell is spawned by fork/exec in C instead, so no warning even with threads."""
    release = threading.Event()
    worker = threading.Thread(target=release.wait)
    worker.start()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            sh = PtyShell(BASH, tmp_path, env={"PATH": "/usr/bin:/bin"})
            await sh.start()
            try:
                assert (await sh.run("echo ok", 5)).output == "ok\n"
            finally:
                await sh.close()
        assert not [w for w in caught if "multi-threaded" in str(w.message)]
    finally:
        release.set()
        worker.join()


async def test_the_pty_is_the_controlling_terminal_of_a_session_of_its_own(shell: PtyShell) -> None:
    result = await shell.run("readlink /proc/$$/fd/2; ps -o sid=,tty= -p $$; (: < /dev/tty) && echo has-ctty", 5)
    device, session, ctty = result.output.splitlines()
    assert device.startswith("/dev/pts/") and session.split() == [str(shell.pid), device.removeprefix("/dev/")]
    assert ctty == "has-ctty"


async def test_a_shell_killed_between_commands_is_replaced_at_once(shell: PtyShell) -> None:
    await shell.run("export GONE=1", 5)
    assert shell.pid is not None and shell.alive
    psutil.Process(shell.pid).kill()
    await wait_until(lambda: not shell.alive)
    result = await shell.run("echo ok ${GONE:-unset}", 30)
    assert result.output.startswith("ok unset\n") and "reset" in result.output and result.duration_s < 5
    await shell.start()  # a no-op while the shell runs
    assert (await shell.run("echo again", 5)).output == "again\n"
