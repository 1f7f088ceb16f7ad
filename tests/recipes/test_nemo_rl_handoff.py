"""The whole NeMo RL → NeMo Gym → our rollout service hand-off, driven the way NeMo RL's GRPO drives it, on CPU.

As ``NemoGym._spinup`` (nemo_rl/environments/nemo_gym.py) does: nemo-gym's own ``RunHelper`` started in this process
with the global config it writes — ``policy_base_url`` a list (one URL per vLLM data-parallel rank),
``policy_model_name``, ``policy_api_key``, the head server, and a recipe's ``config_paths`` (Gym's
``vllm_model_for_training.yaml`` and our agent configs) — then rows stamped as its ``_prepare_nemo_gym_rows`` stamps
them (``temperature``, ``top_p``, ``max_output_tokens = min(row, max_new_tokens)``, ``_rowidx``), sent with
``RolloutCollectionHelper().run_examples(...)``. The policy's servers are stand-ins for NeMo RL's vLLM HTTP server
(``models/nemo_rl_standin.py``: its two routes, its assertions as bare 500s, the model name checked, the prefix splice)
in front of the real local model (SmolLM2 on llama.cpp), served on a thread as NeMo RL serves its own.

Each test runs through both of our agents (parametrized): the relay ``prorl_service_agent`` to a service in this
process, and ``prorl_agent``, which runs the service inside the agent process Gym started. Both services start with a
decoy model backend (the model server itself) that the policy's registration must replace. What NeMo RL's
post-processing requires of a result is checked by ``nemo_rl_accepts``, written from the rules of its source.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import threading
from collections.abc import Coroutine, Iterator
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest
import uvicorn
import yaml
from fastapi import FastAPI
from nemo_gym.cli.env import RunHelper
from nemo_gym.global_config import GlobalConfigDictParserConfig
from nemo_gym.rollout_collection import RolloutCollectionHelper
from nemo_gym.server_utils import HEAD_SERVER_KEY_NAME, BaseServerConfig, maybe_ray_cluster_exit
from omegaconf import DictConfig

from nemo_gym_prorl.agent.llm_pool import normalize_address
from nemo_gym_prorl.bench.throughput import link_venvs
from nemo_gym_prorl.contracts.task import TASKS_DIR
from nemo_gym_prorl.gym import PLUGIN_ROOT
from nemo_gym_prorl.gym.processes import free_port
from nemo_gym_prorl.launch.runtime import ModelConfig, ServiceConfig, ServiceSettings
from nemo_gym_prorl.launch.serve import run_service
from nemo_gym_prorl.models.launcher import LocalModelServer
from nemo_gym_prorl.models.local_model import default_gguf
from nemo_gym_prorl.models.nemo_rl_standin import PolicySampling, create_nemo_rl_standin_app
from nemo_gym_prorl.models.tokenizer import Tokenizer
from nemo_gym_prorl.service.pipeline import PipelineConfig, StageConfig

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]

T = TypeVar("T")
EXAMPLE = PLUGIN_ROOT / "resources_servers" / "prorl_math" / "data" / "example.jsonl"
POLICY = "policy-under-training"  # policy.model_name: what every request must name
SAMPLING = PolicySampling(temperature=0.8, top_p=0.95, val_temperature=0.0, val_top_p=1.0)
MAX_NEW_TOKENS = 16  # policy.generation.max_new_tokens
TOKEN = "handoff-s3cret"
SHORT_TASK = "math/arithmetic-2-turns"  # math/arithmetic in at most 2 turns: the rollouts' model time, halved
# Its sandbox comes from a Gym resources server that is down: the seed_session that would start it fails, every time.
UNREACHABLE_TASK = "math/sandbox-server-down"
RELAY, IN_PROCESS = "prorl_service_agent", "prorl_agent"
TOKENS = "_tokens"  # the same agent, its service in token-in/token-out mode
AGENTS = [RELAY, IN_PROCESS]
PIPELINE = PipelineConfig(
    init=StageConfig(workers=4), run=StageConfig(workers=8), eval=StageConfig(workers=4), max_live_sandboxes=8
)


def nemo_rl_accepts(result: dict[str, Any]) -> bool:
    """What NeMo RL's post-processing does with a Gym result (``_postprocess_nemo_gym_to_nemo_rl_result``,
    ``_extract_mask_sample_flags``), rewritten from its rules: trains on the output items with non-empty
    ``generation_token_ids``; each one's prompt must extend every token seen so far ("Non-contiguous messages
    found"); no such item at all raises ("no generation data"); ``reward`` is read as a float. Returns the mask."""
    seen: list[int] = []
    turns = 0
    for item in result["response"]["output"]:
        if not item.get("generation_token_ids"):
            continue
        prompt, generated = item["prompt_token_ids"], item["generation_token_ids"]
        assert prompt[: len(seen)] == seen, "Non-contiguous messages found!"
        assert len(item["generation_log_probs"]) == len(generated)
        seen = seen + prompt[len(seen) :] + generated
        turns += 1
    if not turns:
        raise ValueError("NeMo Gym returned a result with no generation data.")
    assert isinstance(result["responses_create_params"]["input"], list)
    float(result["reward"])
    return bool((result.get("instance_config") or {}).get("mask_sample", False))


def stamped(rows: list[dict[str, Any]], agent: str, top_p: float = SAMPLING.top_p) -> list[dict[str, Any]]:
    """Rows as NeMo RL sends them (``_prepare_nemo_gym_rows``), for `agent`."""
    out = []
    for index, row in enumerate(rows):
        row = json.loads(json.dumps(row)) | {"agent_ref": {"type": "responses_api_agents", "name": agent}}
        params = row["responses_create_params"]
        params["temperature"], params["top_p"] = SAMPLING.temperature, top_p
        limit = params.get("max_output_tokens")
        params["max_output_tokens"] = min(limit, MAX_NEW_TOKENS) if limit is not None else MAX_NEW_TOKENS
        row["_rowidx"] = index
        out.append(row)
    return out


class Background:
    """An event loop on a thread: NeMo RL's HTTP servers run on their own thread, and Gym's ``RunHelper.start``
    blocks the caller until every server is ready."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="handoff-servers", daemon=True)
        self._thread.start()
        self.stack = AsyncExitStack()

    def run(self, coroutine: Coroutine[Any, Any, T], timeout_s: float = 120) -> T:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout_s)

    async def serve(self, app: FastAPI) -> str:
        """`app` on a free loopback port until the stack closes; its base URL."""
        sock = socket.create_server(("127.0.0.1", 0))
        server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=1))
        server.install_signal_handlers = lambda: None  # type: ignore[method-assign]  # not the main thread
        task = self.loop.create_task(server.serve(sockets=[sock]))

        async def stop() -> None:
            server.should_exit = True
            await task

        self.stack.push_async_callback(stop)
        while not server.started:
            await asyncio.sleep(0.01)
        return f"http://127.0.0.1:{sock.getsockname()[1]}"

    def close(self) -> None:
        self.run(self.stack.aclose())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)


@dataclass
class Handoff:
    head: BaseServerConfig  # the head server, as NemoGym keeps it
    policy_urls: list[str]
    policy_apps: list[FastAPI]
    agent_urls: dict[str, str] = field(default_factory=dict)

    def chat_requests(self) -> int:
        return sum(app.state.requests["/v1/chat/completions"] for app in self.policy_apps)

    async def run_examples(self, rows: list[dict[str, Any]]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
        tasks = RolloutCollectionHelper().run_examples(examples=rows, head_server_config=self.head)
        return [await task for task in tasks]

    async def status(self, agent: str) -> dict[str, Any]:
        async with httpx.AsyncClient(timeout=30, trust_env=False) as http:
            return (await http.get(f"{self.agent_urls[agent]}/status")).raise_for_status().json()


def math_task(folder: Path, name: str, **changes: Any) -> str:
    """A copy of math/arithmetic under another name, with `changes`; the path of its YAML."""
    raw = yaml.safe_load((TASKS_DIR / "math" / "arithmetic.yaml").read_text()) | {"name": name, **changes}
    raw["dataset"]["path"] = str(TASKS_DIR / "math" / raw["dataset"]["path"])
    path = folder / f"{name.replace('/', '_')}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return str(path)


def unreachable_task(folder: Path) -> str:
    """Math rows served by a Gym resources server (task type gym) at an address nothing listens on."""
    raw = {
        "name": UNREACHABLE_TASK, "type": "gym", "dataset": {"path": str(EXAMPLE), "id_key": "instance_id"},
        "resources_server_url": "http://127.0.0.1:9", "max_turns": 1,
    }  # fmt: skip
    path = folder / "sandbox_server_down.yaml"
    path.write_text(yaml.safe_dump(raw))
    return str(path)


def service_config(store: Path, tasks: list[str], decoy: str, mode: str) -> ServiceConfig:
    return ServiceConfig(
        service=ServiceSettings(port=0, tasks=tasks, store=store, token=TOKEN, pipeline=PIPELINE),
        model=ModelConfig(
            kind="remote", addresses=[decoy], served_model_name="service-default", generation_mode=mode,
            tool_call_format="hermes",
        ),  # fmt: skip
    )


def agent_entry(folder: str, settings: dict[str, Any]) -> dict[str, Any]:
    return {"responses_api_agents": {folder: {"entrypoint": "app.py", **settings}}}


def environment_server(agent: str) -> dict[str, Any]:
    return {
        "environment_servers": {
            "legacy_agent": {"entrypoint": "app.py", "agent_server": {"type": "responses_api_agents", "name": agent}}
        }
    }


@pytest.fixture(scope="module")
def handoff(model_server: LocalModelServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Handoff]:
    tmp = tmp_path_factory.mktemp("handoff")
    tasks = [
        math_task(tmp, SHORT_TASK, max_turns=2),  # the service's first: rows without prorl_task
        unreachable_task(tmp),
    ]
    decoy = model_server.base_url  # answers any model name: a turn sent there is a turn the policy never saw
    background = Background()
    tokenizer = Tokenizer.from_gguf(model_server.config.gguf or default_gguf())
    apps = [
        create_nemo_rl_standin_app(model_server.base_url, tokenizer, POLICY, SAMPLING, max_model_len=2048)
        for _ in range(2)  # two data-parallel ranks
    ]
    policy_urls = [background.run(background.serve(app)) + "/v1" for app in apps]
    services = {
        mode: background.run(
            background.stack.enter_async_context(run_service(service_config(tmp / f"{mode}.db", tasks, decoy, mode)))
        )
        for mode in ("chat", "tokens")
    }
    in_process = {
        "service": {"tasks": tasks, "pipeline": PIPELINE.model_dump()},
        "model": {"kind": "remote", "addresses": [decoy], "served_model_name": "service-default",
                  "generation_mode": "chat", "tool_call_format": "hermes"},
    }  # fmt: skip
    in_process_tokens = json.loads(json.dumps(in_process))
    in_process_tokens["model"]["generation_mode"] = "tokens"
    head_port = free_port()
    # What NemoGym._spinup puts in Gym's global config (plus the recipe's env.nemo_gym block), as it writes it.
    initial = {
        "config_paths": [
            "responses_api_models/vllm_model/configs/vllm_model_for_training.yaml",
            "responses_api_agents/prorl_service/configs/prorl_service.yaml",
            "responses_api_agents/prorl_agent/configs/prorl_agent.yaml",
        ],
        "skip_venv_if_present": True,
        "uv_venv_dir": str(link_venvs(tmp / "venvs")),
        "policy_model_name": POLICY,
        "policy_api_key": "dummy_key",
        "policy_base_url": policy_urls,
        "default_host": "127.0.0.1",
        "global_aiohttp_connector_limit_per_host": 16_384,
        "global_aiohttp_connector_limit": 65_536,
        HEAD_SERVER_KEY_NAME: {"host": "0.0.0.0", "port": head_port},
        RELAY: agent_entry("prorl_service", {"url": services["chat"].url, "token": TOKEN}),
        IN_PROCESS: agent_entry("prorl_agent", {"rollout_service": in_process}),
        RELAY + TOKENS: agent_entry("prorl_service", {"url": services["tokens"].url, "token": TOKEN}),
        f"{RELAY}{TOKENS}_environment_server": environment_server(RELAY + TOKENS),
        IN_PROCESS + TOKENS: agent_entry("prorl_agent", {"rollout_service": in_process_tokens}),
        f"{IN_PROCESS}{TOKENS}_environment_server": environment_server(IN_PROCESS + TOKENS),
    }
    environ = {"NEMO_GYM_EXTRA_ROOTS": str(PLUGIN_ROOT), "RAY_AUTH_MODE": "disabled", "HF_HOME": str(tmp / "hf")}
    saved = {k: os.environ.get(k) for k in environ}
    os.environ.update(environ)
    run_helper = RunHelper()
    try:
        run_helper.start(
            global_config_dict_parser_config=GlobalConfigDictParserConfig(
                dotenv_path=tmp / "nemo_gym_env.yaml", initial_global_config_dict=DictConfig(initial),
                skip_load_from_cli=True,
            )
        )  # fmt: skip
        head = f"http://127.0.0.1:{head_port}"
        instances = httpx.get(f"{head}/server_instances", timeout=30, trust_env=False).json()
        handoff = Handoff(BaseServerConfig(host="127.0.0.1", port=head_port), policy_urls, apps)
        handoff.agent_urls = {i["process_name"]: i["url"] for i in instances}
        yield handoff
    finally:
        run_helper.shutdown()
        background.close()
        # Gym's own exit for the Ray it started in this process: it shuts Ray down and forgets it did start one.
        # A bare ray.shutdown() left Gym's atexit hook to shut the same Ray down again at interpreter exit, and
        # CI saw pytest segfault right after that hook's line, with every test passed.
        maybe_ray_cluster_exit()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@pytest.mark.parametrize("agent", AGENTS)
async def test_a_grpo_batch_runs_on_the_policy_servers_and_comes_back_trainable(handoff: Handoff, agent: str) -> None:
    row = json.loads(EXAMPLE.open().readline())
    batch = stamped([row, row], agent)  # one prompt, a GRPO group of two generations
    before = handoff.chat_requests()
    results = await handoff.run_examples(batch)

    assert sorted(row["_rowidx"] for row, _ in results) == list(range(len(batch)))
    for row, result in results:
        assert result["_rowidx"] == row["_rowidx"]  # NeMo RL maps results back to its batch by it
        assert result["instance_id"] == batch[row["_rowidx"]]["instance_id"]
        assert result["responses_create_params"]["top_p"] == SAMPLING.top_p
        assert isinstance(result["reward"], float)
        trainable = [item for item in result["response"]["output"] if item.get("generation_token_ids")]
        assert trainable and all(item["prompt_token_ids"] and item["generation_log_probs"] for item in trainable)
        assert nemo_rl_accepts(result) == result["mask_sample"] == result["instance_config"]["mask_sample"]
        assert all(len(item["generation_token_ids"]) <= MAX_NEW_TOKENS for item in trainable)
        # the top-level numbers NeMo RL logs as metrics
        assert result["num_turns"] == len(trainable) and isinstance(result["num_tool_calls"], int)
        assert all(isinstance(result[k], float) for k in ("init_time_s", "run_time_s", "eval_time_s"))
        if result["mask_sample"]:
            assert result["failure_reason"] or result["critical_error"] or result["evaluation"], result

    # every turn went to the policy's servers, under the policy's name, and none to the service's own backend
    turns = sum(result["num_turns"] for _, result in results)
    assert handoff.chat_requests() - before == turns
    assert all(app.state.requests["/v1/chat/completions"] > 0 for app in handoff.policy_apps)
    assert all(set(app.state.models) == {POLICY} for app in handoff.policy_apps)
    backends = (await handoff.status(agent))["llm_backends"]
    assert sorted(b["address"] for b in backends) == sorted(normalize_address(u) for u in handoff.policy_urls)
    assert all(b["model"] == POLICY and b["healthy"] for b in backends)


@pytest.mark.parametrize("agent", AGENTS)
async def test_an_off_policy_top_p_fails_that_rollout_and_leaves_every_backend_healthy(
    handoff: Handoff, agent: str
) -> None:
    row = json.loads(EXAMPLE.open().readline())
    [(_, result)] = await handoff.run_examples(stamped([row], agent, top_p=0.5))

    assert result["critical_error"] == "run" and result["num_turns"] == 0
    assert "top_p=0.5" in result["failure_reason"] and "HTTP 500" in result["failure_reason"]
    assert result["mask_sample"] and result["instance_config"]["mask_sample"]
    backends = (await handoff.status(agent))["llm_backends"]
    assert len(backends) == 2 and all(b["healthy"] and b["consecutive_failures"] == 0 for b in backends)


@pytest.mark.parametrize("agent", AGENTS)
async def test_token_mode_against_nemo_rls_server_fails_fast_saying_why(handoff: Handoff, agent: str) -> None:
    row = json.loads(EXAMPLE.open().readline())
    before = handoff.chat_requests()
    [(_, result)] = await handoff.run_examples(stamped([row], agent + TOKENS))

    assert result["critical_error"] == "run" and result["num_turns"] == 0 and result["mask_sample"]
    assert "/v1/completions" in result["failure_reason"] and "generation_mode=chat" in result["failure_reason"]
    assert handoff.chat_requests() == before
    backends = (await handoff.status(agent + TOKENS))["llm_backends"]
    assert len(backends) == 2 and all(b["healthy"] and b["failures"] == 0 for b in backends)


@pytest.mark.parametrize("agent", AGENTS)
async def test_a_sandbox_failing_before_the_first_turn_yields_a_masked_result_nemo_rl_accepts(
    handoff: Handoff, agent: str
) -> None:
    row = json.loads(EXAMPLE.open().readline()) | {"prorl_task": UNREACHABLE_TASK}
    [(_, result)] = await handoff.run_examples(stamped([row], agent))

    assert result["critical_error"] == "init" and "seed_session" in result["failure_reason"]
    assert nemo_rl_accepts(result) is True  # one real turn of the policy on the first prompt, masked
    assert result["num_turns"] == 0 and result["mask_sample"] is True
    [turn] = [item for item in result["response"]["output"] if item.get("generation_token_ids")]
    assert len(turn["generation_token_ids"]) <= MAX_NEW_TOKENS
