"""What `gym env test --resources-server prorl_stem` checks: Gym's verifier fixture on its own mcqa rows, and a
session that computes in its sandbox and answers with a plain message."""

from pathlib import Path
from unittest.mock import MagicMock

import httpx
from nemo_gym.server_utils import ServerClient
from resources_servers.prorl_stem.app import ProrlStemConfig, ProrlStemServer

from nemo_gym_prorl.gym.task_server import check_verifier_fixture, verifier_fixture

HERE = Path(__file__).parent


def make_server(task: str = "stem/gym_mcqa_example") -> ProrlStemServer:
    config = ProrlStemConfig(host="127.0.0.1", port=8080, entrypoint="", name="prorl_stem", task=task)
    return ProrlStemServer(config=config, server_client=MagicMock(spec=ServerClient))


async def test_verifier_fixture_full_zero_malformed_and_determinism() -> None:
    await check_verifier_fixture(verifier_fixture(make_server, HERE / "verifier_cases.jsonl"))


async def test_a_units_session_computes_in_its_sandbox_and_a_converted_answer_is_right() -> None:
    app = make_server("stem/units").setup_webserver()
    question = "18 km in 30 minutes: speed in m/s?"
    row = {"responses_create_params": {"input": [{"role": "user", "content": question}]}, "instance_id": "speed",
           "question": question, "answer": "10 m/s"}
    message = {"id": "msg", "type": "message", "role": "assistant", "status": "completed",
               "content": [{"type": "output_text", "text": "So \\boxed{36 km/h}.", "annotations": []}]}
    response = {"id": "r", "created_at": 0, "model": "m", "object": "response", "output": [message],
                "parallel_tool_calls": False, "tool_choice": "auto", "tools": []}
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://prorl-stem") as client:
            assert (await client.post("/seed_session", json=row)).status_code == 200
            python = await client.post("/python", json={"code": "print(18000 / 1800)"})
            assert python.json()["output"] == "10.0\n"
            verdict = (await client.post("/verify", json=row | {"response": response})).json()
    assert (verdict["reward"], verdict["answer_source"], verdict["grade_details"]["parsed_answer"]) == (
        1.0, "message", "36.0 km / h")
