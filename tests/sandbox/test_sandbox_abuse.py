"""Escape and abuse attempts against every isolating backend in the registry, each contained and reported.

The backends are read from the registry when this module is collected, so a backend registered there (Apptainer,
say) is tested here with no change to this file, and is never skipped: a backend that cannot run these cases
fails them. The `gym:*` adapters are not isolating backends of ours (they enforce whatever the NeMo Gym provider
behind them does; Gym's `local` enforces nothing) and are left out.

The host finds a sandbox's processes by its pid namespace (every backend gives a sandbox one), so it can count
them and check that none outlives the sandbox, whatever the backend.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import secrets
import socket
import subprocess
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

import nemo_gym_prorl.sandbox as sandbox_registry
from nemo_gym_prorl.contracts.sandbox import PathOutsideWorkspaceError
from nemo_gym_prorl.sandbox import Sandbox, SandboxError, SandboxLimits, SandboxSpec, open_sandbox

BACKENDS = sorted(sandbox_registry.backends())
MAX_OUTPUT = 10_000
SPEC = SandboxSpec(limits=SandboxLimits(memory_mb=256, max_processes=64, max_output_bytes=MAX_OUTPUT, wall_clock_s=120))
REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(60)  # a case that hangs fails on its own instead of stalling the suite


@pytest.fixture(params=BACKENDS)
async def sbx(request: pytest.FixtureRequest) -> AsyncIterator[Sandbox]:
    if request.param == "apptainer":
        request.getfixturevalue("sif")  # Apptainer installed and the default image built, whatever runs first
    async with open_sandbox(request.param, SPEC) as sandbox:
        yield sandbox


async def pid_namespace(sbx: Sandbox) -> str:
    """The sandbox's pid namespace, as the host names it: every process of the sandbox is in it."""
    namespace = (await sbx.run("readlink /proc/self/ns/pid", 5)).output.strip()
    assert namespace.startswith("pid:[") and namespace != os.readlink("/proc/self/ns/pid")
    return namespace


def members(namespace: str) -> list[int]:
    """Host pids of the live (not zombie) processes in the pid namespace `namespace`."""
    found = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if os.readlink(f"/proc/{entry.name}/ns/pid") == namespace and not _zombie(entry.name):
                    found.append(int(entry.name))
    return found


def _zombie(pid: str) -> bool:
    with open(f"/proc/{pid}/stat", "rb") as f:
        return f.read().rsplit(b")", 1)[1].split()[0] == b"Z"


async def appear(predicate: Callable[[], bool], timeout: float = 10.0) -> None:
    """Wait for processes to show up, which the host can only observe by looking."""
    async with asyncio.timeout(timeout):
        while not predicate():
            await asyncio.sleep(0.01)


async def test_network_off_cannot_reach_a_host_loopback_port(sbx: Sandbox) -> None:
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        server.setblocking(False)
        port = server.getsockname()[1]
        result = await sbx.run(f"timeout 5 bash -c 'echo hi > /dev/tcp/127.0.0.1/{port}' && echo CONNECTED", 15)
        assert result.exit_code != 0 and "CONNECTED" not in result.output, result.output
        with pytest.raises(BlockingIOError):
            server.accept()


async def test_writes_outside_the_workspace_fail(sbx: Sandbox) -> None:
    name = f"prorl-abuse-{secrets.token_hex(4)}"
    targets = [f"/usr/{name}", f"/etc/{name}", f"/{name}", f"/root/{name}", f"/home/{name}", f"{REPO}/{name}"]
    for target in targets:
        result = await sbx.run(f"echo x > {target}", 5)
        assert result.exit_code != 0, target
        assert not os.path.exists(target), target
    for path in ("/etc/passwd", "../outside", f"{REPO}/setup.cfg"):
        with pytest.raises(PathOutsideWorkspaceError):
            await sbx.write_file(path, b"x")
    assert (await sbx.run(f"echo x > /workspace/{name} && cat /workspace/{name}", 5)).output == "x\n"


async def test_host_homes_secrets_and_checkout_are_not_readable(sbx: Sandbox) -> None:
    host_homes = {e.name for d in ("/root", "/home") if os.path.isdir(d) for e in os.scandir(d)}
    listing = (await sbx.run("ls -A /root /home 2>/dev/null", 5)).output.split()
    assert not host_homes & set(listing), listing
    shadow = (await sbx.run("cat /etc/shadow /etc/gshadow 2>/dev/null", 5)).output
    assert not re.search(r"^[a-z_][\w.-]*:[^:\n]*:", shadow, re.MULTILINE), "shadow entries are readable"
    keys = (await sbx.run("cat /etc/ssh/ssh_host_*_key 2>&1", 5)).output
    assert "PRIVATE KEY" not in keys
    checkout = await sbx.run(f"cat {REPO}/setup.cfg {REPO}/README.md", 5)
    assert checkout.exit_code != 0 and "[metadata]" not in checkout.output
    ours = await sbx.run(f"cat /proc/{os.getpid()}/cmdline 2>/dev/null | tr '\\0' ' '", 5)
    assert "pytest" not in ours.output  # the host's /proc is not there
    for path in ("/etc/shadow", f"{REPO}/setup.cfg", str(Path.home() / ".bashrc")):
        with pytest.raises(PathOutsideWorkspaceError):
            await sbx.read_file(path)


async def test_fork_bomb_is_contained(sbx: Sandbox) -> None:
    namespace = await pid_namespace(sbx)
    started = time.monotonic()
    await sbx.run(":(){ :|:& };:", 5)
    await appear(lambda: len(members(namespace)) >= SPEC.limits.max_processes // 2)
    samples = []
    for _ in range(20):  # watch the bomb push against the limit for a while
        samples.append(len(members(namespace)))
        await asyncio.sleep(0.05)
    assert max(samples) <= SPEC.limits.max_processes, samples
    assert subprocess.run(["true"]).returncode == 0  # the host can still start processes
    try:
        after = await sbx.run("echo alive", 20)  # a builtin: needs no new process
        assert "alive" in after.output
    except SandboxError:
        pass  # reported dead is also contained
    await sbx.close()
    assert not members(namespace) and time.monotonic() - started < 45


async def test_memory_bomb_is_contained(sbx: Sandbox) -> None:
    big = await sbx.run("python3 -c 'bytearray(8 * 2**30)'", 20)
    assert big.exit_code != 0 and "MemoryError" in big.output
    growing = await sbx.run("python3 -c 'x = []\nwhile True: x.append(bytearray(2**24))'; echo status $?", 30)
    assert growing.exit_code == 0 and "status 0" not in growing.output and growing.duration_s < 20
    assert (await sbx.run("echo alive", 5)).output == "alive\n"


async def test_a_gigabyte_of_output_is_capped_and_returns_promptly(sbx: Sandbox) -> None:
    result = await sbx.run("head -c 1000000000 /dev/zero | tr '\\0' x", 60)
    assert result.truncated and result.duration_s < 15
    assert len(result.output) < MAX_OUTPUT + 300 and result.output.startswith("x" * 100)
    assert (await sbx.run("echo alive", 5)).output == "alive\n"


async def test_infinite_loop_is_interrupted_and_the_session_survives(sbx: Sandbox) -> None:
    await sbx.run("cd /tmp; export KEPT=yes", 5)
    result = await sbx.run("while :; do :; done", 1)
    assert result.timed_out and result.exit_code is None and result.duration_s < 5
    assert (await sbx.run("echo $PWD $KEPT", 5)).output == "/tmp yes\n"


PTRACE = """
import ctypes, os, subprocess
libc = ctypes.CDLL(None, use_errno=True)
victim = subprocess.Popen(["sleep", "30"])
ret = libc.ptrace(16, victim.pid, 0, 0)  # PTRACE_ATTACH to a process of the same user
print("attach", "allowed" if ret == 0 else os.strerror(ctypes.get_errno()))
victim.kill()
"""


async def test_ptrace_mount_and_unshare_are_denied(sbx: Sandbox) -> None:
    await sbx.write_file("ptrace.py", PTRACE.encode())
    assert (await sbx.run("python3 ptrace.py", 10)).output == "attach Operation not permitted\n"
    for command in (
        "mount -t tmpfs none /tmp",
        "mount --bind /workspace /tmp",
        "umount /proc",
        "unshare --user true",
        "unshare --user --map-root-user --mount true",
        "unshare --net true",
    ):
        result = await sbx.run(command, 5)
        assert result.exit_code != 0, command
    assert "NoNewPrivs:\t1" in (await sbx.run("cat /proc/self/status", 5)).output


async def test_background_processes_are_gone_after_close(sbx: Sandbox) -> None:
    namespace = await pid_namespace(sbx)
    await sbx.run("sleep 1000 & setsid sleep 1000 & nohup sleep 1000 > /dev/null 2>&1 &", 5)
    await sbx.run("(trap '' HUP TERM INT; exec sleep 1000) &", 5)
    await appear(lambda: len(members(namespace)) >= 5)  # the shell and four sleeps
    assert (await sbx.exec(["sh", "-c", "sleep 1000 & exit 0"], 5)).exit_code == 0
    await appear(lambda: len(members(namespace)) >= 6)
    await sbx.close()
    assert not members(namespace)
