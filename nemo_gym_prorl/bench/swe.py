"""SWE rollouts' stages on the shipped offline suite, in one run: (a) init, run and eval p50 per backend, and (b) a
GRPO group of 8 samples forked from one SWE init versus 8 fresh inits.

(a) For each sampled instance (the first of each project) on each backend (bwrap on the default rootfs, Apptainer
on its SIF): init (sandbox up, repository staged on its squashed base), run (a scripted agent applies the gold
patch through the bash tool, and the patch is extracted: the model's time is left out), eval (a fresh sandbox,
patch and hidden tests applied, tests run, graded by swebench). Every eval must resolve.

(b) Eight inits of one instance at once, as the service's init stage runs a group: fresh (`fork_groups: false`,
eight stagings) against forked (one staging, `fork(8)`), timed until all eight are staged; closing is not
counted in the time; the CPU seconds a group costs (ours and our children's, closing included) are shown
beside it: what forking saves a machine busy with many groups. The sides take turns, round after round, on the first instance of each project (the projects differ in
how long a staging takes, which is what forking saves: a fork costs about a sandbox start, so the ratio grows with
the repository); the last line is the median over projects of the ratio of the medians (goal >= 5x).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from dataclasses import dataclass, field

from nemo_gym_prorl.bench.sandbox import cpu_seconds
from nemo_gym_prorl.bench.tools import p50_p95, take_turns
from nemo_gym_prorl.envs.dataset import TaskInstance, load_instances
from nemo_gym_prorl.envs.swe import SweEnvironment
from nemo_gym_prorl.envs.task import load_task
from nemo_gym_prorl.tool_calls import ToolCall

TASK = "swe/offline"
BACKENDS = {"bwrap": "default-rootfs", "apptainer": "default-sif"}


def environment(backend: str, image: str, fork_groups: bool = True) -> SweEnvironment:
    task = load_task(TASK)
    task.verifier = task.verifier | {"image": image, "fork_groups": fork_groups}
    return SweEnvironment(task, backend)


def first_per_project(instances: list[TaskInstance]) -> list[TaskInstance]:
    first: dict[str, TaskInstance] = {}
    for instance in instances:
        first.setdefault(instance.data["repo"], instance)
    return list(first.values())


async def stage_times(env: SweEnvironment, instance: TaskInstance) -> tuple[float, float, float]:
    started = time.perf_counter()
    episode = await env.init(instance)
    staged = time.perf_counter()
    try:
        command = f"git apply <<'PRORL_EOF'\n{instance.data['patch']}PRORL_EOF"
        await env.call_tool(episode, ToolCall(name="bash", arguments={"command": command}))
        submission = await env.collect(episode)
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
            env = environment(backend, image, fork_groups=False)
            times = [await stage_times(env, i) for _ in range(rounds) for i in instances]
        except (FileNotFoundError, RuntimeError) as e:
            print(f"  {backend:<10} not measured: {e}")
            continue
        init, run, evaluate = (statistics.median(t[k] for t in times) for k in range(3))
        print(f"  {backend:<10} init {init * 1e3:7.0f} ms   run {run * 1e3:7.0f} ms   eval {evaluate * 1e3:7.0f} ms")


async def group(env: SweEnvironment, instance: TaskInstance, size: int) -> tuple[float, float]:
    """Seconds until `size` inits of `instance` are staged, and the CPU seconds of the group, closing included."""
    cpu, started = cpu_seconds(), time.perf_counter()
    episodes = await asyncio.gather(*(env.init(instance) for _ in range(size)), return_exceptions=True)
    elapsed = time.perf_counter() - started
    await asyncio.gather(*(env.close(e) for e in episodes if not isinstance(e, BaseException)))
    failures = [e for e in episodes if isinstance(e, BaseException)]
    if failures:
        raise failures[0]
    return elapsed, cpu_seconds() - cpu


@dataclass
class GroupSide:
    name: str
    env: SweEnvironment
    instance: TaskInstance
    size: int
    samples: list[float] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)

    async def measure(self) -> None:
        elapsed, cpu = await group(self.env, self.instance, self.size)
        self.samples.append(elapsed)
        self.cpu.append(cpu)


async def fork_vs_fresh(instances: list[TaskInstance], size: int, rounds: int) -> None:
    image = BACKENDS["bwrap"]
    fresh_env, forked_env = environment("bwrap", image, fork_groups=False), environment("bwrap", image)
    print(f"(b) a group of {size} on bwrap, {rounds} rounds each, p50 / p95 ms: {size} fresh inits | 1 init + "
          f"fork({size}) | ratio of p50s | CPU s p50 fresh / forked")  # fmt: skip
    ratios = []
    for instance in instances:
        fresh = GroupSide("fresh", fresh_env, instance, size)
        forked = GroupSide("forked", forked_env, instance, size)
        await take_turns([fresh, forked], rounds, warmup=1)
        (fresh_p50, fresh_p95), (forked_p50, forked_p95) = p50_p95(fresh.samples), p50_p95(forked.samples)
        ratios.append(fresh_p50 / forked_p50)
        cpu = f"{statistics.median(fresh.cpu):.2f} / {statistics.median(forked.cpu):.2f}"
        print(f"  {instance.instance_id:<24} {fresh_p50 * 1e3:6.0f} / {fresh_p95 * 1e3:6.0f} | {forked_p50 * 1e3:6.0f} / "
              f"{forked_p95 * 1e3:6.0f} | {ratios[-1]:.1f}x | {cpu}")  # fmt: skip
    print(f"fork ratio: {statistics.median(ratios):.1f}x faster to a staged group of {size} (median over "
          f"{len(ratios)} projects, {min(ratios):.1f}x to {max(ratios):.1f}x; goal >= 5x)")  # fmt: skip


async def _run(rounds: int, group_size: int, fork_rounds: int) -> None:
    instances = first_per_project(load_instances(load_task(TASK).dataset))
    await stages(instances, rounds)
    await fork_vs_fresh(instances, group_size, fork_rounds)


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="prorl bench swe", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=1, help="stage measurements per instance and backend")
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--fork-rounds", type=int, default=5)
    args = parser.parse_args(argv)
    asyncio.run(_run(args.rounds, args.group, args.fork_rounds))
