"""Our orchestrator drives real NeMo Gym resources servers over HTTP (a `type: gym` task), with the stand-in model:

- the benchmark's `prorl_bench` (a free `add` tool, two uvicorn workers): every rollout of a GRPO group seeds its own
  Gym session, its tool calls reach the server's `/add` route under that session's cookie (which counts them, on
  whichever worker serves the call),
  and the reward is the server's `/verify` verdict, diagnostics included; a wrong answer gets the server's zero;
- our `prorl_math` (bash / finish in a bubblewrap sandbox the server owns): the tools run in the server's
  sandbox and the finish answer is graded there, and the sandbox is gone after verify;
- every assistant turn carries NeMo RL's token fields, contiguous across the rollout;
- as in Gym's simple_agent, a reply without a tool call ends the episode and the server grades it;
- stopping the service closes the environment's HTTP client;
- NeMo Gym's agent `/run` on such a service: the row (its `responses_create_params` and its own columns, even one
  named `task`) reaches the server as Gym's agents send it, and the verify response echoes it.

The servers are started the way Gym starts them, by `gym env start`, from a config naming only them.
"""

from __future__ import annotations

import asyncio
import gc
import json
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from nemo_gym_prorl.bench.throughput import (
    SCRIPT,
    TOOL_CALLS_PER_ROLLOUT,
    bench_row,
    gym_task_yaml,
    link_venvs,
    write_jsonl,
)
from nemo_gym_prorl.contracts.job import JobRequest
from nemo_gym_prorl.contracts.task import TaskInstance, load_task
from nemo_gym_prorl.contracts.trajectory import TOKEN_FIELDS, Trajectory, contiguity_violation
from nemo_gym_prorl.envs.gym.env import GymResourcesEnvironment
from nemo_gym_prorl.gym import PLUGIN_ROOT
from nemo_gym_prorl.gym.agent_routes import GymRunRequest, gym_verify_response
from nemo_gym_prorl.gym.processes import gym_env_start, gym_environ
from nemo_gym_prorl.launch.runtime import ModelConfig, ServiceConfig, ServiceRuntime, ServiceSettings
from nemo_gym_prorl.launch.serve import run_service
from nemo_gym_prorl.models.launcher import ModelServerProcess
from nemo_gym_prorl.models.standin import standin_argv
from nemo_gym_prorl.service.pipeline import PipelineConfig, StageConfig

MATH_ROW = json.loads((PLUGIN_ROOT / "resources_servers/prorl_math/data/example.jsonl").open().readline())
MATH_SCRIPT = [
    '<tool_call>\n{"name": "bash", "arguments": {"command": "cat problem.txt"}}\n</tool_call>',
    f'<tool_call>\n{{"name": "finish", "arguments": {{"answer": "{MATH_ROW["answer"]}"}}}}\n</tool_call>',
]
SERVERS_CONFIG = """\
prorl_bench:
  resources_servers:
    prorl_bench: {entrypoint: app.py, domain: other}
prorl_math:
  resources_servers:
    prorl_math: {entrypoint: app.py, domain: math, task: math/arithmetic, sandbox_backend: bwrap}
"""


@dataclass
class Servers:
    urls: dict[str, str]  # resources server name -> URL
    pids: dict[str, int]
    models: dict[str, str]  # resources server name -> the stand-in scripted for its task
    tmp: Path


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Servers]:
    """`gym env start` with our two resources servers, and a stand-in model scripted for each task; all of it is
    stopped (gym by SIGINT, then its session killed) when the module is done."""
    tmp = tmp_path_factory.mktemp("gym-resources-env")
    loop = asyncio.new_event_loop()
    bench_model = ModelServerProcess(standin_argv(SCRIPT))
    math_model = ModelServerProcess(standin_argv(MATH_SCRIPT))
    config = tmp / "servers.yaml"
    config.write_text(SERVERS_CONFIG)
    gym = gym_env_start(["--config", str(config)], gym_environ(link_venvs(tmp / "venvs")), tmp, tmp / "env_start.log")
    try:
        loop.run_until_complete(bench_model.__aenter__())
        loop.run_until_complete(math_model.__aenter__())
        env = loop.run_until_complete(gym.__aenter__())
        try:
            urls = {name: env.servers[name]["url"] for name in ("prorl_bench", "prorl_math")}
            pids = {name: env.servers[name]["pid"] for name in ("prorl_bench", "prorl_math")}
            yield Servers(urls, pids, {"prorl_bench": bench_model.base_url, "prorl_math": math_model.base_url}, tmp)
        finally:
            loop.run_until_complete(gym.__aexit__(None, None, None))
    finally:
        loop.run_until_complete(math_model.stop())
        loop.run_until_complete(bench_model.stop())
        loop.close()


def service_config(servers: Servers, server: str, rows: list[dict[str, Any]], max_turns: int) -> ServiceConfig:
    rows_path = write_jsonl(servers.tmp / f"{server}-rows.jsonl", rows)
    task = gym_task_yaml(servers.tmp / f"{server}.yaml", rows_path, servers.urls[server], max_turns=max_turns)
    stage = StageConfig(workers=8)
    settings = ServiceSettings(
        port=0, tasks=[str(task)], store=Path(":memory:"),
        pipeline=PipelineConfig(init=stage, run=stage, eval=stage, max_live_sandboxes=8),
    )  # fmt: skip
    model = ModelConfig(
        kind="remote", addresses=[servers.models[server]], served_model_name="standin", tool_call_format="hermes",
        generation_mode="chat",
    )  # fmt: skip
    return ServiceConfig(service=settings, model=model)


async def run_jobs(config: ServiceConfig, jobs: list[JobRequest]) -> list[list[Trajectory]]:
    async with ServiceRuntime(config) as runtime:
        assert runtime.orchestrator is not None
        orchestrator = runtime.orchestrator
        ids = [orchestrator.submit(job) for job in jobs]
        return [(await orchestrator.wait(job_id)).results for job_id in ids]


def check_token_fields(trajectory: Trajectory, turns: int) -> None:
    assistant = trajectory.assistant_turns()
    assert len(assistant) == turns
    for turn in assistant:
        assert all(turn[field] for field in TOKEN_FIELDS), turn.keys()
    assert contiguity_violation(assistant) is None, contiguity_violation(assistant)


def tool_results(trajectory: Trajectory) -> list[str]:
    return [m["content"] for m in trajectory.messages if m["role"] == "tool"]


async def bench_stats(url: str) -> dict[str, Any]:
    async with httpx.AsyncClient(trust_env=False) as client:
        return (await client.get(f"{url}/bench/stats")).json()


@pytest.mark.slow
async def test_each_rollout_calls_the_tools_in_its_own_gym_session_and_gets_the_servers_reward(
    servers: Servers,
) -> None:
    right, wrong = bench_row(0), bench_row(1) | {"expected_answer": "11"}
    config = service_config(servers, "prorl_bench", [right, wrong], max_turns=len(SCRIPT))
    async with httpx.AsyncClient(trust_env=False) as client:
        await client.post(f"{servers.urls['prorl_bench']}/bench/reset")

    group, [miss] = await run_jobs(config, [JobRequest(instance=right, n=4), JobRequest(instance=wrong, n=1)])

    for trajectory in [*group, miss]:
        assert trajectory.critical_error is None, trajectory.error
        # Each result is the server's /add reply to that call, in order: 1+2, 3+3, 6+4.
        assert [json.loads(r)["sum"] for r in tool_results(trajectory)] == [3, 6, 10]
        assert trajectory.num_tool_calls == TOOL_CALLS_PER_ROLLOUT
        # The server counted the calls of this rollout's session only: cookies kept the sessions apart.
        assert trajectory.evaluation["tool_calls"] == TOOL_CALLS_PER_ROLLOUT
        assert trajectory.evaluation["answer"] == "10"
        check_token_fields(trajectory, turns=len(SCRIPT))
    assert [(t.reward, t.resolved, t.evaluation["reason"]) for t in group] == [(1.0, True, "correct")] * 4
    assert (miss.reward, miss.resolved, miss.evaluation["reason"]) == (0.0, False, "wrong answer")
    stats = await bench_stats(servers.urls["prorl_bench"])
    assert (stats["seeds"], stats["tool_calls"], stats["verifies"]) == (5, 5 * TOOL_CALLS_PER_ROLLOUT, 5)


@pytest.mark.slow
async def test_a_sandboxed_gym_server_runs_the_tools_in_its_sandbox_and_grades_the_finish_answer(
    servers: Servers,
) -> None:
    config = service_config(servers, "prorl_math", [MATH_ROW], max_turns=len(MATH_SCRIPT))

    [[trajectory, second]] = await run_jobs(config, [JobRequest(instance=MATH_ROW, n=2)])

    for t in (trajectory, second):
        assert t.critical_error is None, t.error
        bash, finish = (json.loads(r)["output"] for r in tool_results(t))
        assert bash == MATH_ROW["question"]  # `cat problem.txt` in the sandbox the server staged
        assert finish == "Answer submitted."
        assert (t.reward, t.resolved) == (1.0, True)
        assert t.evaluation["answer_source"] == "finish" and t.evaluation["submitted_answer"] == MATH_ROW["answer"]
        check_token_fields(t, turns=len(MATH_SCRIPT))
    server = psutil.Process(servers.pids["prorl_math"])
    assert not [p for p in server.children(recursive=True) if p.name() == "bwrap"], "verify left a sandbox"


@pytest.mark.slow
async def test_a_reply_without_a_tool_call_ends_a_gym_episode_and_the_server_grades_it(servers: Servers) -> None:
    # The turn limit is well past the script (whose last reply, `\boxed{10}`, the stand-in then repeats): the
    # episode must end at that reply, as Gym's simple_agent ends it, not run on with it fed back as a format error.
    row = bench_row(0)
    config = service_config(servers, "prorl_bench", [row], max_turns=len(SCRIPT) + 3)

    [[trajectory]] = await run_jobs(config, [JobRequest(instance=row)])

    assert trajectory.critical_error is None, trajectory.error
    assert (trajectory.finish, trajectory.num_format_errors) == ("answer", 0)
    last = trajectory.messages[-1]
    assert last["role"] == "assistant" and last["content"].startswith(SCRIPT[-1]) and "format_error" not in last
    check_token_fields(trajectory, turns=len(SCRIPT))
    assert (trajectory.reward, trajectory.evaluation["reason"]) == (1.0, "correct")
    assert trajectory.evaluation["answer"] == "10"


@pytest.mark.slow
async def test_stopping_the_service_closes_the_gym_environments_http_client(servers: Servers) -> None:
    row = bench_row(0)
    config = service_config(servers, "prorl_bench", [row], max_turns=len(SCRIPT))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        async with ServiceRuntime(config) as runtime:
            orchestrator = runtime.orchestrator
            assert orchestrator is not None
            [env] = orchestrator.envs.values()
            assert isinstance(env, GymResourcesEnvironment)
            http = env.http
            [trajectory] = (await orchestrator.wait(orchestrator.submit(JobRequest(instance=row)))).results
            assert trajectory.reward == 1.0  # the client has talked to the server: its connection pool is live
            assert not http.is_closed
        assert http.is_closed
        # Nothing is left for the garbage collector to find unclosed (aiohttp warns of an unclosed session there).
        del runtime, orchestrator, env, http
        gc.collect()
    assert [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)] == []


def test_prorl_bench_example_rows_are_the_benchmarks_rows() -> None:
    example = PLUGIN_ROOT / "resources_servers" / "prorl_bench" / "data" / "example.jsonl"
    rows = [json.loads(line) for line in example.open()]
    assert rows == [bench_row(i) for i in range(len(rows))], (
        "prorl_bench's data/example.jsonl is stale; rewrite it from nemo_gym_prorl.bench.throughput.bench_row"
    )


@pytest.mark.slow
async def test_gym_run_on_a_gym_task_sends_the_whole_row_to_the_resources_server(servers: Servers) -> None:
    # `task` and `_rowidx` are the row's own columns (Gym's iheval rows dispatch /verify on `task`).
    row = bench_row(0) | {"task": "verb-extract", "_rowidx": 7}
    config = service_config(servers, "prorl_bench", [bench_row(0)], max_turns=len(SCRIPT))
    async with run_service(config) as service, httpx.AsyncClient(base_url=service.url, timeout=60) as http:
        answer = await http.post("/run", json=row)
        unknown = await http.post("/run", json=row | {"prorl_task": "chess"})

    assert answer.status_code == 200, answer.text
    verified = answer.json()
    assert (verified["reward"], verified["mask_sample"], verified["evaluation"]["tool_calls"]) == (1.0, False, 3)
    assert (verified["task"], verified["_rowidx"]) == ("verb-extract", 7)
    assert verified["responses_create_params"] == row["responses_create_params"]
    assert (unknown.status_code, unknown.json()["error"]["field"]) == (422, "prorl_task")


def test_a_rows_earlier_tool_calls_and_their_results_are_in_the_prompt(tmp_path: Path) -> None:
    """Rows of Gym's citation_if, iheval, ... hold past function calls and outputs in their input, as Gym's
    vllm_model turns them into chat messages."""
    row = bench_row(0)
    row["responses_create_params"]["input"] = [
        {"role": "developer", "content": "Use the tools."},
        {"role": "user", "content": [{"type": "input_text", "text": "What is "}, {"type": "input_text", "text": "1 + 2?"}]},
        {"type": "function_call", "call_id": "call_1", "name": "add", "arguments": '{"a": 1, "b": 2}'},
        {"type": "function_call_output", "call_id": "call_1", "output": '{"sum": 3}'},
        {"role": "user", "content": "Now answer."},
    ]
    task = load_task(str(gym_task_yaml(tmp_path / "task.yaml", write_jsonl(tmp_path / "rows.jsonl", [row]), "http://x")))
    env = GymResourcesEnvironment(task)
    messages = env.prompt_messages(TaskInstance(instance_id="0", data=row))
    assert messages == [
        {"role": "system", "content": "Use the tools."},
        {"role": "user", "content": "What is 1 + 2?"},
        {
            "role": "assistant",
            "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}],
        },
        {"role": "tool", "content": '{"sum": 3}', "tool_call_id": "call_1"},
        {"role": "user", "content": "Now answer."},
    ]
    row["responses_create_params"]["input"] = [{"type": "compaction", "encrypted_content": "..."}]
    with pytest.raises(ValueError, match="responses_create_params"):
        env.prompt_messages(TaskInstance(instance_id="0", data=row))


def test_a_sample_the_gym_server_masks_stays_masked_in_the_verify_response() -> None:
    """A judge outage or a lost container: the server's reward is no measurement, and NeMo RL must not train on it."""
    verdict = {"mask_sample": True, "failure_kind": "judge_unavailable", "failure_reason": "judge answered 503"}
    trajectory = Trajectory(instance_id="0", trajectory_id="j:0", reward=0.0, evaluation=verdict)
    body = gym_verify_response(GymRunRequest.model_validate(bench_row(0)), trajectory, "policy")
    assert {k: body[k] for k in verdict} == verdict
