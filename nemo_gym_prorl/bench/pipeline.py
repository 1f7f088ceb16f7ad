"""Three-stage pipeline vs naive per-job async on a synthetic long-tail workload, in one run.

Workload (seeded): init 0.2–3 s, eval 0.5–5 s (both long-tailed), a run of a few model turns whose latency is
simulated behind a bounded number of concurrent model requests (the GPU). Both sides get the same cap on live
sandboxes. Naive = one semaphore of that size around init → run → eval, as a per-job async server does; ours = the
service's `RolloutPipeline` unchanged, with a synthetic environment and agent plugged in. The last line is the
throughput ratio (goal >= 1.5x).
"""

from __future__ import annotations

import argparse
import asyncio
import math
import random
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

from nemo_gym_prorl.agent.loop import AgentLoop
from nemo_gym_prorl.contracts.task import DatasetConfig, TaskConfig, TaskInstance
from nemo_gym_prorl.contracts.trajectory import Trajectory
from nemo_gym_prorl.envs.base import Episode, Evaluation, Submission
from nemo_gym_prorl.service.pipeline import PipelineConfig, Rollout, RolloutPipeline, StageConfig


@dataclass
class Workload:
    init_s: float
    eval_s: float
    turns: int


def long_tail(rng: random.Random, low: float, high: float) -> float:
    """Log-uniform on [low, high]: as many draws in 0.2–0.6 s as in 1–3 s, the shape of sandbox starts and test
    runs (most are quick, a few take many times longer)."""
    return math.exp(rng.uniform(math.log(low), math.log(high)))


def make_workloads(n: int, seed: int) -> list[Workload]:
    rng = random.Random(seed)
    return [Workload(long_tail(rng, 0.2, 3.0), long_tail(rng, 0.5, 5.0), rng.randint(2, 4)) for _ in range(n)]


class _NoSandbox:
    async def close(self) -> None:
        return None


class SyntheticEnvironment:
    """Sleeps stand in for sandbox start and grading; the pipeline cannot tell the difference."""

    task = TaskConfig(name="synthetic", type="math", dataset=DatasetConfig(path=Path("synthetic.jsonl")))
    keeps_submission = True

    def __init__(self, workloads: dict[str, Workload]) -> None:
        self.workloads = workloads
        self.live_sandboxes = 0
        self.peak_sandboxes = 0

    async def init(self, instance: TaskInstance) -> Episode:
        self.live_sandboxes += 1
        self.peak_sandboxes = max(self.peak_sandboxes, self.live_sandboxes)
        await asyncio.sleep(self.workloads[instance.instance_id].init_s)
        return Episode(instance=instance, sandbox=_NoSandbox())  # type: ignore[arg-type]

    async def collect(self, episode: Episode) -> Submission:
        return {"answer": "42"}

    async def grade(self, instance: TaskInstance, submission: Submission) -> Evaluation:
        await asyncio.sleep(self.workloads[instance.instance_id].eval_s)
        return Evaluation(reward=1.0, resolved=True)

    async def eval(self, episode: Episode) -> Evaluation:
        return await self.grade(episode.instance, await self.collect(episode))

    async def close(self, episode: Episode) -> None:
        self.live_sandboxes -= 1


class SyntheticAgent(AgentLoop):
    """Model turns: each waits for one of the GPU's request slots, then for the simulated generation time."""

    def __init__(self, gpu: asyncio.Semaphore, latency_s: float, turns: int) -> None:
        super().__init__(None, None, turns)  # type: ignore[arg-type]  # no model, no tool calls: simulated turns
        self.gpu, self.latency_s, self.turns = gpu, latency_s, turns

    def start(self, env: object, episode: Episode, trajectory: Trajectory) -> None:
        trajectory.finish = "max_turns"

    async def run(self, env: object, episode: Episode, trajectory: Trajectory) -> None:
        for _ in range(self.turns):
            async with self.gpu:
                await asyncio.sleep(self.latency_s)
        trajectory.finish = "answer"


async def naive(workloads: list[Workload], live_cap: int, gpu_slots: int, latency_s: float) -> tuple[float, int]:
    env = SyntheticEnvironment({str(i): w for i, w in enumerate(workloads)})
    gpu, live = asyncio.Semaphore(gpu_slots), asyncio.Semaphore(live_cap)

    async def job(i: int, w: Workload) -> None:
        async with live:
            episode = await env.init(TaskInstance(instance_id=str(i), data={}))
            try:
                trajectory = Trajectory(instance_id=str(i), trajectory_id=str(i))
                await SyntheticAgent(gpu, latency_s, w.turns).run(env, episode, trajectory)
                await env.eval(episode)
            finally:
                await env.close(episode)

    started = time.perf_counter()
    await asyncio.gather(*(job(i, w) for i, w in enumerate(workloads)))
    return len(workloads) / (time.perf_counter() - started), env.peak_sandboxes


async def pipelined(workloads: list[Workload], live_cap: int, gpu_slots: int, latency_s: float) -> tuple[float, int]:
    env = SyntheticEnvironment({str(i): w for i, w in enumerate(workloads)})
    gpu = asyncio.Semaphore(gpu_slots)
    stage = StageConfig(workers=live_cap)
    config = PipelineConfig(init=stage, run=stage, eval=stage, max_live_sandboxes=live_cap)
    started = time.perf_counter()
    async with RolloutPipeline(config) as pipeline:
        rollouts = [
            Rollout(env=env, agent=SyntheticAgent(gpu, latency_s, w.turns), instance=TaskInstance(instance_id=str(i), data={}))  # type: ignore[arg-type]
            for i, w in enumerate(workloads)
        ]
        pipeline.submit(rollouts)
        trajectories = await asyncio.gather(*(r.done for r in rollouts))
    elapsed = time.perf_counter() - started
    failed = [t for t in trajectories if t.critical_error]
    if failed:
        raise RuntimeError(f"{len(failed)} synthetic rollouts failed: {failed[0].error}")
    return len(workloads) / elapsed, env.peak_sandboxes


async def _run(n: int, live_cap: int, gpu_slots: int, latency_s: float, rounds: int, seed: int) -> None:
    workloads = make_workloads(n, seed)
    print(
        f"workload: {n} rollouts, init {statistics.mean(w.init_s for w in workloads):.2f} s mean "
        f"(max {max(w.init_s for w in workloads):.1f}), eval {statistics.mean(w.eval_s for w in workloads):.2f} s mean "
        f"(max {max(w.eval_s for w in workloads):.1f}), {statistics.mean(w.turns for w in workloads):.1f} turns of "
        f"{latency_s:g} s, {gpu_slots} concurrent model requests, {live_cap} live sandboxes"
    )
    naive_rates, our_rates = [], []
    for r in range(rounds):
        rate_n, peak_n = await naive(workloads, live_cap, gpu_slots, latency_s)
        rate_p, peak_p = await pipelined(workloads, live_cap, gpu_slots, latency_s)
        naive_rates.append(rate_n)
        our_rates.append(rate_p)
        print(f"round {r + 1}/{rounds}: naive {rate_n:.2f} rollouts/s (peak {peak_n} sandboxes)   "
              f"pipeline {rate_p:.2f} rollouts/s (peak {peak_p} sandboxes)")
    naive_median, our_median = statistics.median(naive_rates), statistics.median(our_rates)
    print(f"naive per-job async (one semaphore): {naive_median:.2f} rollouts/s (median)")
    print(f"three-stage pipeline:                {our_median:.2f} rollouts/s (median)")
    print(f"ratio pipeline/naive: {our_median / naive_median:.2f}x (goal >= 1.5x)")


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="prorl bench pipeline")
    parser.add_argument("--rollouts", type=int, default=256)
    parser.add_argument("--live-sandboxes", type=int, default=32)
    parser.add_argument("--model-slots", type=int, default=16, help="concurrent model requests the GPU takes")
    parser.add_argument("--model-latency-s", type=float, default=0.3, help="simulated time of one generation")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    asyncio.run(_run(args.rollouts, args.live_sandboxes, args.model_slots, args.model_latency_s, args.rounds, args.seed))
