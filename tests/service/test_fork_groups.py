"""GRPO group forking ("one init, n forks", pipeline.fork_groups): the same trajectories as one init per sample, one
init per group, members cancelled one at a time (in the group's init and mid-run), a failed init or fork failing the
whole group, and no sandbox, process or temp dir left whatever happened. Real bwrap sandboxes throughout; the
service test runs the stand-in model server over HTTP, the pipeline tests the scripted in-process model."""

from __future__ import annotations

import asyncio
import tempfile
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
from sandbox_helpers import reachable_temp_dir, sandboxes_left
from scripted_model import BlockingModel, ScriptedModel, config, rollout
from service_helpers import comparable
from standin_helpers import ROW, STAGED_SCRIPT, running_standin

from nemo_gym_prorl.contracts.job import JobRequest
from nemo_gym_prorl.contracts.task import load_task
from nemo_gym_prorl.contracts.trajectory import Trajectory
from nemo_gym_prorl.envs.base import Episode
from nemo_gym_prorl.envs.math.env import MathEnvironment
from nemo_gym_prorl.launch.runtime import ModelConfig, ServiceConfig, ServiceSettings
from nemo_gym_prorl.launch.serve import RunningService, run_service
from nemo_gym_prorl.models.tokenizer import Tokenizer
from nemo_gym_prorl.service.client import RolloutClient
from nemo_gym_prorl.service.pipeline import Rollout, RolloutPipeline, StageConfig


@pytest.fixture
def private_tmp(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """This test's sandboxes put their temp dirs (workspaces, fork snapshots) here: what they leave is seen."""
    with reachable_temp_dir() as path:
        monkeypatch.setattr(tempfile, "tempdir", str(path))
        yield path


def left_in(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir())


@pytest.fixture
def task():
    return load_task("math/arithmetic").model_copy(update={"max_turns": 2})


class GatedInitEnvironment(MathEnvironment):
    """Math whose staging waits for the test to open a gate (after saying it began), or fails when told to."""

    def __init__(self, *args, fail: bool = False, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.fail = fail
        self.staging, self.gate = asyncio.Event(), asyncio.Event()
        self.inits = 0

    async def stage(self, episode: Episode) -> None:
        self.inits += 1
        await super().stage(episode)
        self.staging.set()
        await self.gate.wait()
        if self.fail:
            raise RuntimeError("the repository could not be staged")


class ClosedAfterInitEnvironment(MathEnvironment):
    """An init whose sandbox is gone by the time it is forked (as when it dies): the fork fails for real."""

    async def init(self, instance):  # type: ignore[no-untyped-def]
        episode = await super().init(instance)
        await episode.sandbox.close()
        return episode


class CountingBlockingModel(BlockingModel):
    """Holds every generation until released, and counts the generations waiting."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        super().__init__(tokenizer)
        self.waiting = 0

    async def __call__(self, path: str, body: dict) -> dict:
        self.waiting += 1
        return await super().__call__(path, body)


def forking(**kw):  # type: ignore[no-untyped-def]
    return config(fork_groups=True, **kw)


def started_group(pipeline: RolloutPipeline, env: MathEnvironment, models: list) -> list[Rollout]:
    """A group of one rollout per model, submitted as the samples of one job are."""
    members = [rollout(env, model) for model in models]
    pipeline.submit(members, group=True)
    return members


async def group_results(env: MathEnvironment, tokenizer: Tokenizer, n: int) -> list[Trajectory]:
    async with RolloutPipeline(forking()) as pipeline:
        members = started_group(pipeline, env, [ScriptedModel(tokenizer, ["\\boxed{42}"]) for _ in range(n)])
        return await asyncio.wait_for(asyncio.gather(*(m.done for m in members)), 120)


async def until(condition, timeout: float = 120) -> None:  # type: ignore[no-untyped-def]
    async with asyncio.timeout(timeout):
        while not condition():
            await asyncio.sleep(0.02)


async def test_cancelling_one_member_in_the_group_init_leaves_the_others(task, tokenizer, private_tmp) -> None:
    env = GatedInitEnvironment(task, "bwrap")
    async with RolloutPipeline(forking()) as pipeline:
        members = started_group(pipeline, env, [ScriptedModel(tokenizer, ["\\boxed{42}"]) for _ in range(3)])
        await asyncio.wait_for(env.staging.wait(), 120)
        assert pipeline.status()["init"]["active"] == 3
        await pipeline.cancel(members[0])  # returns at once: it has no sandbox of its own yet
        assert members[0].done.result().critical_error == "cancelled"
        assert not members[1].done.done() and not members[2].done.done()
        env.gate.set()
        results = await asyncio.wait_for(asyncio.gather(members[1].done, members[2].done), 120)
        stats = dict(pipeline.group_stats)
    assert [t.critical_error for t in results] == [None, None] and [t.reward for t in results] == [1.0, 1.0]
    assert env.inits == 1 and stats == {"groups": 1, "inits": 1, "forks": 2}  # forked only for those still waiting
    for t in results:
        names = [s.name for s in t.timing.spans]
        assert names[:3] == ["group_init", "fork", "init"]  # its init: the shared one and its fork, inside it
        init = t.timing.spans[2]
        assert all(init.start_s <= s.start_s and s.start_s + s.duration_s <= init.start_s + init.duration_s + 1e-6
                   for s in t.timing.spans[:2])  # fmt: skip
    assert sandboxes_left() == [] and left_in(private_tmp) == []


async def test_a_member_past_its_init_deadline_times_out_alone(task, tokenizer, private_tmp) -> None:
    env = GatedInitEnvironment(task, "bwrap")
    async with RolloutPipeline(forking()) as pipeline:
        hasty, patient = started_group(pipeline, env, [ScriptedModel(tokenizer, ["\\boxed{42}"]) for _ in range(2)])
        hasty.stage_deadlines_s = {"init": 0.5}  # read when its init stage starts (a later turn of the loop)
        timed_out = await asyncio.wait_for(hasty.done, 120)  # the gate stays shut past its deadline
        assert not patient.done.done()
        env.gate.set()
        finished = await asyncio.wait_for(patient.done, 120)
    assert timed_out.critical_error == "timeout" and "the init stage ran past its deadline of 0.5 s" in timed_out.error
    assert (finished.critical_error, finished.reward) == (None, 1.0)
    assert sandboxes_left() == [] and left_in(private_tmp) == []


async def test_cancelling_every_member_in_the_group_init_closes_its_sandbox(task, tokenizer, private_tmp) -> None:
    env = GatedInitEnvironment(task, "bwrap")
    async with RolloutPipeline(forking()) as pipeline:
        members = started_group(pipeline, env, [ScriptedModel(tokenizer, ["\\boxed{42}"]) for _ in range(3)])
        await asyncio.wait_for(env.staging.wait(), 120)
        assert sandboxes_left()
        await asyncio.gather(*(pipeline.cancel(m) for m in members))
        assert sandboxes_left() == [] and left_in(private_tmp) == []  # the group's init went with its last member
        assert {m.done.result().critical_error for m in members} == {"cancelled"}
        assert pipeline.group_stats["forks"] == 0


async def test_cancelling_one_member_mid_run_leaves_its_siblings(task, tokenizer, private_tmp) -> None:
    env = MathEnvironment(task, "bwrap")
    model = CountingBlockingModel(tokenizer)
    async with RolloutPipeline(forking(run=StageConfig(workers=4))) as pipeline:
        members = started_group(pipeline, env, [model] * 3)
        await until(lambda: model.waiting == 3)
        assert len([p for p in sandboxes_left() if p.name() == "bwrap"]) == 3  # a fork each, the parent gone
        await pipeline.cancel(members[1])
        assert members[1].done.result().critical_error == "cancelled"
        assert len([p for p in sandboxes_left() if p.name() == "bwrap"]) == 2
        model.release.set()
        results = await asyncio.wait_for(asyncio.gather(members[0].done, members[2].done), 120)
    assert [(t.critical_error, t.reward) for t in results] == [(None, 1.0), (None, 1.0)]
    assert sandboxes_left() == [] and left_in(private_tmp) == []


async def test_a_failed_group_init_fails_every_member_naming_it(task, tokenizer, private_tmp) -> None:
    env = GatedInitEnvironment(task, "bwrap", fail=True)
    env.gate.set()
    results = await group_results(env, tokenizer, 4)
    assert env.inits == 1
    for t in results:
        assert t.critical_error == "init" and t.finish == "error"
        assert "the group's init failed" in t.error and "the repository could not be staged" in t.error
    assert sandboxes_left() == [] and left_in(private_tmp) == []


async def test_a_failed_fork_fails_every_member_naming_it(task, tokenizer, private_tmp) -> None:
    results = await group_results(ClosedAfterInitEnvironment(task, "bwrap"), tokenizer, 3)
    for t in results:
        assert t.critical_error == "init" and "forking the group's init into 3 failed" in t.error
    assert sandboxes_left() == [] and left_in(private_tmp) == []


async def test_a_group_larger_than_the_sandbox_cap_is_forked_in_parts(task, tokenizer, private_tmp) -> None:
    env = MathEnvironment(task, "bwrap")
    model = CountingBlockingModel(tokenizer)
    cfg = forking(init=StageConfig(workers=4), run=StageConfig(workers=8), max_live_sandboxes=2)
    async with RolloutPipeline(cfg) as pipeline:
        members = started_group(pipeline, env, [model] * 5)
        await until(lambda: model.waiting == 2)
        assert len([p for p in sandboxes_left() if p.name() == "bwrap"]) == 2  # n forks count n against the cap
        assert pipeline.status()["init"]["queued"] == 3
        model.release.set()
        results = await asyncio.wait_for(asyncio.gather(*(m.done for m in members)), 120)
        stats = dict(pipeline.group_stats)
    assert [t.critical_error for t in results] == [None] * 5
    assert stats == {"groups": 2, "inits": 2, "forks": 4}  # 2 + 2 forked, the fifth inits alone
    assert sandboxes_left() == [] and left_in(private_tmp) == []


# -- through the service, with the stand-in model server ----------------------------------------------------------


@pytest.fixture(scope="module")
def standin() -> Iterator[str]:
    yield from running_standin(STAGED_SCRIPT)


@asynccontextmanager
async def service(model_url: str, tmp_path: Path, fork_groups: bool) -> AsyncIterator[RunningService]:
    model = ModelConfig(kind="remote", addresses=[model_url], served_model_name="standin", tool_call_format="codeact")
    settings = ServiceSettings(port=0, store=tmp_path / f"fork-{fork_groups}.db")
    settings.pipeline.fork_groups = fork_groups
    async with run_service(ServiceConfig(service=settings, model=model)) as running:
        yield running


async def test_a_forked_group_gives_the_same_trajectories_from_one_init(standin, tmp_path, private_tmp) -> None:
    runs = {}
    for fork_groups in (False, True):
        async with service(standin, tmp_path, fork_groups) as svc, RolloutClient(svc.url) as client:
            job = JobRequest(instance=ROW, n=4, sampling_params={"seed": 7, "temperature": 1.0}, job_id="group")
            view = await client.wait(await client.submit(job))
            runs[fork_groups] = (view.results, (await client.status())["fork_groups"])
        assert sandboxes_left() == [] and left_in(private_tmp) == []
    (plain, plain_stats), (forked, forked_stats) = runs[False], runs[True]
    assert [comparable(t) for t in forked] == [comparable(t) for t in plain]
    assert all(t.reward == 1.0 and "Calculate 6 * 7." in t.messages[-2]["content"] for t in forked)  # staged file read
    assert plain_stats == {} and forked_stats == {"groups": 1, "inits": 1, "forks": 4}
    for t in forked:
        assert [s.name for s in t.timing.spans[:3]] == ["group_init", "fork", "init"] and t.timing.init > 0
    assert all("group_init" not in [s.name for s in t.timing.spans] for t in plain)


class AskingForSharedInitEnvironment(MathEnvironment):
    """A task whose environment asks for its groups to share one init (as SWE's does: its staging is costly)."""

    @property
    def shares_group_init(self) -> bool:
        return True


@pytest.mark.parametrize("setting", [None, True, False])
async def test_unset_fork_groups_leaves_it_to_each_tasks_environment(task, tokenizer, private_tmp, setting) -> None:
    """`pipeline.fork_groups` unset: a group shares one init where its environment asks (SWE), else each sample
    inits; set, it decides for every task."""
    inits = {}
    async with RolloutPipeline(config(fork_groups=setting)) as pipeline:
        for env in (MathEnvironment(task, "bwrap"), AskingForSharedInitEnvironment(task, "bwrap")):
            models = [ScriptedModel(tokenizer, ["\\boxed{42}"]) for _ in range(3)]
            results = await asyncio.wait_for(asyncio.gather(*(m.done for m in started_group(pipeline, env, models))), 120)
            assert [t.reward for t in results] == [1.0] * 3
            inits[type(env).__name__] = pipeline.group_stats["inits"] - sum(inits.values())
    shared = {None: [0, 1], True: [1, 1], False: [0, 0]}[setting]  # groups that shared an init: math, asking
    assert list(inits.values()) == shared
    assert sandboxes_left() == [] and left_in(private_tmp) == []
