"""PtyShell against a real bash in a real pty (no sandbox around it)."""

from __future__ import annotations

import asyncio
import threading
import warnings
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import psutil
import pytest

from nemo_gym_prorl.sandbox.base import SandboxError
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


def process_tree(pid: int) -> list[psutil.Process]:
    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


async def wait_until(predicate: Callable[[], bool], timeout: float = 5.0) -> None:
    """Wait for a condition we can only observe by looking (a process appearing)."""
    async with asyncio.timeout(timeout):
        while not predicate():
            await asyncio.sleep(0.01)


async def test_state_persists_between_commands(shell: PtyShell, tmp_path: Path) -> None:
    await shell.run(f'cd {tmp_path} && export GREETING=hello; greet() {{ echo "$GREETING $1"; }}', 5)
    result = await shell.run("pwd; greet world", 5)
    assert result.output == f"{tmp_path}\nhello world\n"
    assert result.exit_code == 0


@pytest.mark.parametrize(
    ("command", "code"), [("true", 0), ("false", 1), ("(exit 42)", 42), ("echo hi | grep -q nope", 1)]
)
async def test_exit_codes(shell: PtyShell, command: str, code: int) -> None:
    assert (await shell.run(command, 5)).exit_code == code


async def test_output_is_exactly_what_was_printed(shell: PtyShell) -> None:
    assert (await shell.run("printf 'a\\nb'", 5)).output == "a\nb"
    assert (await shell.run("echo out; echo err >&2", 5)).output == "out\nerr\n"
    assert (await shell.run("printf 'x\\r\\n'", 5)).output == "x\n"
    assert (await shell.run(":", 5)).output == ""


async def test_multiline_command_with_heredoc(shell: PtyShell) -> None:
    command = "NAME=heredoc\ncat <<EOF\nline 1\n  $NAME 'quoted' \"double\"\nEOF\necho done"
    result = await shell.run(command, 5)
    assert result.output == "line 1\n  heredoc 'quoted' \"double\"\ndone\n"
    assert result.exit_code == 0


async def test_large_output_is_capped_and_fast(shell: PtyShell) -> None:
    result = await shell.run("head -c 5000000 /dev/zero | tr '\\0' x; echo; echo END", 20)
    assert result.exit_code == 0 and result.truncated
    assert result.duration_s < 10
    head, tail = result.output.split("\n[... 4990005 bytes truncated ...]\n")
    assert head == "x" * 5000
    assert tail == "x" * 4995 + "\nEND\n"


@pytest.mark.parametrize(
    ("command", "how"),
    [
        ("sleep 100", "Ctrl-C"),
        ("while :; do :; done", "Ctrl-C"),
        ("trap '' INT; sleep 100", "Ctrl-\\"),
    ],
)
async def test_timeout_interrupts_and_keeps_the_session(
    shell: PtyShell, tmp_path: Path, command: str, how: str
) -> None:
    await shell.run(f"cd {tmp_path}; export KEPT=yes", 5)
    result = await shell.run(f"echo before; {command}", 1)
    assert result.timed_out and result.exit_code is None
    assert result.output.startswith("before\n") and "timed out after 1s" in result.output and how in result.output
    after = await shell.run("echo ok; pwd; echo $KEPT", 5)
    assert after.output == f"ok\n{tmp_path}\nyes\n" and after.exit_code == 0


async def test_unresponsive_shell_is_restarted(shell: PtyShell) -> None:
    result = await shell.run("trap '' INT QUIT; sleep 100", 1)
    assert result.timed_out and "restarted" in result.output
    after = await shell.run("echo ok", 5)
    assert after.output == "ok\n" and after.exit_code == 0


async def test_exit_resets_the_shell(shell: PtyShell) -> None:
    await shell.run("export GONE=1", 5)
    result = await shell.run("exit 3", 5)
    assert result.exit_code == 3 and "shell exited" in result.output
    after = await shell.run("echo ok ${GONE:-unset}", 5)
    assert after.exit_code == 0
    assert after.output.startswith("ok unset\n") and "reset" in after.output


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


async def test_cancelled_run_then_close(shell: PtyShell) -> None:
    assert shell.pid is not None
    task = asyncio.create_task(shell.run("sleep 100", 60))
    await wait_until(lambda: any(p.name() == "sleep" for p in process_tree(shell.pid or 0)))
    processes = process_tree(shell.pid)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await shell.close()
    assert not [p for p in processes if p.is_running()]


async def test_cancelled_run_leaves_a_usable_shell(shell: PtyShell) -> None:
    assert shell.pid is not None
    task = asyncio.create_task(shell.run("sleep 100", 60))
    await wait_until(lambda: any(p.name() == "sleep" for p in process_tree(shell.pid or 0)))
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert (await shell.run("echo ok", 5)).output == "ok\n"


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
