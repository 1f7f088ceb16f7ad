"""500 bubblewrap and 500 Apptainer sandboxes through every way a life can end — cancelled mid-start, mid-command,
mid-exec, mid-fork (bwrap), timed out, shell exited, wall clock — then nothing of theirs is left on the host.

"Left" means: a process (our descendants; for bwrap any process in one of their cgroups, whatever its uid; for
Apptainer any process of their instances, which Apptainer runs outside our process tree), a temp dir (here under
a temp root of this test's own), a cgroup directory, an Apptainer instance or its logs, a loop device holding the
SIF, or a mount on the host. The sandboxes' own mounts live in their private mount namespaces, which die with their
processes.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import subprocess
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import psutil
import pytest
from sandbox_helpers import reachable_temp_dir

from nemo_gym_prorl.contracts.sandbox import Sandbox
from nemo_gym_prorl.sandbox import BwrapSandbox, SandboxLimits, SandboxSpec
from nemo_gym_prorl.sandbox.apptainer import INSTANCE_PREFIX, ApptainerSandbox, _instance_logs, list_instances
from nemo_gym_prorl.sandbox.limits import own_cgroup_dirs

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

N_SANDBOXES = 500
CONCURRENCY = 8
SEED = 20261202
SPEC = SandboxSpec(limits=SandboxLimits(memory_mb=256, max_processes=32, wall_clock_s=30))


@pytest.fixture
def private_tmp(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    with reachable_temp_dir() as path:
        monkeypatch.setattr(tempfile, "tempdir", str(path))
        yield path


async def ok(sbx: Sandbox) -> None:
    async with sbx:
        assert (await sbx.run("echo hi", 10)).output == "hi\n"


async def timeout(sbx: Sandbox) -> None:
    async with sbx:
        assert (await sbx.run("sleep 30", 0.2)).timed_out
        assert (await sbx.exec(["sleep", "30"], 0.2)).timed_out


async def background(sbx: Sandbox) -> None:
    async with sbx:
        await sbx.run("sleep 300 & setsid sleep 300 & (trap '' HUP TERM; sleep 300) &", 10)
        await sbx.exec(["sh", "-c", "sleep 300 &"], 10)


async def shell_exits(sbx: Sandbox) -> None:
    async with sbx:
        await sbx.run("sleep 300 & exit 1", 10)
        assert (await sbx.run("echo again", 10)).output.startswith("again")


async def wall_clock(sbx: Sandbox) -> None:
    sbx.spec = SPEC.model_copy(update={"limits": SPEC.limits.model_copy(update={"wall_clock_s": 0.3})})
    async with sbx:
        await sbx.run("sleep 300", 10)


async def long_command(sbx: Sandbox) -> None:
    """Meant to be cancelled: mid-start, mid-command or mid-exec, depending on when the cancellation lands."""
    async with sbx:
        await sbx.write_file("f.txt", b"x")
        await sbx.exec(["sh", "-c", "sleep 300 & sleep 0.05"], 10)
        await sbx.run("sleep 300", 60)


async def forked(sbx: BwrapSandbox) -> None:
    async with sbx:
        await sbx.run("echo base > f.txt", 10)
        forks = await sbx.fork(2)
        try:
            await asyncio.gather(*(f.run("sleep 300 & cat f.txt", 10) for f in forks))
        finally:
            # close() goes on when its caller is cancelled, but a life that ends before its forks are gone
            # would leave them to the test's end (and its event loop's): wait for them whatever happens.
            closing = asyncio.gather(*(f.close() for f in forks))
            try:
                await asyncio.shield(closing)
            except asyncio.CancelledError:
                await closing
                raise


Life = Callable[[Sandbox], Awaitable[None]]
LIVES: list[tuple[Life, float]] = [
    (ok, 0.25),
    (timeout, 0.1),
    (background, 0.1),
    (shell_exits, 0.05),
    (wall_clock, 0.05),
    (long_command, 0.4),  # cancelled
    (forked, 0.05),  # half of them cancelled
]


async def live(sbx: Sandbox, life: Life, rng: random.Random) -> str:
    """One sandbox's life; `long_command` and every other `forked` are cancelled at a random moment."""
    task = asyncio.create_task(life(sbx))
    if life is long_command or (life is forked and rng.random() < 0.5):
        await asyncio.sleep(rng.uniform(0, 0.15))  # when to cancel: anywhere from before start to mid-command
        task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        return "cancelled"
    finally:
        await sbx.close()  # a no-op after `async with`; what a caller does when it never got that far
    return life.__name__


def our_processes(before: set[int]) -> list[str]:
    """Live descendants of this test process that were not there before the test, described for a failure."""
    left = []
    for process in psutil.Process().children(recursive=True):
        if process.pid not in before and _alive(process):
            with contextlib.suppress(psutil.Error, OSError):
                cgroups = Path(f"/proc/{process.pid}/cgroup").read_text().split()
                left.append(f"{process.pid} (parent {process.ppid()}): {process.cmdline()[:6]} {cgroups[:3]}")
    return left


def _alive(process: psutil.Process) -> bool:
    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def in_cgroups(names: set[str]) -> list[int]:
    """Host pids of any process (any uid) whose cgroup is one of `names`."""
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/cgroup") as f:
                paths = {line.rstrip("\n").rsplit("/", 1)[-1] for line in f}
        except OSError:
            continue
        if paths & names:
            found.append(int(entry.name))
    return found


async def live_all(make: Callable[[], Sandbox], lives: list[tuple[Life, float]]) -> list[Sandbox]:
    """N_SANDBOXES lives drawn from `lives`, CONCURRENCY at a time; returns the sandboxes."""
    rng = random.Random(SEED)
    drawn = rng.choices([life for life, _ in lives], weights=[w for _, w in lives], k=N_SANDBOXES)
    sandboxes: list[Sandbox] = []
    gate = asyncio.Semaphore(CONCURRENCY)

    async def one(life: Life, seed: int) -> str:
        async with gate:
            sbx = make()
            sandboxes.append(sbx)
            return await live(sbx, life, random.Random(seed))

    started = time.monotonic()
    outcomes = await asyncio.gather(*(one(life, rng.randrange(2**32)) for life in drawn))
    elapsed = time.monotonic() - started
    counts = {name: outcomes.count(name) for name in sorted(set(outcomes))}
    print(f"{N_SANDBOXES} sandboxes in {elapsed:.1f}s: {counts}")
    assert counts.get("cancelled", 0) >= N_SANDBOXES // 5 and counts.get("ok", 0) >= N_SANDBOXES // 10
    return sandboxes


async def test_500_bwrap_sandboxes_leave_nothing_behind(private_tmp: Path) -> None:
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    sandboxes = await live_all(lambda: BwrapSandbox(SPEC), LIVES)

    names = {s.temp_dir.name for s in sandboxes if isinstance(s, BwrapSandbox) and s.temp_dir is not None}
    assert len(names) >= N_SANDBOXES * 0.8  # most got far enough to create their temp dir
    assert our_processes(before) == []
    assert in_cgroups(names) == []
    assert sorted(p.name for p in private_tmp.iterdir()) == []
    assert [d for parent in own_cgroup_dirs().values() for d in os.listdir(parent) if d in names] == []
    with open("/proc/self/mountinfo") as f:
        assert [line for line in f if str(private_tmp) in line] == []


def loop_devices_of(path: Path) -> list[str]:
    listing = subprocess.run(["losetup", "--list", "--noheadings", "--output", "NAME,BACK-FILE"], capture_output=True,
                             text=True, check=True).stdout  # fmt: skip
    return [line for line in listing.splitlines() if str(path) in line]


async def test_500_apptainer_sandboxes_leave_nothing_behind(private_tmp: Path, sif: Path) -> None:
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    loops_before = loop_devices_of(sif)
    spec = SPEC.model_copy(update={"image": str(sif)})
    sandboxes = await live_all(lambda: ApptainerSandbox(spec), [(life, w) for life, w in LIVES if life is not forked])

    ours = f"{INSTANCE_PREFIX}{os.getpid()}-"
    names = {s.name for s in sandboxes if isinstance(s, ApptainerSandbox)}
    assert len(names) == N_SANDBOXES and all(name.startswith(ours) for name in names)
    assert our_processes(before) == []
    assert [name for name in list_instances() if name.startswith(ours)] == []
    instance_processes = []
    for process in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            if _alive(process) and any(ours in arg for arg in process.cmdline()):
                instance_processes.append(process)
    assert instance_processes == []
    assert _instance_logs(f"{ours}*") == []
    assert sorted(p.name for p in private_tmp.iterdir()) == []
    assert loop_devices_of(sif) == loops_before
    with open("/proc/self/mountinfo") as f:
        assert [line for line in f if str(private_tmp) in line or ours in line] == []
