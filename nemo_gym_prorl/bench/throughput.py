"""Rollout throughput, our service vs NeMo Gym's own simple_agent, with only the orchestrator different.

Both sides run the same 3-tool-call task against the same processes: one Gym resources server (`prorl_bench`, one
uvicorn worker per core) and one instant stand-in model. The sides: the service in-process, the service on Ray
(`ray.local_workers` = one per core) and `gym eval run` through simple_agent. The resources server times the rollout
phase; orchestrator CPU per rollout is sampled per process. At each concurrency the three sides take turns over
several rounds, each side in each place of the order in turn, so the machine's drift lands on all of them; rewards
and tool calls are checked equal. The last line is the headline: the Ray path's throughput over Gym's, the median
over rounds of the ratio within a round, with its range.

Design notes: docs/benchmarks.md#benchthroughputpy
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import operator
import os
import statistics
import threading
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from tempfile import TemporaryDirectory
from typing import Any, Self

import httpx
import psutil

from nemo_gym_prorl.agent.llm_pool import LLMPoolConfig
from nemo_gym_prorl.cluster.settings import RaySettings
from nemo_gym_prorl.contracts.job import JobRequest
from nemo_gym_prorl.contracts.trajectory import Trajectory
from nemo_gym_prorl.gym.processes import GymEnv, gym_env_start, gym_environ, run_gym, session_members
from nemo_gym_prorl.gym.venvs import ensure_venv_links
from nemo_gym_prorl.launch.runtime import ModelConfig, ServiceConfig, ServiceSettings
from nemo_gym_prorl.launch.serve import run_service
from nemo_gym_prorl.models.launcher import ModelServerProcess
from nemo_gym_prorl.models.standin import standin_argv
from nemo_gym_prorl.service.client import RolloutClient
from nemo_gym_prorl.service.pipeline import PipelineConfig, StageConfig

RESOURCES_SERVER = "prorl_bench"
GYM_AGENT = "prorl_bench_simple_agent"

ADD_TOOL = {
    "type": "function",
    "name": "add",
    "description": 'Add two numbers; returns {"sum": a + b}.',
    "parameters": {
        "type": "object",
        "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
        "required": ["a", "b"],
        "additionalProperties": False,
    },
    "strict": False,
}


def _hermes_add(a: int, b: int) -> str:
    return f'<tool_call>\n{{"name": "add", "arguments": {{"a": {a}, "b": {b}}}}}\n</tool_call>'


# The stand-in's replies, by assistant turn: three tool calls, then the answer.
SCRIPT = [_hermes_add(1, 2), _hermes_add(3, 3), _hermes_add(6, 4), "The total is \\boxed{10}."]
TOOL_CALLS_PER_ROLLOUT = 3


def bench_row(i: int) -> dict[str, Any]:
    """A Gym dataset row of the benchmark task (what `prorl_bench`'s data/example.jsonl holds)."""
    return {
        "responses_create_params": {
            "input": [
                {
                    "role": "system",
                    "content": "Add numbers with the add tool, one call at a time. Then give the total as \\boxed{N}.",
                },
                {"role": "user", "content": "What is 1 + 2 + 3 + 4?"},
            ],
            "tools": [ADD_TOOL],
        },
        "id": f"bench-{i}",
        "expected_answer": "10",
    }


def write_jsonl(path: Path, rows: Iterable[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def gym_task_yaml(path: Path, rows_path: Path, resources_server_url: str, max_turns: int = len(SCRIPT)) -> Path:
    """A `type: gym` task for our service: these rows, this resources server, Hermes tool calls."""
    path.write_text(
        f"name: bench/{RESOURCES_SERVER}\n"
        "type: gym\n"
        f"dataset: {{path: {rows_path}, id_key: id}}\n"
        "tool_call_format: hermes\n"
        f"max_turns: {max_turns}\n"
        f"resources_server_url: {resources_server_url}\n"
    )
    return path


# -- gym processes ----------------------------------------------------------------------------------------------


def link_venvs(root: Path) -> Path:
    """Venv links for every server Gym starts here (ours, `prorl_bench` among them, and Gym's) under `root`."""
    ensure_venv_links(root)
    return root


# -- CPU by role ------------------------------------------------------------------------------------------------


class CpuSampler:
    """CPU seconds (user + system) of processes, by role, sampled on a thread; `between(t0, t1)` interpolates, so
    a phase known only afterwards (from the resources server's clock) can be cut out of the samples. The sampler's
    own CPU is left out of the role that holds this process."""

    def __init__(self, interval_s: float = 0.2) -> None:
        self.interval_s = interval_s
        self._roles: dict[str, list[psutil.Process]] = {}
        self._own_role: str | None = None
        self._samples: list[tuple[float, dict[str, float]]] = []
        self._sampled = threading.Condition()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="cpu-sampler", daemon=True)

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def watch(self, role: str, *pids: int, tree: bool = True) -> None:
        """Count `pids` as `role`, with the descendants they have now when `tree`."""
        procs = []
        for pid in pids:
            with contextlib.suppress(psutil.Error):
                proc = psutil.Process(pid)
                procs += [proc, *(proc.children(recursive=True) if tree else [])]
                if pid == os.getpid():
                    self._own_role = role
        with self._sampled:
            self._roles[role] = [*self._roles.get(role, []), *procs]

    @staticmethod
    def _cpu(procs: list[psutil.Process]) -> float:
        total = 0.0
        for proc in procs:
            with contextlib.suppress(psutil.Error):  # gone: its CPU stops counting (none of ours ends mid-phase)
                times = proc.cpu_times()
                total += times.user + times.system
        return total

    def _loop(self) -> None:
        while True:
            with self._sampled:
                cpu = {role: self._cpu(procs) for role, procs in self._roles.items()}
                if self._own_role is not None:
                    cpu[self._own_role] -= time.thread_time()  # this thread's CPU, sampling included
                self._samples.append((time.monotonic(), cpu))
                self._sampled.notify_all()
            if self._stop.wait(self.interval_s):
                return

    def _at(self, role: str, t: float) -> float:
        points = [(at, cpu[role]) for at, cpu in self._samples if role in cpu]
        if not points:
            return 0.0
        before = [p for p in points if p[0] <= t] or points[:1]
        after = [p for p in points if p[0] >= t] or points[-1:]
        (t0, c0), (t1, c1) = before[-1], after[0]
        return c0 if t1 <= t0 else c0 + (c1 - c0) * (t - t0) / (t1 - t0)

    def between(self, t0: float, t1: float) -> dict[str, float]:
        """CPU seconds by role from `t0` to `t1` (monotonic, both past): waits for the first sample after `t1`."""
        with self._sampled:
            if not self._sampled.wait_for(lambda: self._samples and self._samples[-1][0] >= t1, timeout=10):
                raise RuntimeError("the CPU sampler stopped sampling")
            return {role: self._at(role, t1) - self._at(role, t0) for role in self._roles}


# -- one side at one concurrency --------------------------------------------------------------------------------


@dataclass
class SideResult:
    side: str
    concurrency: int
    rollouts: int
    ok: int
    verdicts: Counter[tuple[float, int]]  # (reward, `add` calls the rollout's session made), as /verify said
    phase_s: float
    tool_calls: int  # what the resources server served
    verifies: int
    cpu_s: dict[str, float] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)

    @property
    def rollouts_per_s(self) -> float:
        return self.rollouts / self.phase_s

    def cpu_ms_per_rollout(self, role: str) -> float:
        return 1000 * self.cpu_s.get(role, 0.0) / self.rollouts

    @property
    def all_cpu_ms_per_rollout(self) -> float:
        """Every watched process's CPU per rollout: orchestrator, model, resources server and the rest."""
        return 1000 * sum(self.cpu_s.values()) / self.rollouts

    def __add__(self, other: SideResult) -> SideResult:
        """Two runs of one side as one: rollouts over the sum of their phases."""
        return SideResult(
            self.side, self.concurrency, self.rollouts + other.rollouts, self.ok + other.ok,
            self.verdicts + other.verdicts, self.phase_s + other.phase_s, self.tool_calls + other.tool_calls,
            self.verifies + other.verifies, dict(Counter(self.cpu_s) + Counter(other.cpu_s)),
            self.errors + other.errors,
        )  # fmt: skip


class ResourcesServerStats:
    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")

    async def reset(self) -> None:
        async with httpx.AsyncClient(trust_env=False) as client:
            (await client.post(f"{self.url}/bench/reset")).raise_for_status()

    async def read(self) -> dict[str, Any]:
        async with httpx.AsyncClient(trust_env=False) as client:
            response = await client.get(f"{self.url}/bench/stats")
            response.raise_for_status()
            return response.json()


def service_config(
    model_url: str, task_yaml: Path, concurrency: int, store: Path, max_n: int, ray: RaySettings | None = None
) -> ServiceConfig:
    pipeline = PipelineConfig(
        init=StageConfig(workers=concurrency, deadline_s=600),
        run=StageConfig(workers=concurrency, deadline_s=3600),
        eval=StageConfig(workers=max(1, concurrency // 4), deadline_s=600),
        max_live_sandboxes=concurrency,
    )
    settings = ServiceSettings(
        port=0, tasks=[str(task_yaml)], store=store, pipeline=pipeline, max_n=max_n,
        llm_pool=LLMPoolConfig(max_connections=concurrency + 64, health_interval_s=0),
    )  # fmt: skip
    model = ModelConfig(
        kind="remote", addresses=[model_url], served_model_name="standin", tool_call_format="hermes",
        generation_mode="chat",
    )  # fmt: skip
    return ServiceConfig(service=settings, model=model, ray=ray or RaySettings())


async def run_service_side(
    model_url: str, resources: ResourcesServerStats, task_yaml: Path, rows: list[dict[str, Any]], group: int,
    concurrency: int, sampler: CpuSampler, store: Path, ray: RaySettings | None = None,
) -> SideResult:  # fmt: skip
    config = service_config(model_url, task_yaml, concurrency, store, group, ray)
    before = _tree(os.getpid())
    async with run_service(config) as service:
        if ray is not None:  # the local Ray it started: GCS, raylet, the worker actors
            for role, pids in _ray_roles(_tree(os.getpid()) - before).items():
                sampler.watch(role, *pids, tree=False)
        await resources.reset()
        # The whole batch at once, as a trainer hands it over. The results are durable, so waiting on the jobs in
        # turn (one stream at a time, on a connection of its own) misses nothing. (A connection the submitting
        # client left idle for longer than the server's keep-alive can be closed under a request reusing it.)
        async with RolloutClient(service.url, timeout_s=600) as client:
            jobs = await asyncio.gather(*(client.submit(JobRequest(instance=row, n=group)) for row in rows))
        async with RolloutClient(service.url, timeout_s=600) as client:
            trajectories = [t for job in jobs for t in (await client.wait(job)).results]
    stats = await resources.read()
    side = "service" if ray is None else "ray"
    return await _side_result(side, concurrency, stats, sampler, trajectories_summary(trajectories))


RAY_ROLES = ("ray workers", "ray gcs+raylet", "ray other")


def _ray_roles(pids: Iterable[int]) -> dict[str, list[int]]:
    """A local Ray's processes by what they do: the rollout worker actors (`ray::RolloutWorker`), the GCS and the
    raylet, and the rest (dashboard and runtime-env agents, idle pre-started workers, log monitors)."""
    roles: dict[str, list[int]] = {role: [] for role in RAY_ROLES}
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            proc = psutil.Process(pid)
            title = " ".join(proc.cmdline()) or proc.name()
            if "RolloutWorker" in title:
                roles["ray workers"].append(pid)
            elif proc.name() in ("gcs_server", "raylet"):
                roles["ray gcs+raylet"].append(pid)
            else:
                roles["ray other"].append(pid)
    return roles


Outcome = tuple[int, int, Counter[tuple[float, int]], list[str]]  # rollouts, ok, verdicts, errors


def trajectories_summary(trajectories: list[Trajectory]) -> Outcome:
    errors = [f"{t.critical_error}: {t.error}" for t in trajectories if t.critical_error]
    verdicts = Counter((t.reward, t.evaluation.get("tool_calls", 0)) for t in trajectories)
    return len(trajectories), len(trajectories) - len(errors), verdicts, errors


async def run_gym_side(
    env: GymEnv, resources: ResourcesServerStats, rows_path: Path, n_rows: int, group: int, concurrency: int,
    sampler: CpuSampler, environ: dict[str, str], tmp: Path, run: str,
) -> SideResult:  # fmt: skip
    output = tmp / f"gym-{concurrency}-{run}" / "rollouts.jsonl"
    await resources.reset()
    args = [
        "eval", "run", "--no-serve", "--agent", GYM_AGENT, "--input", str(rows_path), "--output", str(output),
        "--num-repeats", str(group), "--concurrency", str(concurrency), f"+head_server.port={env.head_port}",
        f"hydra.run.dir={tmp / 'hydra-eval'}",
    ]  # fmt: skip

    def watch_collector(pid: int) -> None:
        sampler.watch("gym collector", pid, tree=False)

    try:
        await run_gym(args, environ, tmp, timeout_s=1800, on_start=watch_collector)
    except RuntimeError as e:  # what the servers said is in gym env start's log
        raise RuntimeError(f"{e}\n--- gym env start log:\n{env.log.read_text()[-6000:]}") from None
    results = [json.loads(line) for line in output.open()] if output.exists() else []
    failures = output.with_name("rollouts_failures.jsonl")
    errors = [line[:300] for line in failures.open()] if failures.exists() else []
    summary = (n_rows * group, len(results), Counter((float(r["reward"]), r["tool_calls"]) for r in results), errors)
    return await _side_result("gym", concurrency, await resources.read(), sampler, summary)


async def _side_result(
    side: str, concurrency: int, stats: dict[str, Any], sampler: CpuSampler,
    summary: Outcome,
) -> SideResult:  # fmt: skip
    rollouts, ok, verdicts, errors = summary
    t0, t1 = stats["first_seed_at"], stats["last_verify_at"]
    if t0 is None or t1 is None:
        raise RuntimeError(f"{side}: the resources server saw no complete rollout ({stats}); errors: {errors[:3]}")
    return SideResult(
        side, concurrency, rollouts, ok, verdicts, t1 - t0, stats["tool_calls"], stats["verifies"],
        await asyncio.to_thread(sampler.between, t0, t1), errors,
    )  # fmt: skip


# -- the benchmark ----------------------------------------------------------------------------------------------

GYM_ORCHESTRATOR_ROLES = ("gym collector", "gym environment server", "gym simple_agent", "gym vllm_model")


def orchestrator_cpu_ms(result: SideResult) -> float:
    roles = {"service": ("service",), "ray": ("service", *RAY_ROLES)}.get(result.side, GYM_ORCHESTRATOR_ROLES)
    return sum(result.cpu_ms_per_rollout(role) for role in roles)


def check_same_work(ours: SideResult, gym: SideResult) -> list[str]:
    problems = []
    for r in (ours, gym):
        if r.ok != r.rollouts:
            problems.append(f"{r.side}: {r.rollouts - r.ok} of {r.rollouts} rollouts failed: {r.errors[:2]}")
        if r.tool_calls != TOOL_CALLS_PER_ROLLOUT * r.rollouts or r.verifies != r.rollouts:
            problems.append(
                f"{r.side}: the resources server served {r.tool_calls} tool calls and {r.verifies} verifies "
                f"for {r.rollouts} rollouts (expected {TOOL_CALLS_PER_ROLLOUT} and 1 each)"
            )
        if any(calls != TOOL_CALLS_PER_ROLLOUT for _, calls in r.verdicts):
            problems.append(f"{r.side}: a session's own tool calls, by verify: {dict(r.verdicts)}")
    if ours.verdicts != gym.verdicts:
        problems.append(f"verdicts differ: service {dict(ours.verdicts)} vs gym {dict(gym.verdicts)}")
    return problems


SIDES = ("service", "ray", "gym")
Round = dict[str, SideResult]  # side -> its run in one round


def spread(values: Sequence[float], unit: str = "") -> str:
    """Median (min–max) of `values`."""
    return f"{statistics.median(values):.2f}{unit} ({min(values):.2f}–{max(values):.2f})"


def ratios(rounds: Sequence[Round], side: str) -> list[float]:
    """`side`'s rollouts/s over Gym's, within each round (both ran minutes apart at most)."""
    return [r[side].rollouts_per_s / r["gym"].rollouts_per_s for r in rounds]


def report_level(rounds: Sequence[Round]) -> str:
    total = {side: functools.reduce(operator.add, (r[side] for r in rounds)) for side in SIDES}
    ours, ray, gym = (total[side] for side in SIDES)
    head = (
        f"concurrency {ours.concurrency}: {len(rounds)} rounds of {rounds[0]['gym'].rollouts} rollouts by each side; "
        "rollouts/s as median (min–max) over rounds, CPU over all rounds"
    )
    lines = [head]
    for r in (ours, ray, gym):
        cpu = {role: r.cpu_ms_per_rollout(role) for role in ("model", "resources server", "other gym processes")}
        lines.append(
            f"  {r.side:8s} {spread([one[r.side].rollouts_per_s for one in rounds])} rollouts/s  "
            f"orchestrator CPU {orchestrator_cpu_ms(r):6.1f} ms/rollout  (model {cpu['model']:.1f}, "
            f"resources server {cpu['resources server']:.1f}, other {cpu['other gym processes']:.1f}; "
            f"all {r.all_cpu_ms_per_rollout:.1f})  "
            f"ok {r.ok}/{r.rollouts}, (reward, session tool calls) {dict(sorted(r.verdicts.items()))}"
        )
    parts = ", ".join(f"{role} {ray.cpu_ms_per_rollout(role):.1f}" for role in ("service", *RAY_ROLES))
    lines.append(f"  ray orchestrator CPU by process (ms/rollout): {parts}")
    gym_parts = ", ".join(
        f"{role.removeprefix('gym ')} {gym.cpu_ms_per_rollout(role):.1f}" for role in GYM_ORCHESTRATOR_ROLES
    )
    lines.append(f"  gym orchestrator CPU by process (ms/rollout): {gym_parts}")
    # With every core busy, rollouts/s follow the CPU all processes spend per rollout. The model, the resources
    # server and Gym's idle processes are shared work: even an orchestrator that cost nothing would not pass this.
    ours_all, ray_all, gym_all = ours.all_cpu_ms_per_rollout, ray.all_cpu_ms_per_rollout, gym.all_cpu_ms_per_rollout
    shared = ours_all - orchestrator_cpu_ms(ours)
    lines.append(
        f"  CPU per rollout, all processes: gym/service {gym_all / ours_all:.2f}x, gym/ray {gym_all / ray_all:.2f}x; "
        f"ceiling with a zero-CPU orchestrator on our side: {gym_all / shared:.2f}x"
    )
    service, ray_ratio = (spread(ratios(rounds, side), "x") for side in ("service", "ray"))
    lines.append(f"  ratio within a round: service {service}, ray {ray_ratio} rollouts/s over gym")
    return "\n".join(lines)


@dataclass(frozen=True)
class Plan:
    levels: list[int]
    rollouts_per_slot: int
    min_rollouts: int
    max_rollouts: int
    group: int
    warmup: int
    resources_workers: int
    ray_workers: int
    ray_object_store_mb: int
    rounds: int

    def rollouts(self, concurrency: int) -> int:
        """Per side at `concurrency`: enough that the ramp up and down stays a small part of the phase."""
        return min(max(self.rollouts_per_slot * concurrency, self.min_rollouts), self.max_rollouts)


async def _run(plan: Plan) -> None:
    with TemporaryDirectory(prefix="prorl-bench-throughput-") as tmp_name, CpuSampler() as sampler:
        tmp = Path(tmp_name)
        environ = gym_environ(link_venvs(tmp / "venvs"))
        sampler.watch("service", os.getpid(), tree=False)  # its children are the others
        async with ModelServerProcess(standin_argv(SCRIPT)) as model:
            assert model.pid is not None
            sampler.watch("model", model.pid)
            start_args = [
                "--resources-server", RESOURCES_SERVER, "--config", "configs/local_policy_model.yaml",
                "--model", "standin", "--model-url", model.base_url, "--model-api-key", "dummy",
                f"++{RESOURCES_SERVER}.resources_servers.{RESOURCES_SERVER}.num_workers={plan.resources_workers}",
            ]  # fmt: skip
            async with gym_env_start(start_args, environ, tmp, tmp / "env_start.log") as env:
                roles = {
                    RESOURCES_SERVER: "resources server", "prorl_bench_environment_server": "gym environment server",
                    GYM_AGENT: "gym simple_agent", "policy_model": "gym vllm_model",
                }  # fmt: skip
                for name, role in roles.items():
                    sampler.watch(role, env.servers[name]["pid"])
                server_trees = {p for name in roles for p in _tree(env.servers[name]["pid"])}
                others = [p for p in session_members(env.pid) if p not in server_trees]  # Ray, gym env start
                sampler.watch("other gym processes", *others, tree=False)
                resources = ResourcesServerStats(env.servers[RESOURCES_SERVER]["url"])
                print(f"gym env up: {', '.join(env.servers)}; stand-in model at {model.base_url}", flush=True)

                async def level(concurrency: int, rollouts: int, rounds: int) -> list[Round]:
                    """`rounds` runs of each side, the order turning by one each round: the machine's speed
                    drifts over minutes, and no side always runs first or last."""
                    group = plan.group
                    n_rows = max(1, rollouts // group)
                    rows = [bench_row(i) for i in range(n_rows)]
                    rows_path = write_jsonl(tmp / f"rows-{concurrency}.jsonl", rows)
                    task_yaml = gym_task_yaml(tmp / f"task-{concurrency}.yaml", rows_path, resources.url)
                    ray = RaySettings(local_workers=plan.ray_workers, object_store_mb=plan.ray_object_store_mb)

                    async def run_side(side: str, run: str) -> SideResult:
                        if side == "gym":
                            return await run_gym_side(
                                env, resources, rows_path, n_rows, group, concurrency, sampler, environ, tmp, run
                            )
                        return await run_service_side(
                            model.base_url, resources, task_yaml, rows, group, concurrency, sampler,
                            tmp / f"jobs-{concurrency}-{side}-{run}.db", ray if side == "ray" else None,
                        )

                    results = []
                    for i in range(rounds):
                        order = SIDES[i % len(SIDES) :] + SIDES[: i % len(SIDES)]
                        one = {side: await run_side(side, str(i)) for side in order}
                        problems = [p for side in ("service", "ray") for p in check_same_work(one[side], one["gym"])]
                        if problems:
                            raise SystemExit("throughput: the sides did not do the same work:\n" + "\n".join(problems))
                        results.append(one)
                    return results

                if plan.warmup:  # first requests pay for imports, connections and caches on both sides
                    (warm,) = await level(plan.warmup, plan.rollouts_per_slot * plan.warmup, rounds=1)
                    rates = ", ".join(f"{side} {warm[side].rollouts_per_s:.1f}/s" for side in SIDES)
                    print(f"warm-up at concurrency {plan.warmup} (not reported): {rates}", flush=True)
                results: list[list[Round]] = []
                for concurrency in plan.levels:
                    results.append(await level(concurrency, plan.rollouts(concurrency), plan.rounds))
                    print(report_level(results[-1]), flush=True)

    print(
        "definitions: rollouts/s = rollouts / rollout phase (the resources server's first /seed_session to the end of "
        "its last /verify); orchestrator CPU = CPU of the orchestrating processes in that phase per rollout "
        "(service: this process, the service and its client; ray: that + the local Ray's processes; gym: eval-run "
        "collector + environment server + simple_agent + vllm_model)"
    )
    on_ray = ", ".join(f"{spread(ratios(rounds, 'ray'), 'x')} at {rounds[0]['ray'].concurrency}" for rounds in results)
    in_process = ", ".join(f"{statistics.median(ratios(rounds, 'service')):.2f}x" for rounds in results)
    worst = min(statistics.median(ratios(rounds, "ray")) for rounds in results)
    print(
        f"throughput: service on Ray ({plan.ray_workers} workers, one per core) vs Gym simple_agent on the same "
        f"resources server and model, median (min–max) over {plan.rounds} rounds: {on_ray} (worst median "
        f"{worst:.2f}x, goal 3x; in-process service {in_process}); machine load {_load()}"
    )


def _load() -> str:
    return "/".join(f"{x:.1f}" for x in os.getloadavg())


def _tree(pid: int) -> set[int]:
    try:
        root = psutil.Process(pid)
        return {pid, *(p.pid for p in root.children(recursive=True))}
    except psutil.Error:
        return {pid}


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="prorl bench throughput", description=__doc__.split("\n")[0])
    parser.add_argument("--levels", type=int, nargs="+", default=[256, 1024], help="concurrency levels")
    parser.add_argument("--rollouts-per-slot", type=int, default=4, help="rollouts per level = this x concurrency")
    parser.add_argument("--min-rollouts", type=int, default=1024, help="floor on the rollouts of one level")
    parser.add_argument("--max-rollouts", type=int, default=2048, help="cap on the rollouts of one level")
    parser.add_argument("--group", type=int, default=8, help="samples per task (a GRPO group: --num-repeats / n)")
    parser.add_argument("--warmup", type=int, default=16, help="an unreported first round at this concurrency; 0: none")
    parser.add_argument(
        "--resources-workers", type=int, default=os.cpu_count() or 1,
        help="uvicorn workers of the resources server (Gym's num_workers); default: one per core",
    )  # fmt: skip
    parser.add_argument(
        "--ray-workers", type=int, default=os.cpu_count() or 1, help="Ray side: worker actors (default: one per core)"
    )
    parser.add_argument("--ray-object-store-mb", type=int, default=128, help="Ray side: the local object store")
    parser.add_argument("--rounds", type=int, default=3, help="runs of each side per level, in turns")
    args = parser.parse_args(argv)
    asyncio.run(_run(Plan(**vars(args))))
