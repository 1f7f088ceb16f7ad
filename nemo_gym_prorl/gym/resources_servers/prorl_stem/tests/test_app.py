"""What `gym env test --resources-server prorl_stem` checks: Gym's verifier fixture on its own mcqa rows, and a
session that computes in its sandbox and answers with a plain message."""

import json
from pathlib import Path
from unittest.mock import MagicMock

import httpx
from nemo_gym.server_utils import ServerClient
from nemo_gym.verifier_fixture import VerifierFixture, exercise_verifier_fixture, load_verifier_fixture
from resources_servers.prorl_stem.app import ProrlStemConfig, ProrlStemServer

from nemo_gym_prorl.gym.task_server import ProrlTaskVerifyRequest

HERE = Path(__file__).parent
EXAMPLE_ROWS = [json.loads(line) for line in (HERE.parent / "data" / "example.jsonl").open()]


def make_server(task: str = "stem/gym_mcqa_example") -> ProrlStemServer:
    config = ProrlStemConfig(host="127.0.0.1", port=8080, entrypoint="", name="prorl_stem", task=task)
    return ProrlStemServer(config=config, server_client=MagicMock(spec=ServerClient))


FIXTURE = VerifierFixture(
    server_factory=make_server,
    request_model=ProrlTaskVerifyRequest,
    cases_path=HERE / "verifier_cases.jsonl",
    invoke=lambda server, body: server.grade_row(body),
    reseed=lambda server, body: None,
)


async def test_verifier_fixture_full_zero_malformed_and_determinism() -> None:
    await exercise_verifier_fixture(FIXTURE, reward_range=(0.0, 1.0), determinism="seeded")
    case = next(c for c in load_verifier_fixture(FIXTURE.cases_path) if c.kind == "determinism")
    server, request = make_server(), ProrlTaskVerifyRequest.model_validate(case.request)
    assert {(await server.grade_row(request)).reward for _ in range(10)} == {1.0}


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
