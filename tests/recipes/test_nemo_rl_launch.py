"""scripts/nemo_rl/: the launch of a NeMo RL run, checked on CPU. NeMo RL itself needs GPUs, so a stand-in for its
examples/nemo_gym/run_grpo_nemo_gym.py records what it was started with: the recipe, the overrides, and the
environment its Gym actor inherits (NeMo RL passes the driver's environment through Ray's runtime_env)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
LAUNCH = REPO / "scripts" / "nemo_rl" / "launch.sh"
LAUNCH_SLURM = REPO / "scripts" / "nemo_rl" / "launch_slurm.sh"
PLUGIN_ROOT = REPO / "nemo_gym_prorl" / "gym"

RUN_GRPO_STANDIN = """
import json, os, sys
record = {"argv": sys.argv, "cwd": os.getcwd(), "env": {k: os.environ.get(k) for k in
          ("NEMO_RL_DIR", "PRORL_DATA_DIR", "NEMO_GYM_EXTRA_ROOTS", "NEMO_GYM_VENV_DIR", "PRORL_SERVICE_TOKEN")}}
open(os.environ["RECORD"], "w").write(json.dumps(record))
"""


def _launch(args: list[str], env: dict[str, str], script: Path = LAUNCH) -> subprocess.CompletedProcess[str]:
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("NEMO_", "PRORL_"))} | env
    return subprocess.run([str(script), *args], capture_output=True, text=True, env=environ, timeout=300)


def test_launch_links_venvs_writes_the_rows_and_starts_nemo_rl_with_the_recipe(tmp_path: Path) -> None:
    nemo_rl = tmp_path / "RL"
    (nemo_rl / "examples" / "nemo_gym").mkdir(parents=True)
    (nemo_rl / "examples" / "nemo_gym" / "run_grpo_nemo_gym.py").write_text(RUN_GRPO_STANDIN)
    record, data, venvs = tmp_path / "record.json", tmp_path / "data", tmp_path / "venvs"
    env = {"RECORD": str(record), "NEMO_GYM_VENV_DIR": str(venvs), "PRORL_SERVICE_TOKEN": "secret"}
    done = _launch(["--recipe", "math", "--nemo-rl-dir", str(nemo_rl), "--data-dir", str(data),
                    "--uv-run", sys.executable, "--", "++grpo.max_num_steps=3"], env)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "PRORL_SERVICE_TOKEN=<set>" in done.stdout and "secret" not in done.stdout

    started = json.loads(record.read_text())
    assert started["argv"][1:] == ["--config", str(REPO / "recipes/grpo/math.yaml"), "++grpo.max_num_steps=3"]
    assert Path(started["cwd"]) == nemo_rl
    assert started["env"] == {"NEMO_RL_DIR": str(nemo_rl), "PRORL_DATA_DIR": str(data),
                              "NEMO_GYM_EXTRA_ROOTS": str(PLUGIN_ROOT), "NEMO_GYM_VENV_DIR": str(venvs),
                              "PRORL_SERVICE_TOKEN": "secret"}  # fmt: skip
    # Gym starts our agent from the venv links, offline (the recipe's skip_venv_if_present)
    agent_venv = venvs / "responses_api_agents" / "prorl_agent" / ".venv"
    assert agent_venv.resolve() == Path(sys.prefix).resolve()
    # the rows the recipe's data paths name, for the agent the recipe starts
    for split in ("train", "validation"):
        rows = [json.loads(line) for line in (data / "math" / f"{split}.jsonl").open()]
        assert rows
        assert all(r["agent_ref"]["name"] == "prorl_agent" and r["prorl_task"] == "math/arithmetic" for r in rows)


def test_the_swe_recipe_relays_to_the_service_url_given(tmp_path: Path) -> None:
    args = ["--recipe", "swe_async", "--nemo-rl-dir", str(tmp_path), "--dry-run"]
    refused = _launch(args, {})
    assert refused.returncode == 2 and "--service-url" in refused.stderr
    done = _launch([*args, "--service-url", "http://rollout-0:8100", "--", "++grpo.max_num_steps=3"], {})
    assert done.returncode == 0, done.stderr
    *_, cd, nemo_rl = done.stdout.strip().splitlines()
    assert cd == f"cd {tmp_path}"
    assert nemo_rl.split() == [
        "uv", "run", "python", "examples/nemo_gym/run_grpo_nemo_gym.py",
        "--config", str(REPO / "recipes/grpo/swe_async.yaml"),
        "++env.nemo_gym.prorl_service_agent.responses_api_agents.prorl_service.url=http://rollout-0:8100",
        "++grpo.max_num_steps=3",
    ]  # fmt: skip
    assert "task=swe/offline split=train" in done.stdout and "agent=prorl_service_agent" in done.stdout


def test_launch_names_what_is_missing_or_unknown(tmp_path: Path) -> None:
    no_recipe = _launch(["--nemo-rl-dir", str(tmp_path)], {})
    assert no_recipe.returncode == 2 and "one of code code_async math math_async stem stem_async swe swe_async" in no_recipe.stderr
    unknown = _launch(["--recipe", "one_gpu", "--nemo-rl-dir", str(tmp_path)], {})  # a shape, not a recipe
    assert unknown.returncode == 2 and "unknown recipe 'one_gpu'" in unknown.stderr
    no_nemo_rl = _launch(["--recipe", "math"], {})
    assert no_nemo_rl.returncode == 2 and "--nemo-rl-dir" in no_nemo_rl.stderr


def test_slurm_launch_submits_the_rollout_node_then_ray_sub_relaying_to_it(tmp_path: Path) -> None:
    env = {"NEMO_RL_DIR": str(tmp_path), "SLURM_ACCOUNT": "acct", "SLURM_PARTITION": "gpu", "CPU_PARTITION": "cpu",
           "CONTAINER_IMAGE_PATH": "nemo-rl.sqsh", "EXP_NAME": "exp", "PRORL_SERVICE_TOKEN": "secret"}  # fmt: skip
    done = _launch(["--dry-run", "++grpo.max_num_steps=3"], env, LAUNCH_SLURM)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    serve = next(line for line in lines if line.startswith("sbatch") and "prorl_serve.sub" in line)
    assert "--partition=cpu" in serve and "--account=acct" in serve
    command = next(line for line in lines if line.startswith("COMMAND="))
    assert f"{LAUNCH} --recipe swe --nemo-rl-dir {tmp_path} --service-url $(cat " in command
    assert "++cluster.num_nodes=4" in command and command.endswith("++grpo.max_num_steps=3")
    assert lines[-1].startswith("sbatch --nodes=4 --account=acct --partition=gpu") and lines[-1].endswith("ray.sub")
    assert "secret" not in done.stdout
    for script in (LAUNCH, LAUNCH_SLURM, REPO / "scripts" / "nemo_rl" / "prorl_serve.sub"):
        assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
