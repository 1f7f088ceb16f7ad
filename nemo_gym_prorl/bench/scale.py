"""Many live rollouts at once on this machine: each in its own real bubblewrap sandbox, all waiting on a stand-in
model that holds every request until told to answer. Reports the service's memory and file descriptors per live
rollout, the sandboxes' memory, and that every rollout then finishes without error and leaves nothing behind.

With ``--ray-nodes N`` the service runs on a Ray cluster started here by Ray's own ``cluster_utils.Cluster`` (a head
offering no CPUs, so no workers, and N one-CPU nodes, each with its own raylet and one rollout worker): rollouts'
sandboxes live under the nodes' workers, and memory and file descriptors per live rollout are reported per node.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import resource
import time
from collections.abc import Iterator
from pathlib import Path
from tempfile import TemporaryDirectory
from typing import Any

import httpx
import psutil
import yaml

from nemo_gym_prorl.agent.llm_pool import LLMPoolConfig
from nemo_gym_prorl.cluster.settings import RaySettings
from nemo_gym_prorl.contracts.job import JobRequest
from nemo_gym_prorl.contracts.task import load_task
from nemo_gym_prorl.launch.runtime import ModelConfig, ServiceConfig, ServiceSettings
from nemo_gym_prorl.launch.serve import run_service
from nemo_gym_prorl.models.launcher import ModelServerProcess
from nemo_gym_prorl.models.standin import standin_argv
from nemo_gym_prorl.service.client import RolloutClient
from nemo_gym_prorl.service.pipeline import PipelineConfig, StageConfig

ROW = {"id": "scale", "question": "Calculate 6 * 7.", "answer": "42"}
SCRIPT = ["```bash\necho $((6 * 7))\n```", "\\boxed{42}"]


def _tree_rss_mb(root: psutil.Process, names: set[str]) -> tuple[int, float]:
    procs = [p for p in root.children(recursive=True) if p.name() in names]
    total = 0
    for p in procs:
        try:
            total += p.memory_full_info().uss
        except psutil.NoSuchProcess:
            pass
    return len(procs), total / 2**20


@contextlib.contextmanager
def _ray_cluster(nodes: int) -> Iterator[str | None]:
    """The address of a head (no CPUs) and `nodes` one-CPU worker nodes on this machine; None for no nodes."""
    if not nodes:
        yield None
        return
    from ray.cluster_utils import Cluster

    store = {"object_store_memory": 100 << 20}
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False, **store})
    try:
        for _ in range(nodes):
            cluster.add_node(num_cpus=1, **store)
        cluster.wait_for_nodes()
        yield cluster.address
    finally:
        cluster.shutdown()


def _node_usage(svc: Any) -> dict[str, dict[str, float]]:
    """Per Ray node: its workers' RSS (MB) and fds, and the sandboxes under them (processes, unique MB)."""
    usage: dict[str, dict[str, float]] = {}
    remote = svc.orchestrator.remote
    if remote is None:
        return usage
    live = {node: s["live"] for node, s in remote.status()["nodes"].items()}
    for worker in remote.ready_workers():
        node = usage.setdefault(worker.node_id, dict.fromkeys(("rss_mb", "fds", "procs", "sandbox_mb", "live"), 0.0))
        with contextlib.suppress(psutil.Error):
            process = psutil.Process(worker.info["pid"])
            node["rss_mb"] += process.memory_info().rss / 2**20
            node["fds"] += process.num_fds()
            procs, mb = _tree_rss_mb(process, {"bwrap", "bash"})
            node["procs"] += procs
            node["sandbox_mb"] += mb
        node["live"] = live.get(worker.node_id, 0)
    return usage


async def _run(rollouts: int, per_job: int, init_workers: int, ray_nodes: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # before Ray starts: its workers inherit it
    me = psutil.Process(os.getpid())
    with _ray_cluster(ray_nodes) as address:
        await _measure(me, rollouts, per_job, init_workers, address)
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


async def _measure(me: psutil.Process, rollouts: int, per_job: int, init_workers: int, address: str | None) -> None:
    async with ModelServerProcess(standin_argv(SCRIPT, hold=True)) as model:
        with TemporaryDirectory() as tmp:
            # the arithmetic task, with a sandbox lifetime that outlasts ramping up thousands of them
            task = load_task("math/arithmetic")
            task.limits.wall_clock_s = 3600
            task_file = Path(tmp) / "scale-task.yaml"
            task_file.write_text(yaml.safe_dump(task.model_dump(mode="json")))
            pipeline = PipelineConfig(
                init=StageConfig(workers=init_workers, deadline_s=600),
                run=StageConfig(workers=rollouts, deadline_s=3600),
                eval=StageConfig(workers=16),
                max_live_sandboxes=rollouts,
            )
            settings = ServiceSettings(
                port=0, store=Path(tmp) / "jobs.db", pipeline=pipeline, max_n=per_job, tasks=[str(task_file)],
                llm_pool=LLMPoolConfig(max_connections=rollouts + 64, health_interval_s=0),
            )
            ray = RaySettings(address=address, sandbox_slots_per_worker=rollouts) if address else RaySettings()
            config = ServiceConfig(
                service=settings, model=ModelConfig(kind="remote", addresses=[model.base_url], served_model_name="standin"),
                ray=ray,
            )
            async with run_service(config) as svc, RolloutClient(svc.url) as client, httpx.AsyncClient() as control:
                rss_before, fds_before = me.memory_info().rss / 2**20, me.num_fds()
                nodes_before = _node_usage(svc)
                started = time.perf_counter()
                jobs = [
                    await client.submit(JobRequest(instance=ROW, n=min(per_job, rollouts - i)))
                    for i in range(0, rollouts, per_job)
                ]
                stats_url = model.base_url.removesuffix("/v1") + "/control/stats"
                ended = svc.orchestrator.finished_rollouts  # before reaching the model (a sandbox that did not start)
                while (await control.get(stats_url)).json()["waiting"] + sum(ended.values()) < rollouts:
                    await asyncio.sleep(0.5)
                ramp_s = time.perf_counter() - started
                rss_live = me.memory_info().rss / 2**20
                fds_live = me.num_fds()
                n_sandbox_procs, sandbox_mb = _tree_rss_mb(me, {"bwrap", "bash"})
                status = svc.orchestrator.status()
                print(f"{rollouts} live rollouts after {ramp_s:.1f} s: all waiting on the model "
                      f"(run stage active {status['stages']['run']['active']}, {status['live_rollouts']} live)")
                print(f"service process: RSS {rss_before:.0f} MB idle -> {rss_live:.0f} MB live, "
                      f"{(rss_live - rss_before) * 1024 / rollouts:.1f} KB per rollout")
                print(f"service file descriptors: {fds_before} idle -> {fds_live} live, "
                      f"{(fds_live - fds_before) / rollouts:.2f} per rollout")
                print(f"sandboxes: {n_sandbox_procs} processes, {sandbox_mb:.0f} MB unique memory, "
                      f"{sandbox_mb * 1024 / rollouts:.0f} KB per rollout")
                for node, now in _node_usage(svc).items():
                    was, n = nodes_before.get(node, now), max(now["live"], 1)
                    print(f"ray node {node[:12]}: {now['live']:.0f} live rollouts; worker RSS {was['rss_mb']:.0f} -> "
                          f"{now['rss_mb']:.0f} MB, {(now['rss_mb'] - was['rss_mb']) * 1024 / n:.1f} KB per rollout; "
                          f"fds {was['fds']:.0f} -> {now['fds']:.0f}, {(now['fds'] - was['fds']) / n:.2f} per rollout; "
                          f"sandboxes {now['procs']:.0f} processes, {now['sandbox_mb'] * 1024 / n:.0f} KB per rollout")
                await control.post(model.base_url.removesuffix("/v1") + "/control/release")
                results = [t for job in jobs for t in (await client.wait(job)).results]
                total_s = time.perf_counter() - started
                errors = [t for t in results if t.critical_error]
                left, _ = _tree_rss_mb(me, {"bwrap", "bash"})
                print(f"finished: {len(results)} rollouts in {total_s:.1f} s, {len(errors)} errors, "
                      f"mean reward {sum(t.reward for t in results) / len(results):.2f}, sandbox processes left {left}")
                if errors:
                    print(f"first error: {errors[0].critical_error}: {errors[0].error}")
    where = f" across {len(nodes_before)} Ray nodes" if address else ""
    print(f"scale: {rollouts} concurrent live rollouts{where}, {len(errors)} errors, "
          f"{(rss_live - rss_before) * 1024 / rollouts:.1f} KB service RSS and {(fds_live - fds_before) / rollouts:.2f} fds per rollout")


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="prorl bench scale")
    parser.add_argument("--rollouts", type=int, default=2000)
    parser.add_argument("--per-job", type=int, default=100, help="samples per job")
    parser.add_argument("--init-workers", type=int, default=32)
    parser.add_argument("--ray-nodes", type=int, default=0, help="run on a local Ray cluster of this many nodes")
    args = parser.parse_args(argv)
    asyncio.run(_run(args.rollouts, args.per_job, args.init_workers, args.ray_nodes))
