"""An Apptainer sandbox's disk of its own (`limits.disk_mb`) is in the host's mount table only while its instance
starts: every new mount namespace on the host (each bwrap start, any other process's) copies the host's mounts, so
a disk per live sandbox left attached slows them all. Once the instance runs, its binds hold the disk, processes
that enter it need no host path of it, and host-side file I/O reaches it through this process's fd of it. Root only
(as CI runs): disks need loop devices."""

from __future__ import annotations

import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from sandbox_helpers import assert_nothing_left, loop_devices_under, mounts_under, reachable_temp_dir, wait_until

from nemo_gym_prorl.contracts.sandbox import BindMount
from nemo_gym_prorl.sandbox import SandboxError, SandboxLimits, SandboxSpec
from nemo_gym_prorl.sandbox.apptainer import ApptainerSandbox
from nemo_gym_prorl.sandbox.disk import SandboxDisk

pytestmark = pytest.mark.timeout(420)  # the module's first test may build the session's image (~2 min, more on a busy machine)

LIMITS = SandboxLimits(memory_mb=256, max_processes=32, wall_clock_s=60, disk_mb=48)


@pytest.fixture
def root(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """The service's temp dir: the sandbox's temp dir, and so its disk's image, is made in it."""
    with reachable_temp_dir() as path:
        monkeypatch.setattr(tempfile, "tempdir", str(path))
        yield path


async def test_a_running_instance_keeps_its_disk_out_of_the_hosts_mount_table(root: Path, sif: Path) -> None:
    async with ApptainerSandbox(SandboxSpec(image=str(sif), limits=LIMITS)) as sandbox:
        await wait_until(lambda: mounts_under(root) == [])
        assert len(loop_devices_under(root)) == 1  # the disk is there, mounted only inside the instance
        await sandbox.write_file("a/b.txt", b"hello")
        restarted = await sandbox.run("cat /workspace/a/b.txt; exit", 10)  # the next command gets a new shell
        assert restarted.output.startswith("hello"), restarted.output
        assert (await sandbox.run("cat a/b.txt; echo x >> a/b.txt", 10)).output.startswith("hello")
        assert (await sandbox.exec(["cat", "/workspace/a/b.txt"], 10)).output == "hellox\n"
        assert await sandbox.read_file("/workspace/a/b.txt") == b"hellox\n"
        assert mounts_under(root) == []  # neither a new shell nor an exec needed it attached again
        # /tmp, /dev/shm and the workspace are still the one disk of limits.disk_mb: full is ENOSPC inside
        full = await sandbox.run("head -c 64M /dev/zero > /tmp/f; stat -f -c %i /tmp /workspace /dev/shm", 30)
        assert "No space left on device" in full.output, full.output
        assert len(set(full.output.split()[-3:])) == 1, full.output  # one filesystem id
        assert await sandbox.read_file("a/b.txt") == b"hellox\n"
    await assert_nothing_left(root)


async def test_a_start_that_fails_with_its_disk_attached_leaves_nothing(root: Path, sif: Path) -> None:
    missing = BindMount(source=str(root / "missing"), target="/data")  # Apptainer refuses to start the instance
    with pytest.raises(SandboxError, match="apptainer instance start failed"):
        async with ApptainerSandbox(SandboxSpec(image=str(sif), limits=LIMITS, binds=[missing])):
            pass
    await assert_nothing_left(root)


async def test_instances_start_beside_hundreds_of_disks_and_share_their_image_loop_device(root: Path, sif: Path) -> None:
    """With many bwrap sandboxes on a node, their disks hold the lowest loop devices (one each). Apptainer looked
    only at the first 256 and mounted each instance's SIF on a device of its own: past ~256 sandboxes every
    Apptainer start failed ("no loop devices available"). Our install shares one device per image and looks
    further (`scripts/install_apptainer.sh`)."""
    held = [SandboxDisk.make(root, 8, None) for _ in range(300)]  # as 300 bwrap sandboxes' disks hold them
    try:
        spec = SandboxSpec(image=str(sif), limits=LIMITS.model_copy(update={"disk_mb": None}))
        async with ApptainerSandbox(spec) as first, ApptainerSandbox(spec) as second:
            for sandbox in (first, second):
                assert (await sandbox.run("echo up", 10)).output == "up\n"
            assert len(loop_devices_backed_by(sif)) == 1
    finally:
        for disk in held:
            disk.unmount()
    await assert_nothing_left(root)


def loop_devices_backed_by(image: Path) -> list[str]:
    listing = subprocess.run(["losetup", "--list", "--noheadings", "--output", "BACK-FILE"], capture_output=True,
                             text=True, check=True).stdout  # fmt: skip
    return [line for line in listing.splitlines() if line.strip() == str(image.resolve())]
