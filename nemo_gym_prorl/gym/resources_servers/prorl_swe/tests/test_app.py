"""What `gym env test --resources-server prorl_swe` checks: the routes over a real bubblewrap sandbox, real git
and pytest, graded by the swebench harness."""

import json
from collections.abc import AsyncIterator
from pathlib import Path
from unittest.mock import MagicMock

import httpx
import pytest
from nemo_gym.server_utils import ServerClient
from resources_servers.prorl_swe.app import ProrlSweConfig, ProrlSweServer

EXAMPLE_ROWS = [json.loads(line) for line in (Path(__file__).parents[1] / "data" / "example.jsonl").open()]
RESPONSE = {"id": "resp", "created_at": 0, "model": "m", "object": "response", "parallel_tool_calls": False,
            "tool_choice": "auto", "tools": [], "output": []}  # fmt: skip


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    config = ProrlSweConfig(host="127.0.0.1", port=8080, entrypoint="", name="prorl_swe")
    app = ProrlSweServer(config=config, server_client=MagicMock(spec=ServerClient)).setup_webserver()
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://prorl-swe") as c:
            yield c


async def test_a_fix_made_through_the_tools_is_graded_resolved(client: httpx.AsyncClient) -> None:
    row = EXAMPLE_ROWS[0]
    assert (await client.post("/seed_session", json=row, timeout=300)).status_code == 200
    command = f"git apply <<'PRORL_EOF'\n{row['patch']}PRORL_EOF\ngit status --short"
    output = (await client.post("/bash", json={"command": command}, timeout=120)).json()["output"]
    assert row["patch"].split(" b/", 1)[1].split("\n", 1)[0] in output
    verdict = (await client.post("/verify", json=row | {"response": RESPONSE}, timeout=600)).json()
    assert verdict["reward"] == 1.0 and verdict["resolved"], verdict["grade_details"]
    assert verdict["grade_details"]["patch_applied"] and verdict["grade_details"]["fail_to_pass"].startswith("15/")


async def test_no_change_is_graded_0_and_a_row_without_a_field_is_refused(client: httpx.AsyncClient) -> None:
    row = EXAMPLE_ROWS[1]
    broken = {k: v for k, v in row.items() if k != "base_commit"}
    refused = await client.post("/seed_session", json=broken, timeout=60)
    assert refused.status_code == 422 and "missing field 'base_commit'" in refused.text
    verdict = (await client.post("/verify", json=row | {"response": RESPONSE}, timeout=600)).json()
    assert verdict["reward"] == 0.0 and "empty patch" in verdict["reason"]
