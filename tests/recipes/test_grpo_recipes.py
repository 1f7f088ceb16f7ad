"""recipes/grpo/: NeMo RL GRPO recipes that train through NeMo Gym and our agents.

NeMo RL is not installable here (its PyPI package is a placeholder), so the recipes are composed the way its
`nemo_rl.utils.config.load_config` composes them — `defaults:` (a file or a list, relative to the recipe), a
top-level section marked `_override_: true` replacing the inherited one — over a stand-in for the one NeMo RL file
they inherit, holding that file's keys the recipes must change. Every key the hand-off needs is then checked.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from omegaconf import DictConfig, OmegaConf

from nemo_gym_prorl.contracts.task import load_task, task_path

REPO = Path(__file__).resolve().parents[2]
GRPO = REPO / "recipes" / "grpo"
PLUGIN_ROOT = REPO / "nemo_gym_prorl" / "gym"
VLLM_FOR_TRAINING = "responses_api_models/vllm_model/configs/vllm_model_for_training.yaml"

# The keys of NeMo RL's examples/configs/grpo_math_1B.yaml (as of NeMo RL 7ea279a) that a Gym run must change.
NEMO_RL_MATH_1B = """
grpo: {num_prompts_per_step: 32, num_generations_per_prompt: 16, max_val_samples: 256, val_batch_size: 256,
       async_grpo: {enabled: false, max_trajectory_age_steps: 1, in_flight_weight_updates: false}}
loss_fn: {use_importance_sampling_correction: false}
policy:
  model_name: Qwen/Qwen2.5-1.5B
  train_global_batch_size: 512
  max_total_sequence_length: 512
  generation:
    backend: vllm
    top_k: null
    stop_token_ids: null
    stop_strings: null
    vllm_cfg: {async_engine: false, expose_http_server: false, gpu_memory_utilization: 0.6}
    colocated: {enabled: true, resources: {gpus_per_node: null, num_nodes: null}}
data:
  max_input_seq_length: ${policy.max_total_sequence_length}
  train: {dataset_name: OpenMathInstruct-2, split_validation_size: 0.05}
  validation: null
  default: {prompt_file: examples/prompts/cot.txt, system_prompt_file: null, processor: math_hf_data_processor,
            env_name: math}
env: {math: {num_workers: 8, math_verify_impl: hf_math_verify}}
logger: {log_dir: logs}
checkpointing: {checkpoint_dir: results/grpo}
cluster: {gpus_per_node: 1, num_nodes: 1}
"""

RECIPES = {  # recipe: (task type, async, agent)
    "math": ("math", False, "prorl_agent"),
    "math_async": ("math", True, "prorl_agent"),
    "code": ("code", False, "prorl_agent"),
    "code_async": ("code", True, "prorl_agent"),
    "stem": ("stem", False, "prorl_agent"),
    "stem_async": ("stem", True, "prorl_agent"),
    "swe": ("swe", False, "prorl_service_agent"),
    "swe_async": ("swe", True, "prorl_service_agent"),
}


def _load_with_defaults(path: Path) -> DictConfig:
    """NeMo RL's load_config: parents first (in order), then this file; `_override_` replaces a top-level section."""
    config = OmegaConf.load(path)
    defaults = config.pop("defaults", None)
    if defaults is None:
        return config
    merged = OmegaConf.create({})
    for parent in [defaults] if isinstance(defaults, str) else [str(d) for d in defaults]:
        merged = _merge(merged, _load_with_defaults(path.parent / parent if not parent.startswith("/") else Path(parent)))
    return _merge(merged, config)


def _merge(base: DictConfig, override: DictConfig) -> DictConfig:
    for key in list(override.keys()):
        if isinstance(override[key], DictConfig) and override[key].get("_override_", False):
            override[key].pop("_override_")
            base.pop(key, None)
    return OmegaConf.merge(base, override)  # type: ignore[return-value]


@pytest.fixture
def compose(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    nemo_rl = tmp_path / "RL"
    (nemo_rl / "examples" / "configs").mkdir(parents=True)
    (nemo_rl / "examples" / "configs" / "grpo_math_1B.yaml").write_text(NEMO_RL_MATH_1B)
    monkeypatch.setenv("NEMO_RL_DIR", str(nemo_rl))
    monkeypatch.setenv("PRORL_DATA_DIR", "/data")
    monkeypatch.setenv("NEMO_GYM_EXTRA_ROOTS", str(PLUGIN_ROOT))
    if not OmegaConf.has_resolver("mul"):  # NeMo RL registers it (register_omegaconf_resolvers)
        OmegaConf.register_new_resolver("mul", lambda a, b: a * b)

    def composed(name: str) -> dict[str, Any]:
        return OmegaConf.to_container(_load_with_defaults(GRPO / f"{name}.yaml"), resolve=True)  # type: ignore[return-value]

    return composed


def _keys(node: Any) -> set[str]:
    if isinstance(node, dict):
        return set(node) | {k for v in node.values() for k in _keys(v)}
    if isinstance(node, list):
        return {k for v in node for k in _keys(v)}
    return set()


def test_every_recipe_file_parses_with_omegaconf() -> None:
    files = sorted(GRPO.glob("*.yaml"))
    assert {f.stem for f in files} >= set(RECIPES)
    for file in files:
        assert isinstance(OmegaConf.load(file), DictConfig), file


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_recipe_hands_every_rollout_to_our_gym_agent(name: str, compose) -> None:
    task_type, is_async, agent = RECIPES[name]
    config = compose(name)
    assert "_override_" not in _keys(config)

    # the Gym environment, NeMo RL's math environment gone
    env = config["env"]
    assert env["should_use_nemo_gym"] is True and "math" not in env
    gym = env["nemo_gym"]
    assert gym["skip_venv_if_present"] is True
    vllm_config, agent_config = gym["config_paths"]
    assert vllm_config == VLLM_FOR_TRAINING
    assert (PLUGIN_ROOT / agent_config).is_file()  # inside the package: our plugin root
    agent_block = yaml.safe_load((PLUGIN_ROOT / agent_config).read_text())[agent]
    assert "responses_api_agents" in agent_block

    # the data: Gym rows as `prorl data export` writes them, for the agent the recipe starts
    data = config["data"]
    assert data["default"] == {"dataset_name": "NemoGymDataset", "processor": "nemo_gym_data_processor",
                               "env_name": "nemo_gym", "prompt_file": None, "system_prompt_file": None}  # fmt: skip
    assert data["train"] == {"data_path": f"/data/{task_type}/train.jsonl"}
    assert data["validation"] == {"data_path": f"/data/{task_type}/validation.jsonl"}
    assert data["max_input_seq_length"] is None
    assert config["grpo"]["max_val_samples"] is None  # run_grpo_nemo_gym.py refuses any other value

    # generation: what NeMo RL's Gym path asserts, and what our agents send
    generation = config["policy"]["generation"]
    assert generation["top_k"] is None and generation["stop_strings"] is None and generation["stop_token_ids"] is None
    vllm = generation["vllm_cfg"]
    assert vllm["async_engine"] is True and vllm["expose_http_server"] is True
    # the agents' model speaks Hermes tool calls: the server must parse them into tool_calls
    assert vllm["http_server_serving_chat_kwargs"] == {"enable_auto_tools": True, "tool_parser": "hermes"}
    assert config["policy"]["train_global_batch_size"] == (
        config["grpo"]["num_prompts_per_step"] * config["grpo"]["num_generations_per_prompt"]
    )

    # sync or async; async never updates weights under a rollout in flight
    grpo_async = config["grpo"]["async_grpo"]
    assert grpo_async["enabled"] is is_async
    assert grpo_async["in_flight_weight_updates"] is False
    assert generation["colocated"]["enabled"] is (not is_async)  # NeMo RL's async path needs vLLM on its own GPUs
    if is_async:
        assert config["loss_fn"]["use_importance_sampling_correction"] is True
        assert grpo_async["max_trajectory_age_steps"] == 1


@pytest.mark.parametrize("name", ["math", "code", "stem"])
def test_single_node_recipes_start_the_service_in_gym_with_tasks_of_their_type(name: str, compose) -> None:
    config = compose(name)
    assert config["cluster"] == {"gpus_per_node": 1, "num_nodes": 1}
    assert compose(f"{name}_async")["cluster"] == {"gpus_per_node": 2, "num_nodes": 1}
    service = config["env"]["nemo_gym"]["prorl_agent"]["responses_api_agents"]["prorl_agent"]["rollout_service"]
    tasks = service["service"]["tasks"]
    assert tasks and all(load_task(task).type == name for task in tasks)


def test_the_swe_recipe_is_multi_node_with_rollouts_on_prorl_serve(compose) -> None:
    for name in ("swe", "swe_async"):
        config = compose(name)
        assert config["cluster"]["num_nodes"] > 1 and config["cluster"]["gpus_per_node"] == 8
        assert config["env"]["nemo_gym"]["config_paths"][1].startswith("responses_api_agents/prorl_service/")
    assert compose("swe_async")["policy"]["generation"]["colocated"]["resources"]["num_nodes"] == 1
    # the task another session generates the data of (tasks/swe/offline.yaml)
    assert yaml.safe_load(task_path("swe/offline").read_text())["type"] == "swe"


def test_config_paths_resolve_where_nemo_gym_looks(compose, monkeypatch: pytest.MonkeyPatch) -> None:
    """Gym's own lookup: NEMO_GYM_EXTRA_ROOTS (our plugin root), then the working directory, then its install."""
    from nemo_gym import _resolve_under_cwd_or_install

    monkeypatch.chdir("/")
    for name in RECIPES:
        for entry in compose(name)["env"]["nemo_gym"]["config_paths"]:
            assert _resolve_under_cwd_or_install(entry).is_file(), (name, entry)
