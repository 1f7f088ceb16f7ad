"""Each bubblewrap sandbox's disk of its own (`limits.disk_mb`), mostly made ahead of need (`disk.DiskSpares`): a
spare is sized by the sandbox's limits and serves one sandbox only (nothing of one reaches the next); every disk,
mount and loop device is gone when its sandbox ends and when the service ends; when the service is SIGKILLed, its
spares go with it and the orphan sweep removes the running sandbox's disk. Root only (as CI runs): disks need loop
devices."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from sandbox_helpers import assert_nothing_left, loop_devices_under, mounts_under, reachable_temp_dir, wait_until

from nemo_gym_prorl.sandbox import SandboxLimits, SandboxSpec
from nemo_gym_prorl.sandbox.bwrap import BwrapSandbox, sweep_orphans
from nemo_gym_prorl.sandbox.disk import DiskSpares

pytestmark = pytest.mark.timeout(120)

LIMITS = SandboxLimits(memory_mb=256, max_processes=32, wall_clock_s=60)


@pytest.fixture
def root() -> Iterator[Path]:
    with reachable_temp_dir() as path:
        yield path


@pytest.fixture
async def spares(root: Path, monkeypatch: pytest.MonkeyPatch) -> DiskSpares:
    """The disks made ahead for bwrap sandboxes, fresh, their images in `root` (a service's whose temp dir it is)."""
    monkeypatch.setattr(tempfile, "tempdir", str(root))
    made = DiskSpares()
    monkeypatch.setattr("nemo_gym_prorl.sandbox.bwrap._DISK_SPARES", made)
    yield made
    made.close()
    await assert_nothing_left(root)


async def ready(spares: DiskSpares, size_mb: int, count: int) -> None:
    await wait_until(lambda: len(spares._spares.get((size_mb, 65534), [])) >= count)


async def test_a_spare_disk_serves_one_sandbox_and_is_sized_by_its_limits(spares: DiskSpares) -> None:
    limits = LIMITS.model_copy(update={"disk_mb": 64})
    async with BwrapSandbox(SandboxSpec(limits=limits)) as first:
        await first.run("echo secret > /workspace/kept; echo secret > /tmp/kept", 10)
    await ready(spares, 64, 2)
    for size in (64, 48):  # a spare of its size, then a size none was made for yet
        async with BwrapSandbox(SandboxSpec(limits=limits.model_copy(update={"disk_mb": size}))) as sandbox:
            found = await sandbox.run("find /workspace /tmp -mindepth 1 | wc -l; df -m --output=size /workspace", 10)
            entries, _, total_mb = found.output.split()
            assert entries == "0", found.output  # nothing of the sandbox before
            assert size - 8 <= int(total_mb) <= size, found.output  # ext4's own metadata aside
            full = await sandbox.run(f"head -c {size + 8}M /dev/zero > /workspace/f; echo $?", 30)
            assert "No space left on device" in full.output, full.output


async def test_closing_the_spares_removes_them_and_a_later_sandbox_makes_them_again(
    spares: DiskSpares, root: Path
) -> None:
    async with BwrapSandbox(SandboxSpec(limits=LIMITS)):
        pass
    await ready(spares, 4096, 2)
    await wait_until(lambda: len(loop_devices_under(root)) == 2)  # the sandbox's disk goes in a thread of its own
    assert mounts_under(root) == []  # the spares are detached: mounted nowhere
    spares.close()  # as at the service's exit
    await wait_until(lambda: not loop_devices_under(root))
    async with BwrapSandbox(SandboxSpec(limits=LIMITS)) as sandbox:
        assert (await sandbox.run("echo hi > /workspace/f && cat /workspace/f", 10)).output == "hi\n"
    await ready(spares, 4096, 2)


SERVICE = """
import asyncio, sys, time
from nemo_gym_prorl.sandbox import SandboxLimits, SandboxSpec
from nemo_gym_prorl.sandbox.bwrap import BwrapSandbox, _DISK_SPARES

async def main():
    spec = SandboxSpec(limits=SandboxLimits(memory_mb=256))
    for _ in range(2):
        async with BwrapSandbox(spec) as sandbox:
            await sandbox.run("head -c 1M /dev/zero > /workspace/f", 10)
    sandbox = BwrapSandbox(spec)
    await sandbox.start()
    await sandbox.run("head -c 1M /dev/zero > /workspace/f", 10)
    while len(_DISK_SPARES._spares[(4096, 65534)]) < 2:
        time.sleep(0.01)
    print("ready", flush=True)
    if sys.argv[1] == "wait":
        await asyncio.sleep(1000)

asyncio.run(main())
"""


def run_service(root: Path, mode: str) -> subprocess.Popen[bytes]:
    env = {**os.environ, "TMPDIR": str(root)}
    return subprocess.Popen([sys.executable, "-c", SERVICE, mode], stdout=subprocess.PIPE, env=env)


async def test_a_service_that_exits_leaves_no_disk_mount_or_loop_device(root: Path) -> None:
    """It exits with spares made and a sandbox it never closed: the spares go with it; the sandbox's temp dir and
    its disk are what any process that dies without closing its sandboxes leaves, for the orphan sweep."""
    service = run_service(root, "exit")
    stdout, _ = await asyncio.to_thread(service.communicate, timeout=60)
    assert service.returncode == 0 and stdout == b"ready\n"
    await wait_until(lambda: not loop_devices_under(root))  # the sandbox's disk was only mounted inside it
    assert mounts_under(root) == []
    assert len(sweep_orphans(str(root))) == 1
    await assert_nothing_left(root)


async def test_a_killed_service_leaves_nothing_after_the_orphan_sweep(root: Path) -> None:
    service = run_service(root, "wait")
    try:
        assert service.stdout is not None
        assert (await asyncio.to_thread(service.stdout.readline)) == b"ready\n"
        assert len(loop_devices_under(root)) == 3  # the running sandbox's disk and two spares
        await wait_until(lambda: mounts_under(root) == [])  # spares are detached, the sandbox's only bound inside
    finally:
        service.send_signal(signal.SIGKILL)
        service.wait()
    await wait_until(lambda: not loop_devices_under(root))  # the spares went with the process, the disk with bwrap
    assert mounts_under(root) == []
    assert len(sweep_orphans(str(root))) == 1  # the sandbox's temp dir
    await assert_nothing_left(root)


async def test_a_running_sandbox_keeps_its_disk_out_of_the_hosts_mount_table(spares: DiskSpares, root: Path) -> None:
    """Every new mount namespace copies the host's mounts: a disk stays attached only while its sandbox's bwrap
    starts (also a new shell's) or hands the workspace to forks, and host-side file I/O reaches it all the same."""
    async with BwrapSandbox(SandboxSpec(limits=LIMITS)) as sandbox:
        await wait_until(lambda: mounts_under(root) == [])
        await sandbox.write_file("a/b/c.txt", b"hello")
        restarted = await sandbox.run("cat /workspace/a/b/c.txt; exit", 10)
        assert restarted.output.startswith("hello"), restarted.output
        assert (await sandbox.run("cat a/b/c.txt; echo x >> a/b/c.txt", 10)).output.startswith("hello")
        await wait_until(lambda: mounts_under(root) == [])  # attached for the new shell's bwrap, detached again
        assert await sandbox.read_file("/workspace/a/b/c.txt") == b"hellox\n"
        forks = await sandbox.fork(2, close=True)
    try:
        for fork in forks:
            assert (await fork.run("cat a/b/c.txt", 10)).output == "hellox\n"
    finally:
        for fork in forks:
            await fork.close()
