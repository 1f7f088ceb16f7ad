"""Nothing of a SWE rollout outlives it: after a finished, a failed and a cancelled one (init, a group's forks, the
grading sandbox), no sandbox process, mount, loop device, cgroup or temp dir is left. Real bubblewrap on the
default image, real git and pytest, a shipped offline instance.
"""

from __future__ import annotations

import asyncio
import contextlib
import glob
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from sandbox_helpers import reachable_temp_dir, wait_until

from nemo_gym_prorl.contracts.task import TaskInstance, load_task
from nemo_gym_prorl.envs import make_environment
from nemo_gym_prorl.envs.dataset import load_instances
from nemo_gym_prorl.envs.swe.env import SweEnvironment
from nemo_gym_prorl.envs.swe.stage import StagingError
from nemo_gym_prorl.sandbox import disk
from nemo_gym_prorl.tool_calls import ToolCall

HANGING = "diff --git a/conftest.py b/conftest.py\nnew file mode 100644\n--- /dev/null\n+++ b/conftest.py\n" \
          "@@ -0,0 +1,2 @@\n+while True:\n+    pass\n"  # fmt: skip


class Traces:
    """What sandboxes made under a private temp dir: the dirs (their names are their cgroups' too), and what of them,
    their mounts, loop devices and this process's children is still there."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.made: list[str] = []
        self.children_before = {p.pid for p in psutil.Process().children(recursive=True)}

    def left(self) -> dict[str, list[str]]:
        mounts = [line for line in Path("/proc/self/mountinfo").read_text().splitlines() if str(self.root) in line]
        loops = [f for f in glob.glob("/sys/block/loop*/loop/backing_file") if str(self.root) in _read(f)]
        cgroups = [d for name in self.made for d in glob.glob(f"/sys/fs/cgroup/*/{os.path.basename(name)}")]
        children = [p for p in psutil.Process().children(recursive=True) if p.pid not in self.children_before]
        alive = [f"{p.pid} {p.name()}" for p in children if _alive(p)]
        left = {"temp dirs": sorted(os.listdir(self.root)), "mounts": mounts, "loop devices": loops,
                "cgroups": cgroups, "processes": alive}  # fmt: skip
        return {kind: items for kind, items in left.items() if items}


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


def _alive(process: psutil.Process) -> bool:
    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.fixture
def traces(monkeypatch: pytest.MonkeyPatch) -> Iterator[Traces]:
    with reachable_temp_dir() as root:
        monkeypatch.setattr(tempfile, "tempdir", str(root))
        traced = Traces(root)
        mkdtemp = tempfile.mkdtemp

        def recording_mkdtemp(*args: object, **kwargs: object) -> str:
            made = mkdtemp(*args, **kwargs)  # type: ignore[arg-type]
            traced.made.append(made)
            return made

        monkeypatch.setattr(tempfile, "mkdtemp", recording_mkdtemp)
        yield traced


@pytest.fixture(scope="module")
def env(rootfs: Path) -> SweEnvironment:
    environment = make_environment(load_task("swe/offline"), "bwrap")
    assert isinstance(environment, SweEnvironment)
    return environment


@pytest.fixture(scope="module")
def instance(rootfs: Path) -> TaskInstance:
    return load_instances(load_task("swe/offline").dataset)[0]


async def nothing_left(traces: Traces) -> None:
    """Everything gone (a disk's loop device is released by a thread of its own: looked at until gone, or 15 s)."""
    with contextlib.suppress(TimeoutError):
        await wait_until(lambda: not traces.left(), timeout=15)
    assert traces.left() == {} and traces.made


async def test_a_finished_rollout_leaves_nothing(env: SweEnvironment, instance: TaskInstance, traces: Traces) -> None:
    episodes = await env.fork(await env.init(instance), [env, env])  # a group: one staging, two forks
    try:
        await env.call_tool(episodes[0], ToolCall(name="bash", arguments={"command": "sleep 1000 &"}))
        await env.call_tool(episodes[1], ToolCall(name="python", arguments={"code": "x = 1"}))
        submission = await env.collect(episodes[0])
        live = traces.left().keys()  # what is looked for is there while the rollout runs
        assert {"temp dirs", "processes"} | ({"mounts", "cgroups"} if disk.available() else set()) <= live
    finally:
        await asyncio.gather(*(env.close(e) for e in episodes))
    assert (await env.grade(instance, {"patch": instance.data["patch"]})).reward == 1.0
    assert (await env.grade(instance, submission)).reward == 0.0
    await nothing_left(traces)


async def test_a_failed_rollout_leaves_nothing(env: SweEnvironment, instance: TaskInstance, traces: Traces) -> None:
    broken = TaskInstance(instance_id=instance.instance_id, data=instance.data | {"base_patch": "not a patch\n"})
    with pytest.raises(StagingError, match="staging the repository failed"):
        await env.init(broken)
    env.settings.test_timeout_s = 3
    try:
        evaluation = await env.grade(instance, {"patch": HANGING})
    finally:
        env.settings.test_timeout_s = 300
    assert "time limit" in evaluation.details["reason"]
    await nothing_left(traces)


async def test_a_cancelled_rollout_leaves_nothing(env: SweEnvironment, instance: TaskInstance, traces: Traces) -> None:
    def sandbox_running() -> bool:
        return any(p.name() == "bwrap" for p in psutil.Process().children(recursive=True) if _alive(p))

    init = asyncio.create_task(env.init(instance))  # cancelled while its sandbox stages the repository
    await wait_until(sandbox_running, timeout=60)
    init.cancel()
    with pytest.raises(asyncio.CancelledError):
        await init
    group = [asyncio.create_task(env.init(instance)) for _ in range(3)]  # one member cancelled while they form
    await wait_until(sandbox_running, timeout=60)
    group[1].cancel()
    done = await asyncio.gather(*group, return_exceptions=True)
    await asyncio.gather(*(env.close(e) for e in done if not isinstance(e, BaseException)))

    env.settings.test_timeout_s = 300
    grading = asyncio.create_task(env.grade(instance, {"patch": HANGING}))  # cancelled while the tests hang
    await wait_until(lambda: any("pytest" in " ".join(_cmdline(p)) for p in psutil.Process().children(recursive=True)),
                     timeout=60)  # fmt: skip
    grading.cancel()
    with pytest.raises(asyncio.CancelledError):
        await grading
    await nothing_left(traces)


def _cmdline(process: psutil.Process) -> list[str]:
    try:
        return process.cmdline()
    except psutil.Error:
        return []
