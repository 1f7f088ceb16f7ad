"""NeMo Gym runs our math environment as a resources server, offline, with the repo's venv:

- `gym env test` passes for our resources servers (prorl_math, and the benchmark's prorl_bench) from our plugin
  root;
- `gym env start` + `gym eval run --no-serve`, with Gym's simple_agent and vllm_model on our local model server,
  produce rollouts whose items carry token ids that NeMo RL can train on (through both Gym wirings: the
  legacy_agent relay and the single-agent-turn environment server);
- in process, the app's sessions run tools in a real bubblewrap sandbox, grade, and leave no sandbox behind.

These are the commands of nemo_gym_prorl/gym/README.md, run as a user would from the repo root.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any
from unittest.mock import MagicMock

import datasets.config
import httpx
import pytest
from nemo_gym.base_resources_server import (
    ResourcesCloseSessionRequest,
    ResourcesSeedSessionRequest,
)
from nemo_gym.episode_types import EpisodeId, TaskId
from nemo_gym.server_utils import ServerClient
from nemo_gym.testing.session_conformance import check_resources_session_contract

from nemo_gym_prorl.contracts.trajectory import TOKEN_FIELDS, contiguity_violation
from nemo_gym_prorl.gym import PLUGIN_ROOT
from nemo_gym_prorl.gym.processes import free_port, gym_env_start, gym_environ, run_gym
from nemo_gym_prorl.gym.rows import task_rows
from nemo_gym_prorl.gym.venvs import SERVERS, ensure_venv_links
from nemo_gym_prorl.models.launcher import LocalModelConfig, LocalModelServer

sys.path.insert(0, str(PLUGIN_ROOT))  # what Gym does for its extra roots: `resources_servers.*` imports from there

from resources_servers.prorl_math.app import ProrlMathConfig, ProrlMathServer  # noqa: E402

REPO_ROOT = PLUGIN_ROOT.parents[1]
SERVER_DIR = PLUGIN_ROOT / "resources_servers" / "prorl_math"
EXAMPLE = SERVER_DIR / "data" / "example.jsonl"
EXAMPLE_ROWS = [json.loads(line) for line in EXAMPLE.open()]
AGENTS = {"prorl_math_simple_agent": "legacy_agent", "prorl_math_session_agent": "single_agent_turn_legacy"}


# -- processes --------------------------------------------------------------------------------------------------


def _proc_stats() -> dict[int, tuple[str, int, int]]:
    """pid -> (comm, ppid, session id) of every process."""
    stats = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            raw = Path(f"/proc/{entry.name}/stat").read_bytes()
        except OSError:
            continue
        comm = raw[raw.index(b"(") + 1 : raw.rindex(b")")].decode(errors="replace")
        fields = raw[raw.rindex(b")") + 2 :].split()  # state ppid pgrp session ...
        stats[int(entry.name)] = (comm, int(fields[1]), int(fields[3]))
    return stats


def descendants(pid: int) -> dict[int, str]:
    """pid -> comm of every process below `pid`."""
    stats = _proc_stats()
    found: dict[int, str] = {}
    frontier = [pid]
    while frontier:
        parent = frontier.pop()
        for child, (comm, ppid, _) in stats.items():
            if ppid == parent and child not in found:
                found[child] = comm
                frontier.append(child)
    return found


def sandboxes_below(pid: int) -> set[int]:
    return {p for p, comm in descendants(pid).items() if comm == "bwrap"}


@pytest.fixture(scope="module", autouse=True)
def gym_venv_links() -> None:
    ensure_venv_links()


@pytest.fixture
def repo_root_stays_clean() -> Any:
    """gym commands run from the repo root must not leave Hydra's `outputs/` or Gym's `results/` there."""
    watched = [REPO_ROOT / name for name in ("outputs", "results")]
    existing = {path for path in watched if path.exists()}
    yield
    created = [str(path) for path in watched if path.exists() and path not in existing]
    assert not created, f"gym left {created} in the repo"


# -- (a) gym env test -------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("server", ["prorl_math", "prorl_bench"])
async def test_gym_env_test_passes_for_our_resources_servers(
    server: str, tmp_path: Path, repo_root_stays_clean: None
) -> None:
    out = await run_gym(
        ["env", "test", "--resources-server", server, f"hydra.run.dir={tmp_path / 'hydra'}"],
        gym_environ(), REPO_ROOT, timeout_s=300,
    )
    assert " passed" in out and " failed" not in out and "uv: command not found" not in out


# -- (b) gym env start + gym eval run --no-serve ----------------------------------------------------------------


def token_items(rollout: dict[str, Any]) -> list[dict[str, Any]]:
    return [item for item in rollout["response"]["output"] if item.get("generation_token_ids")]


def check_tool_calls_ran_in_the_sandbox(rollout: dict[str, Any]) -> None:
    """Every well-formed call of our tools got its output from our route (not a missing-session error)."""
    output = rollout["response"]["output"]
    results = {item["call_id"]: item["output"] for item in output if item["type"] == "function_call_output"}
    required = {"bash": "command", "python": "code", "finish": "answer"}
    for call in (item for item in output if item["type"] == "function_call"):
        assert call["call_id"] in results, f"function call {call['name']} was never executed"
        try:
            arguments = json.loads(call["arguments"])
        except json.JSONDecodeError:
            continue
        if call["name"] in required and isinstance(arguments, dict) and required[call["name"]] in arguments:
            assert "output" in json.loads(results[call["call_id"]]), results[call["call_id"]]


async def check_tool_route_in_started_server(head: str) -> int:
    """Drive the running resources server as an agent would; returns its pid."""
    async with httpx.AsyncClient(timeout=60) as client:
        instances = (await client.get(f"{head}/server_instances")).json()
        ours = next(i for i in instances if i["process_name"] == "prorl_math")
        row = EXAMPLE_ROWS[0]
        await client.post(f"{ours['url']}/seed_session", json=row)
        bash = await client.post(f"{ours['url']}/bash", json={"command": "pwd; id -u; cat problem.txt"})
        assert bash.json()["output"] == f"/workspace\n1000\n{row['question']}"
        await client.post(f"{ours['url']}/finish", json={"answer": row["answer"]})
        verdict = (await client.post(f"{ours['url']}/verify", json=row | {"response": _response()})).json()
        assert verdict["reward"] == 1.0
    return ours["pid"]


@pytest.mark.slow
async def test_gym_rollouts_with_simple_agent_and_vllm_model_carry_trainable_token_ids(
    tmp_path: Path, repo_root_stays_clean: None
) -> None:
    head_port = free_port()
    rollouts: dict[str, list[dict[str, Any]]] = {}
    async with LocalModelServer(LocalModelConfig(n_ctx=4096)) as model:
        start_args = [
            "--resources-server", "prorl_math/prorl_math_single_agent_turn",  # includes prorl_math.yaml
            "--config", "configs/local_policy_model.yaml",
            "--model", model.config.served_model_name, "--model-url", model.base_url, "--model-api-key", "dummy",
        ]  # fmt: skip
        log, hydra_dir = tmp_path / "env_start.log", tmp_path / "hydra-start"
        async with gym_env_start(start_args, gym_environ(), REPO_ROOT, log, head_port, hydra_dir) as env:
            server_pid = await check_tool_route_in_started_server(env.head)
            for agent in AGENTS:
                output = tmp_path / agent / "rollouts.jsonl"
                await run_gym(
                    ["eval", "run", "--no-serve", "--agent", agent, "--input", str(EXAMPLE), "--output", str(output),
                     "--limit", "2", "--max-output-tokens", "64", f"+head_server.port={head_port}",
                     f"hydra.run.dir={tmp_path / 'hydra-eval'}"],
                    gym_environ(), REPO_ROOT, timeout_s=300,
                )  # fmt: skip
                rollouts[agent] = [json.loads(line) for line in output.open()]
            assert not sandboxes_below(server_pid), "a rollout's sandbox outlived its verify"

    for agent, result_type in AGENTS.items():
        assert len(rollouts[agent]) == 2, agent
        for rollout in rollouts[agent]:
            assert rollout["_ng_result_type"] == result_type
            assert isinstance(rollout["reward"], float) and rollout["reason"], rollout
            items = token_items(rollout)
            assert items, f"{agent}: no output item carries token ids"
            for item in items:
                assert all(item.get(field) for field in TOKEN_FIELDS), item.keys()
            assert contiguity_violation(items) is None, contiguity_violation(items)
            check_tool_calls_ran_in_the_sandbox(rollout)


# -- (c) the app in process, over a real bubblewrap sandbox -----------------------------------------------------


def _response(*output: dict[str, Any]) -> dict[str, Any]:
    return {
        "id": "resp", "created_at": 0, "model": "m", "object": "response", "parallel_tool_calls": False,
        "tool_choice": "auto", "tools": [], "output": list(output),
    }  # fmt: skip


def _seed_request(session_id: str, row: dict[str, Any]) -> dict[str, Any]:
    return ResourcesSeedSessionRequest(
        resources_session_id=session_id,
        episode_id=EpisodeId(rollout_id=f"rollout-{session_id}", attempt=0),
        task_id=TaskId(taskset="prorl_math", task_id=row["instance_id"]),
        task_data={k: v for k, v in row.items() if k != "responses_create_params"},
    ).model_dump(mode="json")


@contextlib.asynccontextmanager
async def serving(task: str = "math/arithmetic") -> AsyncIterator[httpx.AsyncClient]:
    """The app on this event loop (math-verify only grades on the main thread), its lifespan included."""
    config = ProrlMathConfig(host="127.0.0.1", port=0, entrypoint="", name="prorl_math", task=task)
    app = ProrlMathServer(config=config, server_client=MagicMock(spec=ServerClient)).setup_webserver()
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://prorl-math") as client:
            yield client


async def test_a_seeded_session_runs_bash_in_its_sandbox_and_grades_the_finish_answer() -> None:
    row = EXAMPLE_ROWS[0]
    async with serving() as client:
        assert (await client.post("/seed_session", json=row)).status_code == 200
        assert len(sandboxes_below(os.getpid())) == 1
        assert (await client.post("/bash", json={"command": "echo hi"})).json() == {"output": "hi\n"}
        sandbox = await client.post("/bash", json={"command": "pwd; id -u; cat problem.txt"})
        assert sandbox.json()["output"] == f"/workspace\n1000\n{row['question']}"
        assert (await client.post("/finish", json={"answer": row["answer"]})).json() == {"output": "Answer submitted."}
        verdict = (await client.post("/verify", json=row | {"response": _response()})).json()
        assert verdict["reward"] == 1.0 and verdict["resolved"] and verdict["reason"] == "correct"
        assert verdict["submitted_answer"] == row["answer"] and verdict["answer_source"] == "finish"
        assert verdict["instance_id"] == row["instance_id"]  # the row comes back with the verdict
        assert not sandboxes_below(os.getpid()), "verify must close the session's sandbox"


async def test_a_wrong_finish_answer_gets_zero_with_the_reason() -> None:
    row = EXAMPLE_ROWS[1]
    async with serving() as client:
        await client.post("/seed_session", json=row)
        await client.post("/finish", json={"answer": "123456789"})
        verdict = (await client.post("/verify", json=row | {"response": _response()})).json()
        assert verdict["reward"] == 0.0 and not verdict["resolved"] and verdict["reason"] == "wrong answer"
        assert verdict["grade_details"]["parsed_answer"] == "123456789"


async def test_without_finish_the_final_assistant_message_is_graded() -> None:
    row = EXAMPLE_ROWS[2]
    message = {
        "id": "msg", "type": "message", "role": "assistant", "status": "completed",
        "content": [{"type": "output_text", "text": f"So it is \\boxed{{{row['answer']}}}.", "annotations": []}],
    }  # fmt: skip
    async with serving() as client:
        await client.post("/seed_session", json=row)
        verdict = (await client.post("/verify", json=row | {"response": _response(message)})).json()
    assert verdict["reward"] == 1.0 and verdict["answer_source"] == "message"


async def test_a_verify_without_a_live_session_grades_the_response_alone() -> None:
    row = EXAMPLE_ROWS[3]
    finish = {
        "id": "fc", "type": "function_call", "call_id": "call_1", "name": "finish", "status": "completed",
        "arguments": json.dumps({"answer": row["answer"]}),
    }  # fmt: skip
    async with serving() as client:
        verdict = (await client.post("/verify", json=row | {"response": _response(finish)})).json()
        assert not sandboxes_below(os.getpid())
    assert verdict["reward"] == 1.0 and verdict["answer_source"] == "finish"


async def test_environment_server_sessions_are_keyed_by_resources_session_id_and_closed() -> None:
    row = EXAMPLE_ROWS[0]
    async with serving() as client:
        seeded = await client.post("/seed_session", json=_seed_request("rs-1", row))
        assert seeded.json()["resources_session_id"] == "rs-1"
        assert (await client.post("/bash", json={"command": "echo hi"})).json() == {"output": "hi\n"}
        assert len(sandboxes_below(os.getpid())) == 1
        close = ResourcesCloseSessionRequest(resources_session_id="rs-1", episode_id=EpisodeId(rollout_id="r"))
        assert (await client.post("/close_session", json=close.model_dump(mode="json"))).status_code == 200
        assert not sandboxes_below(os.getpid()), "close_session must close the sandbox"
        assert (await client.post("/bash", json={"command": "echo hi"})).status_code == 409
        assert (await client.post("/seed_session", json=_seed_request("rs-1", row))).status_code == 409


def test_gyms_session_contract_holds_and_leaves_no_sandbox() -> None:
    config = ProrlMathConfig(host="127.0.0.1", port=0, entrypoint="", name="prorl_math")
    app = ProrlMathServer(config=config, server_client=MagicMock(spec=ServerClient)).setup_webserver()
    seed = ResourcesSeedSessionRequest.model_validate(_seed_request("contract", EXAMPLE_ROWS[0]))
    check_resources_session_contract(app, seed, keeps_state=True)
    assert not sandboxes_below(os.getpid())


async def test_server_shutdown_closes_every_open_sandbox() -> None:
    async with serving() as client:
        for row in EXAMPLE_ROWS[:2]:
            client.cookies.clear()  # a new Gym session each
            assert (await client.post("/seed_session", json=row)).status_code == 200
        assert len(sandboxes_below(os.getpid())) == 2
    assert not sandboxes_below(os.getpid())


# -- data and venvs ---------------------------------------------------------------------------------------------


def test_example_rows_are_the_tasks_own_rows(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # `import nemo_gym` pointed the datasets cache at <cwd>/cache (the repo root); keep this test's out of it.
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf-datasets"))
    assert EXAMPLE_ROWS == task_rows("math/arithmetic", limit=len(EXAMPLE_ROWS)), (
        "data/example.jsonl is stale; regenerate it: .venv/bin/python -m nemo_gym_prorl.gym.rows math/arithmetic "
        f"--limit 5 --output {EXAMPLE.relative_to(REPO_ROOT)}"
    )


def test_venv_links_point_every_server_at_our_venv(tmp_path: Path) -> None:
    for _ in range(2):  # idempotent
        links = ensure_venv_links(tmp_path, Path(sys.prefix))
    assert [link.relative_to(tmp_path).parent.as_posix() for link in links] == list(SERVERS)
    assert all(link.resolve() == Path(sys.prefix).resolve() and (link / "bin" / "activate").exists() for link in links)


def test_the_server_routes_exactly_the_tools_of_its_task(tmp_path: Path) -> None:
    task = tmp_path / "with_editor.yaml"
    task.write_text(
        "name: math/with-editor\ntype: math\nprompt_template: '{question}'\ntools: [bash, str_replace_editor]\n"
        f"dataset: {{path: {REPO_ROOT / 'tasks/math/data/arithmetic.jsonl'}, id_key: id}}\n"
    )
    app = ProrlMathServer(
        config=ProrlMathConfig(host="127.0.0.1", port=0, entrypoint="", name="prorl_math", task=str(task)),
        server_client=MagicMock(spec=ServerClient),
    ).setup_webserver()
    paths = {route.path for route in app.routes}
    assert {"/bash", "/str_replace_editor"} <= paths and not {"/python", "/finish"} & paths
