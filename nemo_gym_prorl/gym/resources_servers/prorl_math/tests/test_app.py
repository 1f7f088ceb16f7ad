"""What `gym env test --resources-server prorl_math` checks: Gym's verifier fixture, and the routes over a real
bubblewrap sandbox."""

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any
from unittest.mock import MagicMock

import httpx
import pytest
from nemo_gym.base_resources_server import ResourcesSeedSessionRequest
from nemo_gym.episode_types import EpisodeId, TaskId
from nemo_gym.server_utils import ServerClient
from nemo_gym.testing.session_conformance import check_resources_session_contract
from resources_servers.prorl_math.app import ProrlMathConfig, ProrlMathServer

from nemo_gym_prorl.gym.task_server import check_verifier_fixture, verifier_fixture

HERE = Path(__file__).parent
EXAMPLE_ROWS = [json.loads(line) for line in (HERE.parent / "data" / "example.jsonl").open()]


def make_server() -> ProrlMathServer:
    config = ProrlMathConfig(host="127.0.0.1", port=8080, entrypoint="", name="prorl_math")
    return ProrlMathServer(config=config, server_client=MagicMock(spec=ServerClient))


def response_with(*items: dict[str, Any]) -> dict[str, Any]:
    """A Gym (Responses API) response holding `items` as its output."""
    return {
        "id": "resp",
        "created_at": 0,
        "model": "m",
        "object": "response",
        "parallel_tool_calls": False,
        "tool_choice": "auto",
        "tools": [],
        "output": list(items),
    }


def assistant_message(text: str) -> dict[str, Any]:
    return {
        "id": "msg",
        "type": "message",
        "role": "assistant",
        "status": "completed",
        "content": [{"type": "output_text", "text": text, "annotations": []}],
    }


async def test_verifier_fixture_full_zero_malformed_and_determinism() -> None:
    await check_verifier_fixture(verifier_fixture(make_server, HERE / "verifier_cases.jsonl"))


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    """The app on this test's event loop (math-verify grades only on the main thread), lifespan included."""
    app = make_server().setup_webserver()
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://prorl-math") as c:
            yield c


async def test_tools_run_in_the_session_sandbox_and_the_finish_answer_is_graded(client: httpx.AsyncClient) -> None:
    row = EXAMPLE_ROWS[0]
    assert (await client.post("/seed_session", json=row)).status_code == 200
    bash = await client.post("/bash", json={"command": "echo hi && cat problem.txt"})
    assert bash.json()["output"] == f"hi\n{row['question']}"
    python = await client.post("/python", json={"code": "print(6 * 7)"})
    assert python.json()["output"] == "42\n"
    await client.post("/finish", json={"answer": row["answer"]})
    verdict = (await client.post("/verify", json=row | {"response": response_with()})).json()
    assert verdict["reward"] == 1.0 and verdict["resolved"] and verdict["answer_source"] == "finish"
    assert (await client.post("/bash", json={"command": "true"})).status_code == 409  # verify closed the session


async def test_a_wrong_final_message_gets_zero_and_says_why(client: httpx.AsyncClient) -> None:
    row = EXAMPLE_ROWS[1]
    await client.post("/seed_session", json=row)
    response = response_with(assistant_message("The answer is \\boxed{12345}."))
    verdict = (await client.post("/verify", json=row | {"response": response})).json()
    assert verdict["reward"] == 0.0 and verdict["reason"] == "wrong answer"
    assert verdict["answer_source"] == "message" and verdict["grade_details"]["parsed_answer"] == "12345"


def test_environment_server_sessions_follow_gyms_contract() -> None:
    row = EXAMPLE_ROWS[0]
    seed = ResourcesSeedSessionRequest(
        resources_session_id="prorl-math-contract",
        episode_id=EpisodeId(rollout_id="rollout-0", attempt=0),
        task_id=TaskId(taskset="prorl_math", task_id=row["instance_id"]),
        task_data={k: v for k, v in row.items() if k != "responses_create_params"},
    )
    check_resources_session_contract(make_server().setup_webserver(), seed, keeps_state=True)
