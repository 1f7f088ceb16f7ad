"""A harness task runs wherever a task runs: `prorl rollout`, the service's jobs (a GRPO group, each sample with its
own sandbox and proxy) and Gym's `/run`, all through the service's pipeline, at once on one service (`prorl
rollout` as its client: in-process it runs the same runtime). mini-swe-agent against the stand-in model (its action
format, deterministically) on the offline SWE suite's first instance (its patch graded) and on arithmetic's (the
answer it left in answer.txt graded), in bubblewrap sandboxes."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from standin_helpers import MINI_SWE_AGENT_SCRIPT, running_standin

from nemo_gym_prorl.contracts.job import JobRequest
from nemo_gym_prorl.contracts.task import load_task
from nemo_gym_prorl.contracts.trajectory import TOKEN_FIELDS, Trajectory
from nemo_gym_prorl.envs.dataset import load_instances
from nemo_gym_prorl.gym.rows import TASK_KEY
from nemo_gym_prorl.launch.runtime import ModelConfig, ServiceConfig, ServiceSettings
from nemo_gym_prorl.launch.serve import run_service
from nemo_gym_prorl.service.client import RolloutClient, ServiceError
from nemo_gym_prorl.service.store import JobStore

pytestmark = pytest.mark.slow

TASK = "swe/offline_mini_swe_agent_harness"
MATH_TASK = "math/arithmetic_mini_swe_agent_harness"  # its answer from the file the harness leaves (answer.txt)
TOKEN = "harness-s3cret"


@pytest.fixture(scope="module")
def mini_model(rootfs: Path) -> Iterator[str]:
    yield from running_standin(MINI_SWE_AGENT_SCRIPT)


def row(task: str = TASK) -> dict[str, Any]:
    return load_instances(load_task(task).dataset, limit=1)[0].data


def assert_run_by_the_harness(trajectory: Trajectory) -> None:
    """mini-swe-agent's two calls as one contiguous segment with every token field, graded."""
    assert trajectory.critical_error is None, trajectory.error
    assert trajectory.finish == "finish" and trajectory.messages == []
    (segment,) = trajectory.segments
    assert len(segment) == 2 and all(turn[field] for turn in segment for field in TOKEN_FIELDS)
    assert trajectory.evaluation and trajectory.mask_reason() is None


def assert_solved_by_the_harness(trajectory: Trajectory) -> None:
    assert_run_by_the_harness(trajectory)
    assert "harness_was_here.txt" in (trajectory.submission or {}).get("patch", "")


async def test_prorl_rollout_a_service_job_and_gyms_run_each_run_a_harness_task(mini_model: str, tmp_path: Path) -> None:
    config = ServiceConfig(
        service=ServiceSettings(port=0, tasks=[TASK, MATH_TASK], store=tmp_path / "jobs.db", token=TOKEN),
        model=ModelConfig(
            kind="remote", addresses=[mini_model], served_model_name="standin", generation_mode="tokens"
        ),
    )
    gym_row = row() | {"responses_create_params": {"input": "the row's own prompt"}, TASK_KEY: TASK}
    output = tmp_path / "rollouts.jsonl"
    async with run_service(config) as service, RolloutClient(service.url, TOKEN) as client:
        cli = await asyncio.create_subprocess_exec(
            str(Path(sys.executable).with_name("prorl")), "rollout", f"task={TASK}", "limit=1",
            f"service.url={service.url}", f"service.token={TOKEN}", f"output={output}",
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, cwd=tmp_path,
        )  # fmt: skip
        auth = {"authorization": f"Bearer {TOKEN}"}
        async with httpx.AsyncClient(base_url=service.url, headers=auth, timeout=300) as http:
            job_id = await client.submit(JobRequest(task=MATH_TASK, instance=row(MATH_TASK), n=2))
            job, run, (printed, _) = await asyncio.gather(
                client.wait(job_id), http.post("/run", json=gym_row), cli.communicate()
            )
    assert cli.returncode == 0, printed.decode()[-2000:]
    (line,) = output.read_text().splitlines()
    assert_solved_by_the_harness(Trajectory.model_validate_json(line))
    assert len(job.results) == 2  # a GRPO group: each sample its own sandbox and proxy
    for trajectory in job.results:
        assert_run_by_the_harness(trajectory)
        assert trajectory.submission == {"answer": "-6"} and trajectory.reward == 1.0
    body = run.raise_for_status().json()
    assert body["critical_error"] is None and body["mask_sample"] is False, body["failure_reason"]
    assert body["num_segments"] == 1 and body["num_turns"] == 2 and body["delivered_fraction"] == 1.0
    assert [item["generation_token_ids"] for item in body["response"]["output"] if "generation_token_ids" in item]


async def test_a_service_without_the_policys_tokenizer_refuses_a_harness_job_naming_why(
    mini_model: str, tmp_path: Path
) -> None:
    """A new job is refused; one the store holds from a service that could run it (recovered at start) fails."""
    store = JobStore(tmp_path / "jobs.db")
    try:
        store.add_job("recovered", JobRequest(task=TASK, instance=row(), n=1).model_dump(mode="json"), 1)
        store.set_state("recovered", "running")
    finally:
        store.close()
    config = ServiceConfig(
        service=ServiceSettings(port=0, tasks=[TASK], store=tmp_path / "jobs.db"),
        model=ModelConfig(kind="remote", addresses=[mini_model], served_model_name="standin", generation_mode="chat"),
    )
    async with run_service(config) as service, RolloutClient(service.url) as client:
        with pytest.raises(ServiceError) as refused:
            await client.submit(JobRequest(task=TASK, instance=row()))
        recovered = await client.get("recovered")
    assert recovered.state == "done" and [t.critical_error for t in recovered.results] == ["cancelled"]
    assert "needs the policy's tokenizer" in recovered.results[0].error
    assert refused.value.status == 422 and refused.value.field == "task"
    assert "needs the policy's tokenizer: model.generation_mode=tokens" in str(refused.value)
