"""`prorl bench async`: a simulated trainer against the rollout service, synchronous vs asynchronous (lag 1), with
the pool's weight updates letting requests in flight finish (async) or cutting and re-issuing them (cut).

Each training step takes a batch of GRPO groups (jobs of n samples), trains on it for a fixed time (the GPU step it
stands for), then updates the weights through the service: pause the pool (requests in flight finish), resume with
the next policy version. Synchronous: generate step k's batch, train, update. Asynchronous with lag 1: step k+1's
batch is submitted before step k trains, so its generation overlaps the training, and its jobs carry
``max_version_lag=1`` (``on_stale=rerun``). The model is the stand-in with long-tailed latency (a Pareto draw per
turn); sandboxes are real bubblewrap ones. Rounds alternate the three modes. Printed per mode: rollouts per second
of wall time, and what the updates cost: rollouts rerun or lost, requests cut, and tokens generated that no result
holds. The last lines are async / sync and cut / sync (goal >= 1.5x, with 0 lost).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from tempfile import TemporaryDirectory

from nemo_gym_prorl.agent.llm_pool import LLMPoolConfig
from nemo_gym_prorl.contracts.job import JobRequest, JobView
from nemo_gym_prorl.launch.runtime import ModelConfig, ServiceConfig, ServiceSettings
from nemo_gym_prorl.launch.serve import RunningService, run_service
from nemo_gym_prorl.models.launcher import ModelServerProcess
from nemo_gym_prorl.models.standin import standin_argv
from nemo_gym_prorl.service.client import RolloutClient

ROW = {"id": "async", "question": "Calculate 6 * 7.", "answer": "42"}
MODES = ("sync", "async", "cut")  # cut: asynchronous, the pool's weight_update=cut
SCRIPT = ["```bash\necho $((6 * 7))\n```", "\\boxed{42}"]  # a tool call, then the answer: two model turns


@dataclass
class Args:
    steps: int
    groups: int
    n: int
    train_s: float
    latency_s: float
    tail: float
    rounds: int


@dataclass
class Run:
    mode: str
    wall_s: float
    rollouts: int  # results the trainer took, all usable
    unusable: int
    stale: int  # rollouts found stale: run again, their work lost to an update
    lost_tokens: int  # generated, in no result
    cut: int  # requests cut by a weight update and re-issued

    @property
    def rate(self) -> float:
        return self.rollouts / self.wall_s


class Trainer:
    """The simulated trainer: submits batches, waits for them, 'trains', updates the weights."""

    def __init__(self, svc: RunningService, client: RolloutClient, args: Args, lag: int | None) -> None:
        self.svc, self.client, self.args, self.lag = svc, client, args, lag
        self.version = 0
        self.seed = 0
        self.views: list[JobView] = []

    async def submit(self) -> list[str]:
        jobs = []
        for _ in range(self.args.groups):
            self.seed += 1
            request = JobRequest(
                instance=ROW, n=self.args.n, sampling_params={"seed": self.seed},
                max_version_lag=self.lag, on_stale="rerun",
            )  # fmt: skip
            jobs.append(await self.client.submit(request))
        return jobs

    async def take(self, jobs: list[str]) -> None:
        self.views += await asyncio.gather(*(self.client.wait(job) for job in jobs))

    async def train_and_update(self) -> None:
        await asyncio.sleep(self.args.train_s)  # the training step itself: a fixed time, as on a GPU
        await self.client.pause_llm()
        self.version += 1
        await self.client.resume_llm(policy_version=self.version)

    async def synchronous(self) -> None:
        for _ in range(self.args.steps):
            await self.take(await self.submit())
            await self.train_and_update()

    async def asynchronous(self) -> None:
        batch = await self.submit()
        for step in range(self.args.steps):
            following = await self.submit() if step + 1 < self.args.steps else []  # generates while this trains
            await self.take(batch)
            await self.train_and_update()
            batch = following


async def one_run(model_url: str, args: Args, mode: str) -> Run:
    with TemporaryDirectory(prefix="prorl-bench-async-") as tmp:
        settings = ServiceSettings(
            port=0, store=Path(tmp) / "jobs.db", max_n=args.n,
            llm_pool=LLMPoolConfig(health_interval_s=0, weight_update="cut" if mode == "cut" else "finish"),
        )  # fmt: skip
        model = ModelConfig(kind="remote", addresses=[model_url], served_model_name="standin")
        async with run_service(ServiceConfig(service=settings, model=model)) as svc, RolloutClient(svc.url) as client:
            await client.resume_llm(policy_version=0)
            trainer = Trainer(svc, client, args, lag=None if mode == "sync" else 1)
            started = time.perf_counter()
            await (trainer.synchronous() if mode == "sync" else trainer.asynchronous())
            wall_s = time.perf_counter() - started
            generated = svc.orchestrator.pool.generated
            stale = (await client.status())["stale_rollouts"]
    results = [t for view in trainer.views for t in view.results]
    kept = sum(len(turn["generation_token_ids"]) for t in results for turn in t.assistant_turns())
    usable = sum(1 for t in results if t.mask_reason() is None)
    lost_tokens = generated.completion_tokens - kept
    return Run(mode, wall_s, usable, len(results) - usable, stale, lost_tokens, generated.cut)


async def measure(args: Args) -> list[Run]:
    runs = []
    argv = standin_argv(SCRIPT, latency_s=args.latency_s, latency_tail=args.tail)
    async with ModelServerProcess(argv) as model:
        for _ in range(args.rounds):
            for mode in MODES:
                run = await one_run(model.base_url, args, mode)
                print(
                    f"{mode:>5}: {run.rollouts} rollouts in {run.wall_s:.1f} s = {run.rate:.2f}/s; unusable "
                    f"{run.unusable}, rerun as stale {run.stale}, requests cut {run.cut}, tokens lost to updates "
                    f"{run.lost_tokens}",
                    flush=True,
                )
                runs.append(run)
    return runs


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="prorl bench async", description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=6, help="training steps per run")
    parser.add_argument("--groups", type=int, default=4, help="GRPO groups (jobs) per step")
    parser.add_argument("--n", type=int, default=4, help="samples per group")
    parser.add_argument("--train-s", type=float, default=4.0, help="the simulated training step")
    parser.add_argument("--latency-s", type=float, default=0.25, help="the stand-in's base latency per turn")
    parser.add_argument("--tail", type=float, default=1.5, help="Pareto shape of the latency's long tail")
    parser.add_argument("--rounds", type=int, default=2, help="sync/async pairs, alternating")
    args = Args(**vars(parser.parse_args(argv)))
    runs = asyncio.run(measure(args))
    rates = {mode: [r.rate for r in runs if r.mode == mode] for mode in MODES}
    for mode in MODES[1:]:
        ratios = [a / s for s, a in zip(rates["sync"], rates[mode], strict=True)]
        lost = sum(r.stale + r.unusable for r in runs if r.mode == mode)
        lost_tokens = sum(r.lost_tokens for r in runs if r.mode == mode)
        spread = f" (rounds {min(ratios):.2f}-{max(ratios):.2f}x)" if len(ratios) > 1 else ""
        print(
            f"{mode} / sync rollouts per second: {statistics.median(ratios):.2f}x median{spread} (goal >= 1.5x); "
            f"rollouts lost or rerun in {mode}: {lost}, tokens lost to updates: {lost_tokens} (goal 0)"
        )
