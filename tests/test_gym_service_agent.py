"""NeMo Gym drives our rollout service as its agent: `gym eval run --no-serve` sends each dataset row through Gym's
legacy_agent environment server to an agent whose `/run` is our service's, and writes back what the service
returned — rows whose output items carry token ids that pass NeMo RL's contiguity check, with the service's reward.

Gym reaches agents only by a server instance it started (an agent config needs an entrypoint, and `gym env start`
launches every entrypoint), so an agent cannot simply name an outside URL. The agent here is a relay Gym starts,
`responses_api_agents/prorl_service_relay`, written into a scratch plugin root: it forwards `/run` to the service
at its configured `url` and answers with the service's reply unchanged. The service runs in this process on the
real local model (SmolLM2 on llama.cpp), the math task, bubblewrap sandboxes.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest

from nemo_gym_prorl.bench.throughput import link_venvs
from nemo_gym_prorl.gym.processes import gym_env_start, gym_environ, run_gym
from nemo_gym_prorl.gym import PLUGIN_ROOT
from nemo_gym_prorl.models.launcher import LocalModelConfig, LocalModelServer
from nemo_gym_prorl.service.pipeline import PipelineConfig, StageConfig
from nemo_gym_prorl.service.runtime import ModelConfig, ServiceConfig, ServiceSettings
from nemo_gym_prorl.service.serve import run_service
from nemo_gym_prorl.service.trajectory import TOKEN_FIELDS, contiguity_violation

pytestmark = pytest.mark.slow

EXAMPLE = PLUGIN_ROOT / "resources_servers" / "prorl_math" / "data" / "example.jsonl"
RELAY = "prorl_service_relay"
AGENT = "prorl_service_agent"
ROWS = 2
MAX_OUTPUT_TOKENS = 48

RELAY_APP = '''\
"""A Gym agent server that relays `/run` to an agent service Gym does not start, at `url`."""

import httpx
from fastapi import Body, FastAPI, Request, Response

from nemo_gym.base_responses_api_agent import BaseResponsesAPIAgentConfig, SimpleResponsesAPIAgent


class RelayConfig(BaseResponsesAPIAgentConfig):
    url: str


class Relay(SimpleResponsesAPIAgent):
    ray_enabled = False
    config: RelayConfig

    def setup_webserver(self) -> FastAPI:
        app = FastAPI()
        app.post("/run")(self.relay)
        return app

    async def relay(self, request: Request) -> Response:
        async with httpx.AsyncClient(timeout=None, trust_env=False) as client:
            upstream = await client.post(
                f"{self.config.url}/run", content=await request.body(), headers={"content-type": "application/json"}
            )
        return Response(upstream.content, status_code=upstream.status_code, media_type="application/json")

    async def responses(self, body=Body()):
        raise NotImplementedError("the relayed service runs whole rollouts: POST /run")

    async def run(self, body=Body()):
        raise NotImplementedError("served by relay")


if __name__ == "__main__":
    Relay.run_webserver()
'''


def scratch_plugin_root(root: Path, service_url: str) -> Path:
    """The relay agent, and the config naming it as the agent of a legacy_agent environment server."""
    relay = root / "responses_api_agents" / RELAY
    relay.mkdir(parents=True)
    (relay / "app.py").write_text(RELAY_APP)
    (relay / "requirements.txt").write_text("nemo-gym\n")  # marks the folder as a server; never installed here
    config = root / "prorl_service_agent.yaml"
    config.write_text(
        f"{AGENT}:\n  responses_api_agents:\n    {RELAY}:\n      entrypoint: app.py\n      url: {service_url}\n"
        f"{AGENT}_environment_server:\n  environment_servers:\n    legacy_agent:\n      entrypoint: app.py\n"
        f"      agent_server: {{type: responses_api_agents, name: {AGENT}}}\n"
    )
    return config


def relay_venv_link(venvs: Path) -> None:
    link = venvs / "responses_api_agents" / RELAY / ".venv"
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(Path(sys.prefix).resolve(), target_is_directory=True)


def trainable_items(rollout: dict[str, Any]) -> list[dict[str, Any]]:
    return [item for item in rollout["response"]["output"] if item.get("generation_token_ids")]


async def test_gym_eval_run_collects_rollouts_from_our_service_as_its_agent(tmp_path: Path) -> None:
    venvs = link_venvs(tmp_path / "venvs")
    relay_venv_link(venvs)
    environ = gym_environ(venvs)
    async with LocalModelServer(LocalModelConfig(n_ctx=4096)) as model:
        stage = StageConfig(workers=2)
        settings = ServiceSettings(
            port=0, tasks=["math/arithmetic"], store=tmp_path / "jobs.db",
            pipeline=PipelineConfig(init=stage, run=stage, eval=stage, max_live_sandboxes=2),
        )  # fmt: skip
        config = ServiceConfig(
            service=settings,
            model=ModelConfig(
                kind="remote", addresses=[model.base_url], served_model_name=model.config.served_model_name
            ),
        )
        async with run_service(config) as service:
            root = tmp_path / "plugin-root"
            agent_config = scratch_plugin_root(root, service.url)
            environ["NEMO_GYM_EXTRA_ROOTS"] = os.pathsep.join([str(root), environ["NEMO_GYM_EXTRA_ROOTS"]])
            start = gym_env_start(["--config", str(agent_config)], environ, tmp_path, tmp_path / "env_start.log")
            async with start as env:
                assert set(env.servers) == {AGENT, f"{AGENT}_environment_server"}
                output = tmp_path / "rollouts" / "rollouts.jsonl"
                await run_gym(
                    [
                        "eval", "run", "--no-serve", "--agent", AGENT, "--input", str(EXAMPLE), "--output", str(output),
                        "--limit", str(ROWS), "--max-output-tokens", str(MAX_OUTPUT_TOKENS), "--disable-aggregation",
                        f"+head_server.port={env.head_port}", f"hydra.run.dir={tmp_path / 'hydra-eval'}",
                    ],
                    environ, tmp_path, timeout_s=300,
                )  # fmt: skip
            finished = service.orchestrator.finished_rollouts

    rollouts = [json.loads(line) for line in output.open()]
    rows = [json.loads(line) for line in EXAMPLE.open()][:ROWS]
    assert sorted(r["instance_id"] for r in rollouts) == sorted(r["instance_id"] for r in rows)
    assert sum(finished.values()) == ROWS, "every row ran as one rollout of our service"
    for rollout in rollouts:
        assert rollout["_ng_result_type"] == "legacy_agent"
        assert rollout["_ng_environment_server"] == f"{AGENT}_environment_server"
        # our service's result, as its /run returned it
        assert rollout["trajectory_id"] and rollout["critical_error"] is None, rollout.get("failure_reason")
        assert isinstance(rollout["reward"], float) and 0.0 <= rollout["reward"] <= 1.0
        assert rollout["responses_create_params"]["max_output_tokens"] == MAX_OUTPUT_TOKENS
        items = trainable_items(rollout)
        assert items, "no output item carries token ids"
        for item in items:
            assert all(item.get(field) for field in TOKEN_FIELDS), item.keys()
            assert len(item["generation_token_ids"]) <= MAX_OUTPUT_TOKENS  # the row's limit reached the model
        assert contiguity_violation(items) is None, contiguity_violation(items)
