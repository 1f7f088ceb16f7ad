"""What the sandbox and shell tests use on the host: temp dirs a sandbox can reach, process trees, an Apptainer
sandbox's processes, processes by name, waiting to see one, the mounts and loop devices under a dir."""

from __future__ import annotations

import asyncio
import contextlib
import glob
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil

from nemo_gym_prorl.sandbox.bwrap import TEMP_PREFIX


@contextlib.contextmanager
def reachable_temp_dir(mode: int = 0o755) -> Iterator[Path]:
    """A temp dir the sandboxes' host uid can reach (with `mode` 0o777 also write to: pytest's tmp_path lives under a
    0700 dir), removed afterwards."""
    path = Path(tempfile.mkdtemp(prefix="prorl-test-"))
    path.chmod(mode)
    try:
        yield path
    finally:
        shutil.rmtree(path)


def process_tree(pid: int | None) -> list[psutil.Process]:
    assert pid is not None
    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


def apptainer_processes(sandbox: Any) -> list[psutil.Process]:
    """Every host process of an `ApptainerSandbox`: Apptainer's monitor, the shell's Apptainer parent and what runs
    under it, and whatever lives in the instance's pid namespace (processes that entered it are not the init's
    children)."""
    init = psutil.Process(sandbox.instance_pid)
    namespace = os.readlink(f"/proc/{init.pid}/ns/pid")
    inside = []
    for process in psutil.process_iter():
        with contextlib.suppress(OSError):
            if os.readlink(f"/proc/{process.pid}/ns/pid") == namespace:
                inside.append(process)
    return [init.parent(), *process_tree(sandbox.pid), *inside]


def alive(processes: list[psutil.Process]) -> list[psutil.Process]:
    """Those of `processes` still running (not exited, not a zombie waiting to be reaped)."""
    running = []
    for process in processes:
        with contextlib.suppress(psutil.NoSuchProcess):
            if process.is_running() and process.status() != psutil.STATUS_ZOMBIE:
                running.append(process)
    return running


def processes_named(name: str) -> list[psutil.Process]:
    """Processes whose argv[0] is `name`."""
    found = []
    for process in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            if process.cmdline()[:1] == [name]:
                found.append(process)
    return found


async def wait_until(predicate: Callable[[], bool], timeout: float = 10.0) -> None:
    """Wait for a condition we can only observe by looking (a process appearing)."""
    async with asyncio.timeout(timeout):
        while not predicate():
            await asyncio.sleep(0.01)


def mounts_under(root: Path) -> list[str]:
    """This process's mountinfo lines that name `root` (mounts at or below it)."""
    return [line for line in Path("/proc/self/mountinfo").read_text().splitlines() if str(root) in line]


def loop_devices_under(root: Path) -> list[str]:
    """Loop devices whose backing file is (or was, deleted) below `root`."""
    listing = subprocess.run(["losetup", "--list", "--noheadings", "--output", "BACK-FILE"], capture_output=True,
                             text=True, check=True).stdout  # fmt: skip
    return [line for line in listing.splitlines() if str(root) in line]


async def assert_nothing_left(root: Path) -> None:
    """No dir, mount or loop device of a sandbox below `root` (a disk's loop device goes in a thread of the closer:
    looked at until gone)."""
    assert sorted(p.name for p in root.iterdir()) == []
    assert mounts_under(root) == []
    await wait_until(lambda: not loop_devices_under(root))


def sandboxes_left() -> list[psutil.Process]:
    """This process's bubblewrap sandboxes (bwrap and the setpriv/prlimit it execs), however deep."""
    return [p for p in psutil.Process(os.getpid()).children(recursive=True) if p.name() in ("bwrap", "setpriv", "prlimit")]


def sandboxes_under(pid: int) -> list[psutil.Process]:
    with contextlib.suppress(psutil.Error):
        return [p for p in psutil.Process(pid).children(recursive=True) if p.name() == "bwrap"]
    return []


def sandbox_dirs_of(pid: int) -> list[str]:
    """The temp dirs of the bwrap sandboxes process `pid` owns."""
    return [d for d in glob.glob(os.path.join(tempfile.gettempdir(), TEMP_PREFIX + "*")) if sandbox_owner(d) == pid]


def sandbox_owner(root: str) -> int | None:
    """The pid a bubblewrap sandbox's temp dir names as its owner."""
    try:
        return int(Path(root, ".owner").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
