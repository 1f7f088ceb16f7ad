"""The Slurm launch for real: scripts/slurm/prorl_ray.sbatch submitted to a Slurm cluster this module starts on this
machine from Debian's slurm-wlm and munge (tests/slurm_cluster.py: two slurmd nodes on the one host). The job starts
a Ray head and a second Ray node (on the allocation's second Slurm node, or beside the head on one Slurm node), then
`prorl serve ray.address=...`; the service answers with both Ray nodes' sandbox slots and runs a job in sandboxes on
the workers (bubblewrap, Apptainer); scancel, with rollouts live, leaves no process, mount or job folder behind.
"""

from __future__ import annotations

import asyncio
import re
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from sandbox_helpers import loop_devices_under, wait_until
from slurm_cluster import SlurmCluster, free_port, slurm_cluster
from standin_helpers import ROW, SCRIPT, running_standin

from nemo_gym_prorl.contracts.job import JobRequest
from nemo_gym_prorl.sandbox import disk
from nemo_gym_prorl.service.client import RolloutClient

ROOT = Path(__file__).resolve().parents[2]
SBATCH = ROOT / "scripts" / "slurm" / "prorl_ray.sbatch"
pytestmark = pytest.mark.slow
TOKEN = "slurm-test-token"
SLOTS_PER_WORKER = 3
SANDBOX_PROCESS = {"bwrap": "bwrap", "apptainer": "Apptainer runtime parent"}  # how a live sandbox shows in ps


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    with slurm_cluster(tmp_path_factory.mktemp("slurm"), nodes=2) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def model() -> Iterator[str]:
    yield from running_standin(SCRIPT)


@pytest.fixture(scope="module")
def stuck_model() -> Iterator[str]:
    """A stand-in that answers after an hour: rollouts sent to it stay live, in their sandboxes, until cancelled."""
    yield from running_standin(SCRIPT, latency_s=3600.0)


@pytest.fixture
def job_dir() -> Iterator[Path]:
    """The job's folder on the node (PRORL_JOB_DIR: Ray's session and the sandboxes' TMPDIR, with their disks):
    short, since Ray's socket paths must fit in 107 bytes (pytest's tmp_path is too deep)."""
    path = Path(tempfile.mkdtemp(prefix="prorl-slurm-"))
    yield path
    if path.exists():  # the job removes it; after a failed check, what it left (sandbox disks) goes here
        disk.unmount_under(path)
        shutil.rmtree(path, ignore_errors=True)


def mounts_under(path: Path) -> list[str]:
    with open("/proc/self/mountinfo") as mountinfo:
        return [line.split()[4] for line in mountinfo if line.split()[4].startswith(f"{path}/")]


def wait_for_url(cluster: SlurmCluster, job_id: str, output: Path, timeout_s: float = 300) -> str:
    """The URL the job prints once the service answers; fails with the job's output if it ends or never prints."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        text = output.read_text() if output.exists() else ""
        if match := re.search(r"^PRORL_SERVICE_URL=(\S+)$", text, re.MULTILINE):
            return match.group(1)
        state = cluster.job_state(job_id)
        assert state in ("PENDING", "CONFIGURING", "RUNNING"), f"job {state}:\n{text[-4000:]}"
        time.sleep(1)
    pytest.fail(f"no service URL after {timeout_s} s:\n{output.read_text()[-4000:]}")


async def wait_for_nodes(client: RolloutClient, count: int, timeout_s: float = 120) -> dict[str, dict[str, int]]:
    """/status's Ray nodes once `count` of them have workers (the head looks for nodes every ray.node_poll_s)."""
    async with asyncio.timeout(timeout_s):
        while len(nodes := (await client.status())["workers"]["nodes"]) < count:
            await asyncio.sleep(0.5)
    return nodes


def names(processes: list[psutil.Process]) -> list[str]:
    """What each process runs (its first words), "" for one that is gone."""
    found = []
    for process in processes:
        try:
            found.append(" ".join(process.cmdline()[:3]) or process.name())
        except psutil.Error:
            found.append("")
    return found


@pytest.mark.parametrize(
    ("sandbox", "slurm_nodes", "ray_nodes_per_host"),
    [("bwrap", 2, 1), ("apptainer", 1, 2)],  # srun across the allocation; two Ray nodes on one Slurm node
    ids=["bwrap-two-slurm-nodes", "apptainer-one-slurm-node"],
)
async def test_sbatch_serves_on_two_ray_nodes_and_scancel_leaves_no_process(
    sandbox: str,
    slurm_nodes: int,
    ray_nodes_per_host: int,
    request: pytest.FixtureRequest,
    cluster: SlurmCluster,
    model: str,
    stuck_model: str,
    job_dir: Path,
    tmp_path: Path,
) -> None:
    output = tmp_path / "job.out"
    backend = {}
    if sandbox == "apptainer":  # Apptainer installed and the default image built, as on an HPC node
        request.getfixturevalue("sif")
        backend = {"PRORL_APPTAINER": request.getfixturevalue("installed")}
    env = {
        **backend,
        "SANDBOX": sandbox,
        "PRORL_ROOT": str(ROOT),
        "PRORL_SERVICE_TOKEN": TOKEN,
        "PORT": str(free_port()),
        "RAY_PORT": str(free_port()),
        "RAY_NODES_PER_HOST": str(ray_nodes_per_host),
        "RAY_CPUS_PER_NODE": "1",
        "RAY_OBJECT_STORE_MB": "100",
        "PRORL_JOB_DIR": str(job_dir),
        "RUN_DIR": str(tmp_path / "run"),
        "WORKERS_PER_NODE": "1",
        "SLOTS_PER_WORKER": str(SLOTS_PER_WORKER),
        "MODEL_ADDRESSES": f"[{model}]",
        "SERVE_OVERRIDES": "model.served_model_name=standin model.tool_call_format=codeact",
    }
    job_id = cluster.sbatch(SBATCH, f"--nodes={slurm_nodes}", f"--output={output}", f"--chdir={tmp_path}", env=env)
    try:
        url = wait_for_url(cluster, job_id, output)
        assert (tmp_path / "run" / "service.url").read_text().strip() == url

        async with RolloutClient(url, TOKEN, timeout_s=120) as client:
            nodes = await wait_for_nodes(client, 2)
            assert [node["slots"] for node in nodes.values()] == [SLOTS_PER_WORKER, SLOTS_PER_WORKER]
            done = await client.wait(await client.submit(JobRequest(instance=ROW, n=2)))
            assert done.state == "done"
            outcomes = [(t.reward, t.critical_error) for t in done.results]
            assert outcomes == [(1.0, None), (1.0, None)], [t.error for t in done.results]

            await client.clear_llm_servers()  # the next rollouts wait on the stuck model (every worker's pool)
            await client.add_llm_server(stuck_model)
            await client.submit(JobRequest(instance=ROW, n=2))
            async with asyncio.timeout(60):
                while (await client.status())["stages"]["run"]["active"] < 2:
                    await asyncio.sleep(0.2)
            live = cluster.job_processes()
            started = names(live)
            raylets = [p for p, name in zip(live, started) if "raylet/raylet" in name]
            assert len(raylets) == 2, started  # one Ray node per Slurm node, or both on the one
            on = ["node1", "node2"] if slurm_nodes == 2 else ["node1", "node1"]
            assert sorted(cluster.node_of(p) for p in raylets) == on
            assert any("prorl serve" in name for name in started), started
            assert any(name.startswith(SANDBOX_PROCESS[sandbox]) for name in started), started  # the live rollouts
            assert loop_devices_under(job_dir)  # their disks (mounted only inside their sandboxes)

        cluster.run("scancel", job_id)
        gone, alive = psutil.wait_procs(live, timeout=3 * cluster.kill_wait_s + 30)
        assert names(alive) == []
        assert names(cluster.job_processes()) == []  # nothing started later either
        assert mounts_under(job_dir) == [] and not job_dir.exists()  # the sandboxes' disks and the job's folder
        await wait_until(lambda: not loop_devices_under(job_dir), timeout=30)  # the kernel lets go of them
        assert cluster.wait_ended(job_id) == "CANCELLED"
    finally:  # a failed check leaves no job running into the next test or the temp dirs' removal
        cluster.cancel(job_id)
        cluster.wait_ended(job_id)
