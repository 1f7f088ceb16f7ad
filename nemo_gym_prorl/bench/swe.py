"""SWE rollouts' stages on the shipped offline suite, in one run: (a) init, run and eval p50 per backend, (b) a
GRPO group of 8 samples forked from one SWE init versus 8 fresh inits, and (c) the same group as one job through
the rollout service, with its ``pipeline.fork_groups`` on versus off.

(a) uses a scripted agent that applies the gold patch (the model's time left out), and every eval must resolve;
(b) and (c) take turns round after round on the first instance of each project, timing wall and CPU seconds ((b)
also the patches taken after the gold patch). The last line is (c)'s median over projects of the wall-time ratio,
with the CPU ratio and the machine's load beside it.

Design notes: docs/benchmarks.md#benchswepy
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from nemo_gym_prorl.bench.sandbox import cpu_seconds
from nemo_gym_prorl.bench.tools import p50_p95, take_turns
from nemo_gym_prorl.contracts.job import JobRequest
from nemo_gym_prorl.contracts.task import TaskInstance, load_task
from nemo_gym_prorl.envs.base import Episode, Submission
from nemo_gym_prorl.envs.dataset import load_instances
from nemo_gym_prorl.envs.swe.env import SweEnvironment
from nemo_gym_prorl.launch.runtime import ModelConfig, ServiceConfig, ServiceRuntime, ServiceSettings
from nemo_gym_prorl.models.launcher import ModelServerProcess
from nemo_gym_prorl.models.standin import standin_argv
from nemo_gym_prorl.service.orchestrator import Orchestrator
from nemo_gym_prorl.tool_calls import ToolCall

TASK = "swe/offline"
BACKENDS = {"bwrap": "default-rootfs", "apptainer": "default-sif"}


def environment(backend: str, image: str) -> SweEnvironment:
    task = load_task(TASK)
    task.verifier = task.verifier | {"image": image}
    return SweEnvironment(task, backend)


def first_per_project(instances: list[TaskInstance]) -> list[TaskInstance]:
    first: dict[str, TaskInstance] = {}
    for instance in instances:
        first.setdefault(instance.data["repo"], instance)
    return list(first.values())


async def gold_patch_taken(env: SweEnvironment, instance: TaskInstance, episode: Episode) -> Submission:
    """What `episode` submits once a scripted agent has applied the instance's gold patch through the bash tool."""
    command = f"git apply <<'PRORL_EOF'\n{instance.data['patch']}PRORL_EOF"
    await env.call_tool(episode, ToolCall(name="bash", arguments={"command": command}))
    return await env.collect(episode)


async def stage_times(env: SweEnvironment, instance: TaskInstance) -> tuple[float, float, float]:
    started = time.perf_counter()
    episode = await env.init(instance)
    staged = time.perf_counter()
    try:
        submission = await gold_patch_taken(env, instance, episode)
    finally:
        await env.close(episode)
    ran = time.perf_counter()
    evaluation = await env.grade(instance, submission)
    graded = time.perf_counter()
    if not evaluation.resolved:
        raise RuntimeError(f"{instance.instance_id} on {env.sandbox_backend}: the gold patch did not resolve: "
                           f"{evaluation.details.get('reason')}")  # fmt: skip
    return staged - started, ran - staged, graded - ran


async def stages(instances: list[TaskInstance], rounds: int) -> None:
    print("(a) SWE stages per backend, p50 over instances x rounds (run = scripted agent applying the gold patch)")
    for backend, image in BACKENDS.items():
        try:
            env = environment(backend, image)
            times = [await stage_times(env, i) for _ in range(rounds) for i in instances]
        except (FileNotFoundError, RuntimeError) as e:
            print(f"  {backend:<10} not measured: {e}")
            continue
        init, run, evaluate = (statistics.median(t[k] for t in times) for k in range(3))
        print(f"  {backend:<10} init {init * 1e3:7.0f} ms   run {run * 1e3:7.0f} ms   eval {evaluate * 1e3:7.0f} ms")


async def group(env: SweEnvironment, instance: TaskInstance, size: int, forked: bool) -> tuple[float, float, float]:
    """Seconds until `size` samples of `instance` are staged (`forked`: one init forked into `size`, as the service's
    group forking does; else `size` inits at once), seconds for all of them then to apply the gold patch and have
    their patches taken, and the CPU seconds of the group, closing included."""
    cpu, started = cpu_seconds(), time.perf_counter()
    if forked:
        episodes: list = await env.fork(await env.init(instance), [env] * size)
    else:
        episodes = await asyncio.gather(*(env.init(instance) for _ in range(size)), return_exceptions=True)
    staged = time.perf_counter()
    try:
        failures = [e for e in episodes if isinstance(e, BaseException)]
        if failures:
            raise failures[0]
        taken = await asyncio.gather(*(gold_patch_taken(env, instance, e) for e in episodes))
        if not all(submission["patch"] for submission in taken):
            raise RuntimeError(f"{instance.instance_id}: a sample's patch came back empty")
        patched = time.perf_counter()
    finally:
        await asyncio.gather(*(env.close(e) for e in episodes if not isinstance(e, BaseException)))
    return staged - started, patched - staged, cpu_seconds() - cpu


@dataclass
class Side:
    """One side of a comparison on a group of `size` samples of `instance`: seconds and CPU seconds per round."""

    instance: TaskInstance
    size: int
    samples: list[float] = field(default_factory=list, kw_only=True)
    cpu: list[float] = field(default_factory=list, kw_only=True)


@dataclass
class GroupSide(Side):
    env: SweEnvironment
    forked: bool
    patch: list[float] = field(default_factory=list, kw_only=True)

    async def measure(self) -> None:
        elapsed, patch, cpu = await group(self.env, self.instance, self.size, self.forked)
        self.samples.append(elapsed)
        self.patch.append(patch)
        self.cpu.append(cpu)


async def fork_vs_fresh(instances: list[TaskInstance], size: int, rounds: int) -> None:
    image = BACKENDS["bwrap"]
    env = environment("bwrap", image)
    print(f"(b) a group of {size} on bwrap, {rounds} rounds each, p50 / p95 ms: {size} fresh inits | 1 init + "
          f"fork({size}) | ratio of p50s | patches taken after the gold patch, p50 ms fresh / forked | CPU s p50 "
          f"fresh / forked")  # fmt: skip
    ratios = []
    for instance in instances:
        fresh, forked = GroupSide(instance, size, env, False), GroupSide(instance, size, env, True)
        await take_turns([fresh, forked], rounds, warmup=1)
        for side in (fresh, forked):  # take_turns drops warm-up samples only
            side.cpu, side.patch = side.cpu[-rounds:], side.patch[-rounds:]
        (fresh_p50, fresh_p95), (forked_p50, forked_p95) = p50_p95(fresh.samples), p50_p95(forked.samples)
        ratios.append(fresh_p50 / forked_p50)
        patch = f"{statistics.median(fresh.patch) * 1e3:5.0f} / {statistics.median(forked.patch) * 1e3:5.0f}"
        cpu = f"{statistics.median(fresh.cpu):.2f} / {statistics.median(forked.cpu):.2f}"
        print(f"  {instance.instance_id:<24} {fresh_p50 * 1e3:6.0f} / {fresh_p95 * 1e3:6.0f} | {forked_p50 * 1e3:6.0f} / "
              f"{forked_p95 * 1e3:6.0f} | {ratios[-1]:.1f}x | {patch} | {cpu}")  # fmt: skip
    print(f"fork ratio: {statistics.median(ratios):.1f}x faster to a staged group of {size} (median over "
          f"{len(ratios)} projects, {min(ratios):.1f}x to {max(ratios):.1f}x; goal >= 5x)")  # fmt: skip


STANDIN_SCRIPT = ["```bash\ngit status --short && ls\n```"]  # looks, changes nothing; the task stops it after a turn


def service_task_file(folder: Path) -> Path:
    """The SWE task as the service runs it here: the default rootfs, one turn, the environment's own grouping off."""
    task = load_task(TASK)
    task.max_turns = 1
    task.verifier = task.verifier | {"image": BACKENDS["bwrap"]}
    path = folder / "swe-bench-service.yaml"
    path.write_text(yaml.safe_dump(task.model_dump(mode="json")))
    return path


@dataclass
class ServiceSide(Side):
    """One side of (c): a service whose pipeline forks groups or not; each measurement is one job of `size`."""

    orchestrator: Orchestrator

    async def measure(self) -> None:
        request = JobRequest(instance=self.instance.data, instance_id=self.instance.instance_id, n=self.size,
                             sampling_params={"seed": 1})  # fmt: skip
        cpu, started = cpu_seconds(), time.perf_counter()
        view = await self.orchestrator.wait(self.orchestrator.submit(request))
        self.samples.append(time.perf_counter() - started)
        self.cpu.append(cpu_seconds() - cpu)
        failed = [t for t in view.results if t.critical_error is not None]
        if failed:
            raise RuntimeError(f"{self.instance.instance_id}: a sample failed: {failed[0].critical_error}: {failed[0].error}")


async def service_fork_vs_not(instances: list[TaskInstance], size: int, rounds: int, folder: Path) -> None:
    task_file = service_task_file(folder)
    print(f"(c) a job of n={size} through the service (bwrap, stand-in model, one turn), {rounds} rounds each, s p50 "
          f"(min-max): fork_groups off | on | wall ratio | CPU s p50 off / on | CPU ratio")  # fmt: skip
    load = os.getloadavg()[0]
    async with AsyncExitStack() as stack:
        model = await stack.enter_async_context(ModelServerProcess(standin_argv(STANDIN_SCRIPT)))
        orchestrators = {}
        for fork_groups in (False, True):
            settings = ServiceSettings(tasks=[str(task_file)], store=folder / f"fork-{fork_groups}.db", port=0)
            settings.pipeline.fork_groups = fork_groups
            model_config = ModelConfig(kind="remote", addresses=[model.base_url], served_model_name="standin",
                                       tool_call_format="codeact")  # fmt: skip
            runtime = await stack.enter_async_context(ServiceRuntime(ServiceConfig(service=settings, model=model_config)))
            orchestrators[fork_groups] = runtime.orchestrator
        walls, cpus = [], []
        for instance in instances:
            off, on = (ServiceSide(instance, size, orchestrators[f]) for f in (False, True))
            await take_turns([off, on], rounds, warmup=1)
            off.cpu, on.cpu = off.cpu[-rounds:], on.cpu[-rounds:]
            wall_off, wall_on = statistics.median(off.samples), statistics.median(on.samples)
            cpu_off, cpu_on = statistics.median(off.cpu), statistics.median(on.cpu)
            walls.append(wall_off / wall_on)
            cpus.append(cpu_off / cpu_on)
            print(f"  {instance.instance_id:<24} {wall_off:5.2f} ({min(off.samples):.2f}-{max(off.samples):.2f}) | "
                  f"{wall_on:5.2f} ({min(on.samples):.2f}-{max(on.samples):.2f}) | {walls[-1]:.2f}x | "
                  f"{cpu_off:.2f} / {cpu_on:.2f} | {cpus[-1]:.2f}x")  # fmt: skip
    loads = f"{load:.1f} -> {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores"
    print(f"service fork_groups: {statistics.median(walls):.2f}x faster (wall) and {statistics.median(cpus):.2f}x less "
          f"CPU for a job of n={size} through the service (median over {len(walls)} projects; wall {min(walls):.2f}x "
          f"to {max(walls):.2f}x, CPU {min(cpus):.2f}x to {max(cpus):.2f}x; load {loads}; goal >= 1.3x wall, "
          f">= 1.2x CPU)")  # fmt: skip


async def _run(rounds: int, group_size: int, fork_rounds: int, service_rounds: int, only: str | None) -> None:
    instances = first_per_project(load_instances(load_task(TASK).dataset))
    if only in (None, "stages"):
        await stages(instances, rounds)
    if only in (None, "fork"):
        await fork_vs_fresh(instances, group_size, fork_rounds)
    if only not in (None, "service"):
        return
    with tempfile.TemporaryDirectory(prefix="prorl-bench-swe-") as folder:
        await service_fork_vs_not(instances, group_size, service_rounds, Path(folder))


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="prorl bench swe", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=1, help="stage measurements per instance and backend")
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--fork-rounds", type=int, default=5)
    parser.add_argument("--service-rounds", type=int, default=5, help="(c): jobs per project and side")
    parser.add_argument("--only", choices=["stages", "fork", "service"], help="run one part only")
    args = parser.parse_args(argv)
    asyncio.run(_run(args.rounds, args.group, args.fork_rounds, args.service_rounds, args.only))
