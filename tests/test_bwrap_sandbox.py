"""BwrapSandbox against the real bubblewrap: isolation, limits, files, and teardown."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Callable

import psutil
import pytest

from nemo_gym_prorl.sandbox import BwrapSandbox, SandboxError, SandboxLimits, SandboxSpec, open_sandbox

SPEC = SandboxSpec(limits=SandboxLimits(memory_mb=512, max_output_bytes=10_000))


@pytest.fixture
async def sbx() -> AsyncIterator[BwrapSandbox]:
    async with BwrapSandbox(SPEC) as sandbox:
        yield sandbox


def process_tree(pid: int | None) -> list[psutil.Process]:
    assert pid is not None
    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


async def wait_until(predicate: Callable[[], bool], timeout: float = 5.0) -> None:
    """Wait for a condition we can only observe by looking (a process appearing)."""
    async with asyncio.timeout(timeout):
        while not predicate():
            await asyncio.sleep(0.01)


@pytest.mark.parametrize("command", ["sleep 100", "while :; do :; done", "trap '' INT; sleep 100"])
async def test_persistent_shell_and_timeout(sbx: BwrapSandbox, command: str) -> None:
    await sbx.run("mkdir -p sub && cd sub && export KEPT=yes", 5)
    result = await sbx.run(command, 1)
    assert result.timed_out and result.exit_code is None and "timed out after 1s" in result.output
    after = await sbx.run("echo ok; pwd; echo $KEPT", 5)
    assert after.output == "ok\n/workspace/sub\nyes\n" and after.exit_code == 0


async def test_exit_then_next_command_works(sbx: BwrapSandbox) -> None:
    result = await sbx.run("exit 3", 5)
    assert result.exit_code == 3 and "shell exited" in result.output
    after = await sbx.run("pwd", 5)
    assert after.exit_code == 0 and after.output.startswith("/workspace\n")


async def test_output_cap(sbx: BwrapSandbox) -> None:
    result = await sbx.run("python3 -c \"print('y' * 5_000_000)\"", 20)
    assert result.exit_code == 0 and result.truncated and result.duration_s < 10
    assert len(result.output) < 10_100 and "bytes truncated ...]" in result.output


async def test_isolation(sbx: BwrapSandbox) -> None:
    assert (await sbx.run("id -u", 5)).output == "1000\n"
    assert (await sbx.run("grep CapEff /proc/self/status", 5)).output == "CapEff:\t0000000000000000\n"
    assert (await sbx.run("cat /etc/shadow", 5)).exit_code != 0
    assert (await sbx.run("ls /root", 5)).exit_code != 0
    assert (await sbx.run("ps -e --no-headers | wc -l", 5)).output == "3\n"  # bash, ps, wc
    env = (await sbx.run("env | sort | grep -v -e ^_= -e ^PWD= -e ^SHLVL=", 5)).output
    assert env == "HOME=/workspace\nLANG=C.UTF-8\nPATH=/usr/local/bin:/usr/bin:/bin\nTERM=dumb\n"


async def test_writes_outside_workspace_fail(sbx: BwrapSandbox) -> None:
    for target in ("/usr/x", "/etc/x", "/.prorl/x"):
        assert (await sbx.run(f"touch {target}", 5)).exit_code != 0
    assert (await sbx.run("touch /workspace/x /tmp/x", 5)).exit_code == 0


async def test_network(sbx: BwrapSandbox) -> None:
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        connect = f"python3 -c \"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=3)\""
        assert (await sbx.run(connect, 10)).exit_code != 0
        async with BwrapSandbox(SandboxSpec(network=True)) as networked:
            assert (await networked.run(connect, 10)).exit_code == 0


async def test_memory_limit(sbx: BwrapSandbox) -> None:
    result = await sbx.run("python3 -c 'bytearray(4 * 1024**3)'", 10)
    assert result.exit_code != 0 and "MemoryError" in result.output


async def test_files_roundtrip_and_escapes(sbx: BwrapSandbox) -> None:
    await sbx.write_file("dir/a.txt", b"hello\n")
    await sbx.write_file("/workspace/b.bin", bytes(range(256)))
    assert (await sbx.run("cat dir/a.txt && echo more >> dir/a.txt && touch dir/c", 5)).output == "hello\n"
    assert await sbx.read_file("/workspace/dir/a.txt") == b"hello\nmore\n"
    assert await sbx.read_file("b.bin") == bytes(range(256))
    await sbx.run("ln -s /etc/passwd out; ln -s dir inside", 5)
    assert await sbx.read_file("inside/a.txt") == b"hello\nmore\n"
    for path in ("../escape", "dir/../../escape", "/etc/passwd", "out"):
        with pytest.raises(ValueError, match="outside"):
            await sbx.read_file(path)
        with pytest.raises(ValueError, match="outside"):
            await sbx.write_file(path, b"x")


async def test_close_leaves_nothing(sbx: BwrapSandbox) -> None:
    background = int((await sbx.run("sleep 1000 & echo $!", 5)).output)
    processes = process_tree(sbx.pid)
    assert len(processes) >= 3 and background  # bwrap, bash, sleep
    dirs = [sbx.workspace, sbx._control]
    await sbx.close()
    await sbx.close()
    assert not [p for p in processes if p.is_running()]
    assert not [d for d in dirs if d is not None and d.exists()]
    with pytest.raises(SandboxError, match="closed"):
        await sbx.run("echo hi", 5)


async def test_cancelled_run_then_close(sbx: BwrapSandbox) -> None:
    task = asyncio.create_task(sbx.run("sleep 100", 60))
    await wait_until(lambda: any(p.name() == "sleep" for p in process_tree(sbx.pid)))
    processes = process_tree(sbx.pid)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await sbx.close()
    assert not [p for p in processes if p.is_running()]
    assert sbx.workspace is not None and not sbx.workspace.exists()


async def test_wall_clock_limit_kills_the_sandbox() -> None:
    sandbox = BwrapSandbox(SandboxSpec(limits=SandboxLimits(wall_clock_s=1)))
    async with sandbox:
        processes = process_tree(sandbox.pid)
        result = await sandbox.run("sleep 100", 30)
        assert result.exit_code is None and "wall-clock limit" in result.output and result.duration_s < 5
        assert not [p for p in processes if p.is_running()]
        with pytest.raises(SandboxError, match="wall-clock"):
            await sandbox.run("echo hi", 5)


async def test_failed_start_cleans_up() -> None:
    sandbox = BwrapSandbox(SPEC, bwrap="false")
    with pytest.raises(SandboxError, match="did not start"):
        await sandbox.start()
    assert sandbox.workspace is not None and not sandbox.workspace.exists()


def test_open_sandbox_registry() -> None:
    assert isinstance(open_sandbox("bwrap", SPEC), BwrapSandbox)
    with pytest.raises(ValueError, match=r"unknown sandbox backend 'docker'; known: bwrap"):
        open_sandbox("docker", SPEC)
