"""The three-stage pipeline: every stage's deadline, cancel at every stage and in every queue, errors classified,
and no sandbox left behind. Stage durations are stretched by a test environment around the real math one."""

from __future__ import annotations

import asyncio
import gc

import pytest
from sandbox_helpers import sandboxes_left
from scripted_model import BlockingModel, ScriptedModel, config, rollout

from nemo_gym_prorl.contracts.sandbox import SandboxError
from nemo_gym_prorl.contracts.task import TaskInstance, load_task
from nemo_gym_prorl.envs import make_environment
from nemo_gym_prorl.envs.base import Episode, Evaluation
from nemo_gym_prorl.envs.math.env import MathEnvironment
from nemo_gym_prorl.models.tokenizer import Tokenizer
from nemo_gym_prorl.service.pipeline import Rollout, RolloutPipeline, StageConfig


class SlowMathEnvironment(MathEnvironment):
    """Math with init/eval stretched, and a gate the test opens to know a stage is under way."""

    def __init__(self, *args, init_s: float = 0.0, eval_s: float = 0.0, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.init_s, self.eval_s = init_s, eval_s
        self.entered: dict[str, asyncio.Event] = {"init": asyncio.Event(), "eval": asyncio.Event()}

    async def stage(self, episode: Episode) -> None:
        await super().stage(episode)
        self.entered["init"].set()
        await asyncio.sleep(self.init_s)

    async def grade(self, instance: TaskInstance, submission: dict) -> Evaluation:
        self.entered["eval"].set()
        await asyncio.sleep(self.eval_s)
        return await super().grade(instance, submission)


class UnclosableSandboxEnvironment(MathEnvironment):
    """Closing the sandbox fails, as bwrap's close does when its cgroup keeps processes past SIGKILL (the test's
    sandbox is really closed first, so nothing is left behind)."""

    async def close(self, episode: Episode) -> None:
        had_sandbox = episode.sandbox is not None
        await super().close(episode)
        if had_sandbox:
            raise SandboxError("cgroup still has processes [123] after SIGKILL")


@pytest.fixture
def task():
    return load_task("math/arithmetic").model_copy(update={"max_turns": 2})


class BrokenSandboxEnvironment(MathEnvironment):
    """Staging the task fails in a sandbox that did start, as a disk or image problem does."""

    async def stage(self, episode: Episode) -> None:
        raise SandboxError("the workspace could not be written: no space left on device")


def with_first_turn(r: Rollout) -> Rollout:
    r.first_turn_agent = r.agent
    return r


async def test_a_rollout_goes_through_all_three_stages(task, tokenizer: Tokenizer) -> None:
    env = SlowMathEnvironment(task, "bwrap")
    async with RolloutPipeline(config()) as pipeline:
        r = rollout(env, ScriptedModel(tokenizer, ["\\boxed{42}"]))
        pipeline.submit([r])
        trajectory = await r.done
    assert trajectory.critical_error is None and trajectory.reward == 1.0 and trajectory.finish == "answer"
    assert sandboxes_left() == []


@pytest.mark.parametrize("stage", ["init", "run", "eval"])
async def test_each_stage_deadline(task, tokenizer: Tokenizer, stage: str) -> None:
    env = SlowMathEnvironment(task, "bwrap", init_s=60 if stage == "init" else 0, eval_s=60 if stage == "eval" else 0)
    model = BlockingModel(tokenizer) if stage == "run" else ScriptedModel(tokenizer, ["\\boxed{42}"])
    async with RolloutPipeline(config()) as pipeline:
        r = rollout(env, model, stage_deadlines_s={stage: 0.5})
        pipeline.submit([r])
        trajectory = await asyncio.wait_for(r.done, 30)
    assert trajectory.critical_error == "timeout"
    assert f"the {stage} stage ran past its deadline of 0.5 s" in trajectory.error
    assert getattr(trajectory.timing, stage) < 5
    assert sandboxes_left() == []


async def test_job_deadline_counts_stage_time_not_queue_time(task, tokenizer: Tokenizer) -> None:
    env = SlowMathEnvironment(task, "bwrap", eval_s=0.6)
    cfg = config(init=StageConfig(workers=1), eval=StageConfig(workers=1))
    async with RolloutPipeline(cfg) as pipeline:
        # eight rollouts through one eval worker: the last waits ~4 s in the eval queue, but spends only ~0.6 s
        # of stage time in eval, within its 3 s job deadline
        rollouts = [rollout(env, ScriptedModel(tokenizer, ["\\boxed{42}"]), job_deadline_s=3.0) for _ in range(8)]
        pipeline.submit(rollouts)
        trajectories = await asyncio.gather(*(r.done for r in rollouts))
    assert [t.critical_error for t in trajectories] == [None] * 8
    assert max(t.timing.queued for t in trajectories) > 3.0


@pytest.mark.parametrize("stage", ["init", "run"])
async def test_cancel_in_each_stage_frees_the_sandbox_at_once(task, tokenizer: Tokenizer, stage: str) -> None:
    env = SlowMathEnvironment(task, "bwrap", init_s=60 if stage == "init" else 0, eval_s=60 if stage == "eval" else 0)
    model = BlockingModel(tokenizer) if stage == "run" else ScriptedModel(tokenizer, ["\\boxed{42}"])
    async with RolloutPipeline(config()) as pipeline:
        r = rollout(env, model)
        pipeline.submit([r])
        started = model.started if stage == "run" else env.entered[stage]
        await asyncio.wait_for(started.wait(), 30)
        assert sandboxes_left()
        await pipeline.cancel(r)
        assert sandboxes_left() == []
        trajectory = r.done.result()
    assert trajectory.critical_error == "cancelled" and f"during {stage}" in trajectory.error


async def test_eval_runs_without_the_run_sandbox_and_can_be_cancelled(task, tokenizer: Tokenizer) -> None:
    env = SlowMathEnvironment(task, "bwrap", eval_s=60)
    async with RolloutPipeline(config(eval=StageConfig(workers=1))) as pipeline:
        busy, queued = rollout(env, ScriptedModel(tokenizer, ["\\boxed{42}"])), rollout(env, ScriptedModel(tokenizer, ["\\boxed{1}"]))
        pipeline.submit([busy, queued])
        await asyncio.wait_for(env.entered["eval"].wait(), 30)
        async with asyncio.timeout(30):
            while pipeline.status()["eval"]["queued"] < 1:
                await asyncio.sleep(0.02)
        assert sandboxes_left() == []  # both runs are over: their sandboxes closed before grading
        await asyncio.gather(pipeline.cancel(queued), pipeline.cancel(busy))
        results = [queued.done.result(), busy.done.result()]
        assert {t.critical_error for t in results} == {"cancelled"}
        assert sorted(t.error for t in results) == ["cancelled during eval", "cancelled while queued"]


async def test_errors_are_classified_by_stage(task, tokenizer: Tokenizer) -> None:
    bad_prompt = make_environment(task.model_copy(update={"prompt_template": "{nope}"}), "bwrap")
    async with RolloutPipeline(config()) as pipeline:
        init_error = rollout(bad_prompt, ScriptedModel(tokenizer, []))
        eval_error = Rollout(
            env=make_environment(task, "bwrap"),
            agent=rollout(bad_prompt, ScriptedModel(tokenizer, ["\\boxed{1}"])).agent,
            instance=TaskInstance(instance_id="x", data={"question": "q", "answer": "@@@"}),
        )
        run_error = rollout(make_environment(task, "bwrap"), ScriptedModel(tokenizer, []))  # the model has nothing to say
        pipeline.submit([init_error, eval_error, run_error])
        results = await asyncio.gather(init_error.done, eval_error.done, run_error.done)
    assert [t.critical_error for t in results] == ["init", "eval", "run"]
    assert "nope" in results[0].error and "not parseable" in results[1].error and "IndexError" in results[2].error
    assert results[1].finish == "answer"  # the run itself completed; only grading failed
    assert sandboxes_left() == []


async def test_a_rollout_ended_in_init_gets_its_first_turn_alone_masked_when_asked(task, tokenizer: Tokenizer) -> None:
    env = BrokenSandboxEnvironment(task, "bwrap")
    model = ScriptedModel(tokenizer, ["\\boxed{42}"])
    async with RolloutPipeline(config()) as pipeline:
        asked, plain = with_first_turn(rollout(env, model)), rollout(env, ScriptedModel(tokenizer, []))
        pipeline.submit([asked, plain])
        results = await asyncio.gather(asked.done, plain.done)
    for trajectory in results:  # both end as init ended them, with no reward
        assert trajectory.critical_error == "init" and "no space left" in trajectory.error and trajectory.reward == 0
    (turn,) = results[0].assistant_turns()  # the policy's own turn on the prompt, which no one trains on
    assert turn["mask"] and turn["first_turn_only"] == "the rollout ended before its first turn (init)"
    assert turn["generation_token_ids"] and turn["prompt_token_ids"] == model.prompts[0]
    assert results[1].assistant_turns() == [] and results[1].timing.run == 0 < results[0].timing.run  # in a run stage
    assert sandboxes_left() == []


@pytest.mark.parametrize("how", ["cancel", "deadline"])
async def test_a_first_turn_alone_is_cancelled_and_timed_like_any_run(task, tokenizer: Tokenizer, how: str) -> None:
    model = BlockingModel(tokenizer)  # never released
    async with RolloutPipeline(config(run=StageConfig(workers=2, deadline_s=0.5 if how == "deadline" else None))) as pipeline:
        r = with_first_turn(rollout(BrokenSandboxEnvironment(task, "bwrap"), model, job_deadline_s=600))
        pipeline.submit([r])
        if how == "cancel":
            await model.started.wait()
            await pipeline.cancel(r)
        trajectory = await r.done
    assert trajectory.critical_error == "init" and trajectory.assistant_turns() == []
    why = "cancelled" if how == "cancel" else "the run stage ran past its deadline of 0.5 s"
    assert trajectory.error.endswith(f"its first turn alone could not be generated either: {why}"), trajectory.error
    assert sandboxes_left() == []


async def test_live_sandboxes_are_capped(task, tokenizer: Tokenizer) -> None:
    env = SlowMathEnvironment(task, "bwrap")
    model = BlockingModel(tokenizer)
    async with RolloutPipeline(config(init=StageConfig(workers=4), run=StageConfig(workers=8), max_live_sandboxes=2)) as pipeline:
        rollouts = [rollout(env, model) for _ in range(5)]
        pipeline.submit(rollouts)
        await asyncio.wait_for(model.started.wait(), 30)
        async with asyncio.timeout(30):
            while pipeline.status()["run"]["active"] < 2:
                await asyncio.sleep(0.02)
        assert pipeline.status()["run"]["active"] == 2 and len([p for p in sandboxes_left() if p.name() == "bwrap"]) == 2
        assert pipeline.status()["init"]["queued"] == 3  # held by init workers until a slot frees: still queued
        model.release.set()
        trajectories = await asyncio.gather(*(r.done for r in rollouts))
    assert all(t.critical_error is None for t in trajectories)


async def test_a_sandbox_that_will_not_close_fails_its_rollout_not_the_worker(task, tokenizer: Tokenizer) -> None:
    one_worker = config(run=StageConfig(workers=1))
    unclosable = UnclosableSandboxEnvironment(task, "bwrap")
    async with RolloutPipeline(one_worker) as pipeline:
        blocking = BlockingModel(tokenizer)
        finished, cancelled = rollout(unclosable, ScriptedModel(tokenizer, ["\\boxed{42}"])), rollout(unclosable, blocking)
        pipeline.submit([finished, cancelled])
        await asyncio.wait_for(blocking.started.wait(), 30)
        await pipeline.cancel(cancelled)
        healthy = rollout(make_environment(task, "bwrap"), ScriptedModel(tokenizer, ["\\boxed{42}"]))
        pipeline.submit([healthy])  # the one run worker is still there for it
        results = await asyncio.wait_for(asyncio.gather(finished.done, cancelled.done, healthy.done), 60)
    assert [t.critical_error for t in results] == ["run", "cancelled", None]
    assert results[0].error.startswith("closing the sandbox failed: ") and "still has processes [123]" in results[0].error
    assert results[0].finish == "answer"  # what the rollout did is kept; the sample is marked, not dropped
    assert results[1].error.startswith("cancelled during run; closing the sandbox failed")
    assert sandboxes_left() == []


async def test_a_bug_handing_a_rollout_on_fails_that_rollout_not_the_worker(
    task, tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bug after a stage (here: keeping the first rollout's submission raises) used to kill the stage's worker and
    leave its rollout's result unset: every later rollout waited forever."""
    keep = RolloutPipeline._keep_submission
    first: list[Rollout] = []

    def buggy_for_the_first(r: Rollout) -> None:
        if not first:
            first.append(r)
            raise AttributeError("'SyntheticEnvironment' object has no attribute 'task'")
        keep(r)

    monkeypatch.setattr(RolloutPipeline, "_keep_submission", staticmethod(buggy_for_the_first))
    env = make_environment(task, "bwrap")
    one_worker = config(init=StageConfig(workers=1), run=StageConfig(workers=1), eval=StageConfig(workers=1))
    async with RolloutPipeline(one_worker) as pipeline:
        rollouts = [rollout(env, ScriptedModel(tokenizer, ["\\boxed{42}"])) for _ in range(2)]
        pipeline.submit(rollouts)
        broken, healthy = await asyncio.wait_for(asyncio.gather(*(r.done for r in rollouts)), 60)
    assert broken.critical_error == "run" and "has no attribute 'task'" in broken.error
    assert healthy.critical_error is None and healthy.reward == 1.0
    assert sandboxes_left() == []


class SlowFailingCloseEnvironment(MathEnvironment):
    """Closing the sandbox (really) waits for the test's go, then reports a failure."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.closing, self.go, self.closed = asyncio.Event(), asyncio.Event(), False

    async def close(self, episode: Episode) -> None:
        if episode.sandbox is None:
            return await super().close(episode)
        self.closing.set()
        await self.go.wait()
        await super().close(episode)
        self.closed = True
        raise SandboxError("cgroup still has processes [123] after SIGKILL")


async def test_stopping_the_pipeline_waits_for_a_sandbox_being_closed(
    task, tokenizer: Tokenizer, caplog: pytest.LogCaptureFixture
) -> None:
    """The service stopping while a finished rollout's sandbox closes: the stop waits for the close (its slot is not
    given back early, nothing runs on), and the close's failure is logged, not left to asyncio as an unretrieved
    task exception."""
    env = SlowFailingCloseEnvironment(task, "bwrap")
    pipeline = RolloutPipeline(config())
    pipeline.start()
    r = rollout(env, ScriptedModel(tokenizer, ["\\boxed{42}"]))
    pipeline.submit([r])
    await asyncio.wait_for(env.closing.wait(), 30)
    stopping = asyncio.ensure_future(pipeline.close())
    done, _ = await asyncio.wait([stopping], timeout=0.5)
    assert not done  # waiting for the close
    env.go.set()
    await asyncio.wait_for(stopping, 30)
    assert env.closed and sandboxes_left() == []
    gc.collect()
    messages = [record.getMessage() for record in caplog.records]
    assert any("failed after its caller was cancelled" in m for m in messages), messages
    assert not any("never retrieved" in m for m in messages), messages
