"""The service on a real Ray cluster: a head (no CPUs: no workers there) and two worker nodes started on this
machine by Ray's own `cluster_utils.Cluster`, each with its own raylet and resources. Rollouts run in real
bubblewrap sandboxes under the nodes' worker actors, against the stand-in model (a real process, scripted).

One cluster and one Ray-path service for the module; the wedged-worker test and the node-loss test run last (one
stops a worker's process, the other kills a node and adds one).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import glob
import logging
import os
import signal
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import psutil
import pytest
import pytest_asyncio
import ray
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from ray.cluster_utils import Cluster
from sandbox_helpers import alive, sandbox_dirs_of, sandbox_owner, sandboxes_under, wait_until
from service_helpers import prorl_serve
from standin_helpers import ROW, SCRIPT, running_standin

from nemo_gym_prorl.cluster.settings import RaySettings
from nemo_gym_prorl.contracts.job import Deadlines, JobRequest
from nemo_gym_prorl.contracts.trajectory import TOKEN_FIELDS, Trajectory
from nemo_gym_prorl.launch.runtime import ModelConfig, ServiceConfig, ServiceSettings
from nemo_gym_prorl.launch.serve import RunningService, run_service
from nemo_gym_prorl.sandbox.bwrap import TEMP_PREFIX
from nemo_gym_prorl.service.client import RolloutClient
from nemo_gym_prorl.service.pipeline import Rollout
from nemo_gym_prorl.telemetry import tracing

pytestmark = pytest.mark.asyncio(loop_scope="module")

LATENCY_S = 1.5  # each model turn: long enough to act while rollouts are live, short enough to keep the module quick
UNRESPONSIVE_S = 10  # the head gives up on a worker that has not answered its ping for this long
NODE = {"num_cpus": 1, "object_store_memory": 80 << 20}


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    cluster = Cluster(
        initialize_head=True, head_node_args={"num_cpus": 0, "object_store_memory": 80 << 20, "include_dashboard": False}
    )
    try:
        for _ in range(2):
            cluster.add_node(**NODE)
        cluster.wait_for_nodes()
        yield cluster
    finally:
        cluster.shutdown()


@pytest.fixture(scope="module")
def model() -> Iterator[str]:
    yield from running_standin(SCRIPT, latency_s=LATENCY_S)


def config(model_url: str, store: Path, ray: RaySettings) -> ServiceConfig:
    model = ModelConfig(kind="remote", addresses=[model_url], served_model_name="standin", tool_call_format="codeact")
    return ServiceConfig(service=ServiceSettings(port=0, store=store), model=model, ray=ray)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def svc(cluster: Cluster, model: str) -> AsyncIterator[RunningService]:
    with tempfile.TemporaryDirectory(prefix="prorl-ray-test-") as tmp:
        ray = RaySettings(
            address=cluster.address, node_poll_s=0.5, worker_ping_interval_s=0.5, worker_unresponsive_s=UNRESPONSIVE_S
        )
        async with run_service(config(model, Path(tmp) / "ray.db", ray)) as running:
            yield running


def fleet(svc: RunningService):  # type: ignore[no-untyped-def]
    assert svc.orchestrator.remote is not None
    return svc.orchestrator.remote


def nodes_with_live_rollouts(svc: RunningService) -> set[str]:
    return {node for node, s in fleet(svc).status()["nodes"].items() if s["live"]}


def sandboxes_by_node(svc: RunningService) -> dict[str, list[psutil.Process]]:
    found: dict[str, list[psutil.Process]] = {}
    for worker in fleet(svc).ready_workers():
        found.setdefault(worker.node_id, []).extend(sandboxes_under(worker.info["pid"]))
    return found


def rollouts_of(svc: RunningService, job_id: str) -> list[Rollout]:
    return svc.orchestrator._live[job_id].rollouts


def tokens(trajectory: Trajectory) -> list[dict]:
    return [{k: m.get(k) for k in (*TOKEN_FIELDS, "role", "content")} for m in trajectory.messages]


async def test_ray_rollouts_spread_over_both_nodes_and_match_in_process_ones(svc: RunningService, model: str) -> None:
    requests = [JobRequest(instance=ROW, n=2, job_id=f"same-{i}", sampling_params={"seed": 11}) for i in range(2)]
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    async with RolloutClient(svc.url) as client:
        with tracing.traced_by(provider):
            jobs = [await client.submit(r) for r in requests]
            await wait_until(lambda: len([s for s in sandboxes_by_node(svc).values() if s]) == 2, timeout=120)
            on_ray = [t for job in jobs for t in (await client.wait(job)).results]
    with tempfile.TemporaryDirectory(prefix="prorl-ray-test-") as tmp:
        async with run_service(config(model, Path(tmp) / "local.db", RaySettings())) as local:
            async with RolloutClient(local.url) as client:
                jobs = [await client.submit(r) for r in requests]
                in_process = [t for job in jobs for t in (await client.wait(job)).results]
    assert [t.critical_error for t in on_ray] == [None] * 4, [t.error for t in on_ray]
    assert [t.trajectory_id for t in on_ray] == [t.trajectory_id for t in in_process]
    assert [tokens(t) for t in on_ray] == [tokens(t) for t in in_process]
    assert [(t.reward, t.finish, t.num_tool_calls) for t in on_ray] == [
        (t.reward, t.finish, t.num_tool_calls) for t in in_process
    ]
    assert any(m.get("generation_token_ids") for m in on_ray[0].messages)
    traces: dict[int, list[ReadableSpan]] = {}
    for span in exporter.get_finished_spans():
        traces.setdefault(span.context.trace_id, []).append(span)
    by_trajectory = {next(s for s in spans if s.name == "rollout").attributes["trajectory_id"]: spans
                     for spans in traces.values()}  # fmt: skip
    for trajectory in on_ray:
        check_worker_spans(trajectory, by_trajectory[trajectory.trajectory_id], model)


def check_worker_spans(trajectory: Trajectory, spans: list[ReadableSpan], model_url: str) -> None:
    """The model requests and tool call a worker made are in the rollout's trace under its run stage, as an
    in-process rollout's are (test_tracing.py): on the trajectory, timed from submission, and as OpenTelemetry
    spans, with the backend and sandbox they ran on."""
    recorded = trajectory.timing.spans
    assert [s.name for s in recorded] == ["init", "model", "tool", "model", "run", "eval"]
    run = next(s for s in recorded if s.name == "run")
    assert run.attributes["sandbox_backend"] == "bwrap" and run.attributes["sandbox_id"]
    models = [s for s in recorded if s.name == "model"]
    (tool,) = [s for s in recorded if s.name == "tool"]
    for call in (*models, tool):
        assert run.start_s <= call.start_s and call.start_s + call.duration_s <= run.start_s + run.duration_s
    assert models[0].start_s + models[0].duration_s <= tool.start_s <= tool.start_s + tool.duration_s <= models[1].start_s
    turns = trajectory.assistant_turns()
    assert [m.attributes["turn"] for m in models] == [0, 1]
    assert [m.attributes["generated_tokens"] for m in models] == [len(t["generation_token_ids"]) for t in turns]
    assert all(m.attributes["backend"] == model_url and m.attributes["attempts"] == 1 for m in models)
    assert tool.attributes["tool"] == "bash" and tool.attributes["finished"] is False
    assert {k: tool.attributes[k] for k in ("sandbox_id", "sandbox_backend")} == {
        k: run.attributes[k] for k in ("sandbox_id", "sandbox_backend")
    }

    (root,) = [s for s in spans if s.name == "rollout"]
    (otel_run,) = [s for s in spans if s.name == "run"]
    assert otel_run.parent.span_id == root.context.span_id
    exported = sorted((s for s in spans if s is not root), key=lambda s: s.start_time)
    assert sorted(s.name for s in exported) == sorted(s.name for s in recorded)
    for mine, theirs in zip(sorted(recorded, key=lambda s: s.start_s), exported, strict=True):
        assert mine.start_s == pytest.approx((theirs.start_time - root.start_time) / 1e9, abs=1e-6)
        assert mine.duration_s == pytest.approx((theirs.end_time - theirs.start_time) / 1e9, abs=1e-6)
        assert mine.attributes == dict(theirs.attributes)
        if theirs.name in ("model", "tool"):
            assert theirs.parent.span_id == otel_run.context.span_id


async def test_cancel_and_deadlines_reach_rollouts_on_worker_nodes(svc: RunningService, model: str) -> None:
    stats = model.removesuffix("/v1") + "/control/stats"
    async with RolloutClient(svc.url) as client, httpx.AsyncClient(trust_env=False) as http:
        before = (await http.get(stats)).json()["requests"]
        timed = await client.submit(JobRequest(instance=ROW, deadlines=Deadlines(run_s=1.0)))
        cancelled = await client.submit(JobRequest(instance=ROW, n=2))
        async with asyncio.timeout(120):  # each rollout's first model request is out (the timed one makes one only)
            while (await http.get(stats)).json()["requests"] - before < 3:
                await asyncio.sleep(0.05)
        view = await client.cancel(cancelled)
        assert view.state == "cancelled" and {t.critical_error for t in view.results} == {"cancelled"}
        [trajectory] = (await client.wait(timed)).results
    assert trajectory.critical_error == "timeout", trajectory.error
    assert "run stage ran past its deadline of 1 s" in trajectory.error
    assert trajectory.messages[:2] and trajectory.timing.run < LATENCY_S + 5
    for cut_short in (*view.results, trajectory):
        check_cut_short_run_spans(cut_short)
    await wait_until(lambda: not any(sandboxes_by_node(svc).values()), timeout=30)


def check_cut_short_run_spans(trajectory: Trajectory) -> None:
    """A run cancelled (or timed out) on its worker keeps the model requests and tool calls it made until then, as
    an in-process one does: inside its run stage, with its sandbox, one finished model span per assistant turn kept
    (the interrupted request is the one that says an error)."""
    recorded = trajectory.timing.spans
    names = [s.name for s in recorded]
    assert names[0] == "init" and names[-1] == "run" and set(names[1:-1]) <= {"model", "tool"}, names
    run = recorded[-1]
    assert run.attributes["sandbox_backend"] == "bwrap" and run.attributes["sandbox_id"]
    calls = recorded[1:-1]
    models = [s for s in calls if s.name == "model"]
    assert models and models[0].attributes["turn"] == 0, names
    for call in calls:
        assert run.start_s <= call.start_s and call.start_s + call.duration_s <= run.start_s + run.duration_s
    answered = [m for m in models if "error" not in m.attributes]
    assert [m.attributes["generated_tokens"] for m in answered] == [
        len(t["generation_token_ids"]) for t in trajectory.assistant_turns()
    ]


async def test_a_weight_sync_reaches_every_worker_and_holds_their_deadlines(svc: RunningService) -> None:
    sync_s, run_s = 6.0, 2 * LATENCY_S + 2  # two model turns fit the run deadline; the sync does not
    async with RolloutClient(svc.url) as client:
        await client.pause_llm()  # the trainer starts syncing weights
        jobs = [await client.submit(JobRequest(instance=ROW, deadlines=Deadlines(run_s=run_s))) for _ in range(2)]
        async with asyncio.timeout(120):
            while await fleet(svc).llm_waiting() < 2:  # the first turns wait on both nodes' workers
                await asyncio.sleep(0.05)
        await asyncio.sleep(sync_s)  # the sync itself, longer than the run deadline
        await client.resume_llm(policy_version=5)
        results = [t for job in jobs for t in (await client.wait(job)).results]
    assert [t.critical_error for t in results] == [None, None], [t.error for t in results]
    assert [(t.first_policy_version, t.last_policy_version) for t in results] == [(5, 5)] * 2  # the new weights'
    assert all(t.timing.queued >= sync_s and t.timing.run < run_s for t in results), [t.timing for t in results]


async def test_local_workers_start_a_ray_of_their_own_beside_another(svc: RunningService, model: str) -> None:
    """`prorl serve ray.local_workers=N` on a machine where a Ray already runs (here: this module's cluster) starts
    its own, with its own node, instead of joining that one (which failed: ray.init then refuses num_cpus); stopped,
    it leaves none of its Ray processes behind. (`svc`: this process is connected to the module's cluster.)"""
    with tempfile.TemporaryDirectory(prefix="prorl-ray-local-") as tmp:
        overrides = ("ray.local_workers=1", "ray.object_store_mb=80")
        async with prorl_serve(model, Path(tmp) / "jobs.db", *overrides, start_timeout_s=300) as (url, process):
            async with RolloutClient(url) as client:
                nodes = (await client.status())["workers"]["nodes"]
                assert len(nodes) == 1 and not set(nodes) & {n["NodeID"] for n in ray.nodes()}, nodes
                view = await client.wait(await client.submit(JobRequest(instance=ROW, n=2)))
            assert [t.reward for t in view.results] == [1.0, 1.0], [t.error for t in view.results]
            its_processes = psutil.Process(process.pid).children(recursive=True)
        assert process.returncode == 0
        _, alive = psutil.wait_procs(its_processes, timeout=60)
        assert alive == [], alive


async def test_a_wedged_worker_is_killed_its_rollouts_run_again_and_a_new_one_takes_its_place(
    svc: RunningService, caplog: pytest.LogCaptureFixture
) -> None:
    """A worker whose process is stopped (SIGSTOP) is alive for Ray. The head's pings find it silent: it is killed
    and counted lost, its rollouts run again on the other node (one that had used its re-run already ends with a
    critical error saying why, and keeps what the head has of it: its prompt), a rollout cancelled while waiting on
    it ends (here
    its run deadline passes on the head meanwhile: the cancel's close to the worker, shielded, is cancelled again
    before the worker's loss fails it), its sandboxes and their leftovers go, and a new worker takes its node. No
    task's exception goes unretrieved (asyncio would log "Task exception was never retrieved"; it did before the
    shielded close retrieved it)."""
    async with RolloutClient(svc.url) as client:
        jobs = [await client.submit(JobRequest(instance=ROW, n=2, job_id=f"wedged-{i}")) for i in range(2)]
        doomed = await client.submit(JobRequest(instance=ROW, job_id="wedged-cancel", deadlines=Deadlines(run_s=6)))
        [cancelled] = rollouts_of(svc, doomed)
        await wait_until(lambda: cancelled.trajectory.messages, timeout=120)  # started: its run call is out to its worker
        victim = cancelled.env.worker
        pid, node = victim.info["pid"], victim.node_id
        moved = [r for job in jobs for r in rollouts_of(svc, job) if r.env.worker is victim]
        assert len(moved) >= 2, "the test needs rollouts of the other jobs on the stopped worker"
        spent = moved[0].trajectory.trajectory_id
        moved[0].env.losses = fleet(svc).settings.max_reruns  # as if its worker had been lost once before
        sandboxes, dirs = sandboxes_under(pid), sandbox_dirs_of(pid)
        assert sandboxes and dirs
        os.kill(pid, signal.SIGSTOP)
        try:
            view = await client.cancel(doomed)  # its close waits on the stopped worker until that is killed
            views = [await client.wait(job) for job in jobs]
            await wait_until(lambda: not psutil.pid_exists(pid) or psutil.Process(pid).status() == "zombie", 60)
        finally:
            with contextlib.suppress(ProcessLookupError):  # the test failed before the head killed it: resume it
                os.kill(pid, signal.SIGCONT)
    assert view.state == "cancelled" and [t.critical_error for t in view.results] == ["cancelled"]
    results = {t.trajectory_id: t for v in views for t in v.results}
    assert sorted(results) == ["wedged-0:0", "wedged-0:1", "wedged-1:0", "wedged-1:1"]
    lost = results.pop(spent)
    assert [t.critical_error for t in results.values()] == [None] * 3, [t.error for t in results.values()]
    assert lost.critical_error in ("init", "run", "eval") and lost.finish == "error", lost.error
    for said in (f"worker {victim.name} on node {node[:12]}", f"unresponsive for {UNRESPONSIVE_S} s", "lost 2 time"):
        assert said in lost.error, lost.error
    whole = next(iter(results.values())).messages  # the head has its prompt; its turns were on the lost worker
    assert lost.messages and lost.messages == whole[: len(lost.messages)] and not lost.assistant_turns()
    for job in jobs:
        assert svc.orchestrator.store.result_samples(job) == {0, 1}
    reruns = [r.getMessage() for r in caplog.records if "running it again" in r.getMessage()]
    for trajectory_id in [r.trajectory.trajectory_id for r in moved[1:]]:  # each said why, and ran again
        [said] = [m for m in reruns if m.startswith(f"rollout {trajectory_id}:")]
        assert f"worker {victim.name} on node {node[:12]}" in said and f"unresponsive for {UNRESPONSIVE_S} s" in said
    await wait_until(lambda: not alive(sandboxes), timeout=30)  # they died with their worker
    await wait_until(lambda: not any(os.path.exists(d) for d in dirs), timeout=120)  # swept on its node once it died
    await wait_until(lambda: any(w.node_id == node for w in fleet(svc).ready_workers()), timeout=180)  # its successor
    assert victim not in fleet(svc).workers and fleet(svc).status()["lost_workers"] >= 1
    gc.collect()  # an unretrieved task exception is logged when the task is collected
    unretrieved = [
        r.getMessage() for r in caplog.records
        if r.levelno >= logging.ERROR and ("never retrieved" in r.getMessage() or "Unhandled error" in r.getMessage())
    ]  # fmt: skip  # asyncio's word for a task's, Ray's for a call's
    assert not unretrieved, unretrieved


async def test_a_worker_node_killed_mid_job_loses_no_result_leaves_no_sandbox_and_comes_back(
    svc: RunningService, cluster: Cluster
) -> None:
    async with RolloutClient(svc.url) as client:
        jobs = [await client.submit(JobRequest(instance=ROW, n=2, job_id=f"kill-{i}")) for i in range(2)]
        await wait_until(lambda: len([s for s in sandboxes_by_node(svc).values() if s]) == 2, timeout=120)
        victim_id, sandboxes = next((node, s) for node, s in sandboxes_by_node(svc).items() if s)
        dirs = {d for d in glob.glob(os.path.join(tempfile.gettempdir(), TEMP_PREFIX + "*"))}
        workers = [w.info["pid"] for w in fleet(svc).ready_workers() if w.node_id == victim_id]
        victim = next(n for n in cluster.list_all_nodes() if n.node_id == victim_id)
        cluster.remove_node(victim, allow_graceful=False)
        views = [await client.wait(job) for job in jobs]
        await wait_until(lambda: not alive(sandboxes), timeout=30)  # they die with their worker
        assert fleet(svc).status()["lost_workers"] >= 1

        results = [t for view in views for t in view.results]
        assert [t.critical_error for t in results] == [None] * 4, [t.error for t in results]
        assert sorted(t.trajectory_id for t in results) == ["kill-0:0", "kill-0:1", "kill-1:0", "kill-1:1"]
        for job in jobs:
            assert svc.orchestrator.store.result_samples(job) == {0, 1}
        assert not any(psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie" for pid in workers)

        comeback = cluster.add_node(**NODE)  # a node joining (or one coming back) gets workers and rollouts
        await wait_until(lambda: comeback.node_id in fleet(svc).status()["nodes"], timeout=180)
        jobs = [await client.submit(JobRequest(instance=ROW, n=2)) for _ in range(2)]  # a group per node
        await wait_until(lambda: comeback.node_id in nodes_with_live_rollouts(svc), timeout=60)
        assert {t.critical_error for job in jobs for t in (await client.wait(job)).results} == {None}
    # its new worker swept what the killed sandboxes left on the machine
    left = {d for d in glob.glob(os.path.join(tempfile.gettempdir(), TEMP_PREFIX + "*"))} & dirs
    assert not [d for d in left if _owner_dead(d)], left


def _owner_dead(root: str) -> bool:
    pid = sandbox_owner(root)
    return pid is not None and not psutil.pid_exists(pid)
