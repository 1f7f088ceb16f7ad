"""The rollout service's `/aggregate_metrics` over real HTTP: Gym's request and response models, Gym's numbers, and
a 4xx for what Gym's profiler cannot aggregate.

`gym eval run` calls it once the rollouts are written, with each `/run` verify response stripped of `response` and
`responses_create_params`. The model is the deterministic stand-in server (it always answers 42); sandboxes are
real bubblewrap sandboxes.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
from nemo_gym.base_resources_server import AggregateMetrics
from nemo_gym.reward_profile import compute_aggregate_metrics

from nemo_gym_prorl.launch.runtime import ModelConfig, ServiceConfig, ServiceSettings
from nemo_gym_prorl.launch.serve import run_service
from nemo_gym_prorl.models.launcher import ModelServerProcess
from nemo_gym_prorl.models.standin import standin_argv

SCRIPT = ["```bash\necho $((6 * 7))\n```", "\\boxed{42}"]
TOKEN = "s3cret"


def gym_row(task_index: int, answer: str) -> dict[str, Any]:
    question = "Calculate 6 * 7."
    return {
        "responses_create_params": {"input": [{"role": "user", "content": question}], "max_output_tokens": 64},
        "id": f"q{task_index}", "question": question, "answer": answer,
        "_ng_task_index": task_index, "_ng_rollout_index": 0,
    }  # fmt: skip


ROWS = [gym_row(0, "42"), gym_row(1, "41")]  # the stand-in's 42 is right for q0 only


def as_gym_sends_it(verify_response: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in verify_response.items() if k not in ("response", "responses_create_params")}


async def test_aggregate_metrics_are_gyms_over_the_verify_responses_of_run(tmp_path: Path) -> None:
    async with ModelServerProcess(standin_argv(SCRIPT)) as model:
        config = ServiceConfig(
            service=ServiceSettings(port=0, store=tmp_path / "service.db", token=TOKEN),
            model=ModelConfig(
                kind="remote", addresses=[model.base_url], served_model_name="standin", tool_call_format="codeact"
            ),
        )
        async with run_service(config) as svc:
            auth = {"authorization": f"Bearer {TOKEN}"}
            async with httpx.AsyncClient(base_url=svc.url, headers=auth, timeout=60) as http:
                runs = await asyncio.gather(*(http.post("/run", json=row) for row in ROWS))
                verify_responses = [as_gym_sends_it(run.raise_for_status().json()) for run in runs]
                answer = await http.post("/aggregate_metrics", json={"verify_responses": verify_responses})
                empty = await http.post("/aggregate_metrics", json={"verify_responses": []})
                unindexed = [{"reward": 1.0}, {"reward": 0.0}]  # two rollouts with the same (task, repeat) key
                malformed = await http.post("/aggregate_metrics", json={"verify_responses": unindexed})
            async with httpx.AsyncClient(base_url=svc.url) as anonymous:
                refused = await anonymous.post("/aggregate_metrics", json={"verify_responses": verify_responses})

    assert [v["reward"] for v in verify_responses] == [1.0, 0.0]
    assert answer.status_code == 200, answer.text
    metrics = AggregateMetrics.model_validate(answer.json())
    assert metrics.agent_metrics["mean/reward"] == 0.5 and metrics.key_metrics["mean/reward"] == 0.5
    assert metrics.agent_metrics["num_repeats"] == 1
    groups = sorted(metrics.group_level_metrics, key=lambda group: group["_ng_task_index"])
    assert [(g["_ng_task_index"], g["mean/reward"]) for g in groups] == [(0, 1.0), (1, 0.0)]
    assert answer.json() == compute_aggregate_metrics(verify_responses).model_dump(mode="json")  # as Gym's agents
    assert empty.status_code == 200 and AggregateMetrics.model_validate(empty.json()) == AggregateMetrics()
    assert malformed.status_code == 422 and "verify_responses" in malformed.json()["error"]["message"]
    assert refused.status_code == 401
