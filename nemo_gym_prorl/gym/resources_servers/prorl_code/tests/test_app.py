"""What `gym env test --resources-server prorl_code` checks: Gym's verifier fixture, and a session whose program is
graded in a fresh sandbox (its tests never enter the agent's)."""

import json
from pathlib import Path
from unittest.mock import MagicMock

import httpx
from nemo_gym.server_utils import ServerClient
from resources_servers.prorl_code.app import ProrlCodeConfig, ProrlCodeServer

from nemo_gym_prorl.gym.task_server import check_verifier_fixture, verifier_fixture

HERE = Path(__file__).parent
EXAMPLE_ROWS = [json.loads(line) for line in (HERE.parent / "data" / "example.jsonl").open()]


def make_server() -> ProrlCodeServer:
    config = ProrlCodeConfig(host="127.0.0.1", port=8080, entrypoint="", name="prorl_code")
    return ProrlCodeServer(config=config, server_client=MagicMock(spec=ServerClient))


async def test_verifier_fixture_full_zero_malformed_and_determinism() -> None:
    await check_verifier_fixture(verifier_fixture(make_server, HERE / "verifier_cases.jsonl"))


async def test_a_session_grades_the_file_its_finish_names_and_says_which_test_failed() -> None:
    app = make_server().setup_webserver()
    row = EXAMPLE_ROWS[0]
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://prorl-code") as client:
            assert (await client.post("/seed_session", json=row)).status_code == 200
            listing = await client.post("/bash", json={"command": "ls; ls tests"})
            assert listing.json()["output"].split() == ["problem.md", "tests", "0.expected.out", "0.in"]
            await client.post("/str_replace_editor", json={"command": "create", "path": "/workspace/sol.py",
                                                           "file_text": "print(-1)\n"})
            await client.post("/finish", json={"answer": "sol.py"})
            response = {"id": "r", "created_at": 0, "model": "m", "object": "response", "output": [],
                        "parallel_tool_calls": False, "tool_choice": "auto", "tools": []}
            verdict = (await client.post("/verify", json=row | {"response": response})).json()
    assert (verdict["reward"], verdict["reason"], verdict["answer_source"]) == (0.0, "wrong_answer", "finish")
    assert verdict["grade_details"]["failed_test"] == 0 and verdict["grade_details"]["code_source"] == "sol.py"
