"""GRPO group forking on the Ray path: a job's group inits once on one rollout worker and is forked there, with the
same trajectories as one init per sample in-process. A one-node Ray cluster started by the test (Ray's own
`cluster_utils.Cluster`, its address given: other Ray instances on the machine are not joined), real bubblewrap
sandboxes under the worker actors, the stand-in model server."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from ray.cluster_utils import Cluster
from sandbox_helpers import sandbox_dirs_of, sandboxes_under, wait_until
from service_helpers import comparable
from standin_helpers import ROW, STAGED_SCRIPT, running_standin

from nemo_gym_prorl.cluster.settings import RaySettings
from nemo_gym_prorl.contracts.job import JobRequest
from nemo_gym_prorl.launch.runtime import ModelConfig, ServiceConfig, ServiceSettings
from nemo_gym_prorl.launch.serve import run_service
from nemo_gym_prorl.service.client import RolloutClient


@pytest.fixture(scope="module")
def standin() -> Iterator[str]:
    yield from running_standin(STAGED_SCRIPT)


@pytest.fixture(scope="module")
def slow_standin() -> Iterator[str]:
    yield from running_standin(STAGED_SCRIPT, latency_s=60.0)  # runs that last until the test cancels them


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    head = {"num_cpus": 2, "object_store_memory": 80 << 20, "include_dashboard": False}
    cluster = Cluster(initialize_head=True, head_node_args=head)
    try:
        cluster.wait_for_nodes()
        yield cluster
    finally:
        cluster.shutdown()


def service_config(model_url: str, store: Path, fork_groups: bool, ray: RaySettings) -> ServiceConfig:
    model = ModelConfig(kind="remote", addresses=[model_url], served_model_name="standin", tool_call_format="codeact")
    settings = ServiceSettings(port=0, store=store)
    settings.pipeline.fork_groups = fork_groups
    return ServiceConfig(service=settings, model=model, ray=ray)


def worker_pid(sandbox_id: str) -> int:
    """The pid in a bwrap sandbox's trace id (bwrap-<host>-<pid>-<n>): the process that held it."""
    return int(sandbox_id.rsplit("-", 2)[1])


async def test_a_group_on_ray_inits_once_and_is_forked_on_one_worker(standin: str, cluster: Cluster) -> None:
    job = JobRequest(instance=ROW, n=4, sampling_params={"seed": 7, "temperature": 1.0}, job_id="group")
    with tempfile.TemporaryDirectory(prefix="prorl-ray-fork-test-") as tmp:
        async with run_service(service_config(standin, Path(tmp) / "local.db", False, RaySettings())) as local:
            async with RolloutClient(local.url) as client:
                plain = (await client.wait(await client.submit(job))).results
        ray = RaySettings(address=cluster.address, node_poll_s=0.5)
        async with run_service(service_config(standin, Path(tmp) / "ray.db", True, ray)) as on_ray:
            async with RolloutClient(on_ray.url) as client:
                forked = (await client.wait(await client.submit(job))).results
                stats = (await client.status())["fork_groups"]
            workers = {worker_pid(next(s for s in t.timing.spans if s.name == "run").attributes["sandbox_id"])
                       for t in forked}  # fmt: skip
            (pid,) = workers  # the group's init and its four forks on one worker
            assert sandboxes_under(pid) == [] and sandbox_dirs_of(pid) == []
    assert [t.critical_error for t in forked] == [None] * 4, [t.error for t in forked]
    assert [comparable(t) for t in forked] == [comparable(t) for t in plain]
    assert stats == {"groups": 1, "inits": 1, "forks": 4}
    for t in forked:
        assert [s.name for s in t.timing.spans[:3]] == ["group_init", "fork", "init"]


async def test_cancelling_forked_samples_on_ray_closes_their_forks_on_the_worker(
    slow_standin: str, cluster: Cluster
) -> None:
    with tempfile.TemporaryDirectory(prefix="prorl-ray-fork-test-") as tmp:
        ray = RaySettings(address=cluster.address, node_poll_s=0.5)
        async with run_service(service_config(slow_standin, Path(tmp) / "ray.db", True, ray)) as svc:
            fleet = svc.orchestrator.remote
            assert fleet is not None and len(fleet.ready_workers()) == 2

            def slots_by_worker() -> dict[int, int]:
                return {w.info["pid"]: w.live for w in fleet.ready_workers()}

            async with RolloutClient(svc.url) as client:
                job = await client.submit(JobRequest(instance=ROW, n=3, job_id="cut"))
                await wait_until(lambda: sorted(slots_by_worker().values()) == [0, 3], timeout=120)
                (pid,) = [p for p, n in slots_by_worker().items() if n == 3]  # the three forks on one worker
                await wait_until(lambda: len(sandboxes_under(pid)) == 3, timeout=60)
                first = svc.orchestrator._live[job].rollouts[0]  # the sample whose worker ran the group's init
                await svc.orchestrator.pipeline.cancel(first)
                assert slots_by_worker()[pid] == 2
                await wait_until(lambda: len(sandboxes_under(pid)) == 2, timeout=30)  # its fork closed; not theirs
                view = await client.cancel(job)
                assert [s["live"] for s in fleet.status()["nodes"].values()] == [0]  # every sandbox slot given back
                await wait_until(lambda: sandboxes_under(pid) == [], timeout=30)
                assert sandbox_dirs_of(pid) == []
    assert [t.critical_error for t in view.results] == ["cancelled"] * 3
