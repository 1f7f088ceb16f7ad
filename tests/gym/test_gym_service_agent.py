"""NeMo Gym drives our rollout service as its agent: `gym eval run --no-serve` sends each dataset row through Gym's
legacy_agent environment server to our shipped agent `responses_api_agents/prorl_service`, which relays `/run` to
the service, and writes back what the service returned — rows whose output items carry token ids that pass NeMo
RL's contiguity check, with the service's reward — then the run's metrics, from the service's `/aggregate_metrics`.

The service requires a bearer token, which reaches the agent as `prorl serve` reads it: `$PRORL_SERVICE_TOKEN`.
It runs in this process on the real local model (SmolLM2 on llama.cpp), the math task, bubblewrap sandboxes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from nemo_gym.path_utils import aggregate_metrics_path_for

from nemo_gym_prorl.bench.throughput import link_venvs
from nemo_gym_prorl.contracts.trajectory import TOKEN_FIELDS, contiguity_violation
from nemo_gym_prorl.gym import PLUGIN_ROOT
from nemo_gym_prorl.gym.processes import gym_env_start, gym_environ, run_gym
from nemo_gym_prorl.launch.runtime import TOKEN_ENV, ModelConfig, ServiceConfig, ServiceSettings
from nemo_gym_prorl.launch.serve import run_service
from nemo_gym_prorl.models.launcher import LocalModelConfig, LocalModelServer
from nemo_gym_prorl.service.pipeline import PipelineConfig, StageConfig

pytestmark = pytest.mark.slow

EXAMPLE = PLUGIN_ROOT / "resources_servers" / "prorl_math" / "data" / "example.jsonl"
AGENT_TYPE = "prorl_service"  # responses_api_agents/prorl_service in our plugin root
AGENT = "prorl_service_agent"
ENVIRONMENT_SERVER = "prorl_service_environment_server"
TOKEN = "gym-relay-s3cret"
ROWS = 2
MAX_OUTPUT_TOKENS = 48


def trainable_items(rollout: dict[str, Any]) -> list[dict[str, Any]]:
    return [item for item in rollout["response"]["output"] if item.get("generation_token_ids")]


async def test_gym_eval_run_collects_rollouts_from_our_service_as_its_agent(tmp_path: Path) -> None:
    venvs = link_venvs(tmp_path / "venvs")
    environ = gym_environ(venvs) | {TOKEN_ENV: TOKEN}
    async with LocalModelServer(LocalModelConfig(n_ctx=4096)) as model:
        stage = StageConfig(workers=2)
        settings = ServiceSettings(
            port=0, tasks=["math/arithmetic"], store=tmp_path / "jobs.db", token=TOKEN,
            pipeline=PipelineConfig(init=stage, run=stage, eval=stage, max_live_sandboxes=2),
        )  # fmt: skip
        config = ServiceConfig(
            service=settings,
            model=ModelConfig(
                kind="remote", addresses=[model.base_url], served_model_name=model.config.served_model_name
            ),
        )
        async with run_service(config) as service:
            url = f"++{AGENT}.responses_api_agents.{AGENT_TYPE}.url={service.url}"
            start = gym_env_start(["--agent-type", AGENT_TYPE, url], environ, tmp_path, tmp_path / "env_start.log")
            async with start as env:
                assert set(env.servers) == {AGENT, ENVIRONMENT_SERVER}
                output = tmp_path / "rollouts" / "rollouts.jsonl"
                await run_gym(
                    [
                        "eval", "run", "--no-serve", "--agent", AGENT, "--input", str(EXAMPLE), "--output", str(output),
                        "--limit", str(ROWS), "--max-output-tokens", str(MAX_OUTPUT_TOKENS),
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
        assert rollout["_ng_environment_server"] == ENVIRONMENT_SERVER
        # our service's result, as its /run returned it
        assert rollout["trajectory_id"] and rollout["critical_error"] is None, rollout.get("failure_reason")
        assert not rollout["mask_sample"]  # so every reward counts in the metrics below
        assert isinstance(rollout["reward"], float) and 0.0 <= rollout["reward"] <= 1.0
        assert rollout["responses_create_params"]["max_output_tokens"] == MAX_OUTPUT_TOKENS
        items = trainable_items(rollout)
        assert items, "no output item carries token ids"
        for item in items:
            assert all(item.get(field) for field in TOKEN_FIELDS), item.keys()
            assert len(item["generation_token_ids"]) <= MAX_OUTPUT_TOKENS  # the row's limit reached the model
        assert contiguity_violation(items) is None, contiguity_violation(items)

    # the run's metrics: the service's /aggregate_metrics over these rollouts, as Gym wrote them
    [metrics] = json.loads(aggregate_metrics_path_for(output).read_text())
    assert metrics["agent_ref"] == {"name": AGENT} and metrics["_ng_environment_server"] == ENVIRONMENT_SERVER
    rewards = [rollout["reward"] for rollout in rollouts]
    assert metrics["agent_metrics"]["mean/reward"] == pytest.approx(sum(rewards) / ROWS)
    assert metrics["key_metrics"]["mean/reward"] == metrics["agent_metrics"]["mean/reward"]
    assert len(metrics["group_level_metrics"]) == ROWS  # one per row (task index)
