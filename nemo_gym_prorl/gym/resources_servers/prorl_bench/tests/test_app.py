"""What `gym env test --resources-server prorl_bench` checks: sessions count their own tool calls, verify grades,
and nothing depends on which worker process serves a request."""

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
from resources_servers.prorl_bench.app import EVENT_LOG_ENV, ProrlBenchConfig, ProrlBenchServer

ROW = json.loads((Path(__file__).parents[1] / "data" / "example.jsonl").open().readline())


def make_server() -> ProrlBenchServer:
    config = ProrlBenchConfig(host="127.0.0.1", port=8080, entrypoint="", name="prorl_bench", domain="other")
    return ProrlBenchServer(config=config, server_client=MagicMock(spec=ServerClient))


def verify_body(text: str) -> dict[str, Any]:
    message = {
        "id": "msg", "type": "message", "role": "assistant", "status": "completed",
        "content": [{"type": "output_text", "text": text, "annotations": []}],
    }  # fmt: skip
    response = {
        "id": "resp", "created_at": 0, "model": "m", "object": "response", "parallel_tool_calls": False,
        "tool_choice": "auto", "tools": [], "output": [message],
    }  # fmt: skip
    return ROW | {"response": response}


@pytest.fixture(autouse=True)
def event_log(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Each test's servers share a fresh event log, as the workers of one server do."""
    monkeypatch.setenv(EVENT_LOG_ENV, str(tmp_path / "events"))
    return tmp_path / "events"


def asgi_client(app: Any) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://prorl-bench")


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    async with asgi_client(make_server().setup_webserver()) as client:
        yield client


async def session(client: httpx.AsyncClient) -> httpx.Cookies:
    """A fresh Gym session seeded with the row, as an agent's legacy /run seeds it."""
    client.cookies.clear()
    assert (await client.post("/seed_session", json=ROW)).status_code == 200
    return httpx.Cookies(client.cookies)


async def test_each_session_counts_its_own_tool_calls_and_verify_reports_them(client: httpx.AsyncClient) -> None:
    first, second = await session(client), await session(client)
    for cookies, calls in ((first, 3), (second, 1)):
        client.cookies = cookies
        for _ in range(calls):
            assert (await client.post("/add", json={"a": 2, "b": 3})).json() == {"sum": 5.0}
        cookies.update(client.cookies)  # the session's latest cookie, as an agent keeps it
    client.cookies = first
    verdict = (await client.post("/verify", json=verify_body("The total is \\boxed{10}."))).json()
    assert (verdict["reward"], verdict["reason"], verdict["answer"], verdict["tool_calls"]) == (1.0, "correct", "10", 3)
    client.cookies = second
    assert (await client.post("/verify", json=verify_body("so \\boxed{10}"))).json()["tool_calls"] == 1
    stats = (await client.get("/bench/stats")).json()
    assert (stats["seeds"], stats["tool_calls"], stats["verifies"]) == (2, 4, 2)
    assert stats["first_seed_at"] <= stats["last_verify_at"]


async def test_a_session_may_move_between_worker_processes() -> None:
    """Two server instances stand for two uvicorn workers: the count travels in the session cookie, the stats are
    totalled over the shared event log."""
    workers = [asgi_client(make_server().setup_webserver()) for _ in range(2)]

    async def post(worker: int, path: str, body: dict[str, Any]) -> dict[str, Any]:
        response = await workers[worker].post(path, json=body)
        assert response.status_code == 200, response.text
        for client in workers:  # the agent sends the latest cookie, whichever worker set it
            client.cookies.update(response.cookies)
        return response.json()

    async with workers[0], workers[1]:
        await post(0, "/seed_session", ROW)
        for hop in range(3):
            assert await post((hop + 1) % 2, "/add", {"a": hop, "b": 1}) == {"sum": hop + 1.0}
        assert (await post(0, "/verify", verify_body("\\boxed{10}")))["tool_calls"] == 3
        stats = (await workers[1].get("/bench/stats")).json()
        assert (stats["seeds"], stats["tool_calls"], stats["verifies"]) == (1, 3, 1)


@pytest.mark.parametrize(
    ("text", "reward", "reason"), [("\\boxed{11}", 0.0, "wrong answer"), ("ten, I think", 0.0, "no answer")]
)
async def test_verify_says_why_an_answer_gets_zero(
    client: httpx.AsyncClient, text: str, reward: float, reason: str
) -> None:
    await session(client)
    verdict = (await client.post("/verify", json=verify_body(text))).json()
    assert (verdict["reward"], verdict["reason"]) == (reward, reason)


async def test_reset_starts_a_new_measurement(client: httpx.AsyncClient) -> None:
    await session(client)
    assert (await client.post("/bench/reset")).json()["seeds"] == 0
    assert (await client.get("/bench/stats")).json() == {
        "seeds": 0, "tool_calls": 0, "verifies": 0, "first_seed_at": None, "last_verify_at": None,
    }  # fmt: skip


def test_gyms_session_contract_holds() -> None:
    seed = ResourcesSeedSessionRequest(
        resources_session_id="contract", episode_id=EpisodeId(rollout_id="r", attempt=0),
        task_id=TaskId(taskset="prorl_bench", task_id=ROW["id"]), task_data={k: v for k, v in ROW.items()},
    )  # fmt: skip
    check_resources_session_contract(make_server().setup_webserver(), seed, keeps_state=False)
