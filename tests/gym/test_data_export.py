"""`prorl data export`: task instances as the NeMo Gym rows NeMo RL's GRPO reads (NemoGymDataset), split
deterministically into train and validation."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import yaml
from nemo_gym.base_resources_server import BaseRunRequest

from nemo_gym_prorl.cli import main
from nemo_gym_prorl.contracts.task import TASKS_DIR, TaskInstance, load_task
from nemo_gym_prorl.envs import make_environment
from nemo_gym_prorl.gym.data_export import ExportRequest, ExportUsageError, nemo_rl_rows, parse_export_args

MATH = "math/arithmetic"


def _rows(task: str, split: str, **extra) -> list[dict]:
    return nemo_rl_rows(ExportRequest(task=task, split=split, output=Path("unused.jsonl"), **extra))


def test_math_rows_carry_the_rendered_prompt_tools_agent_task_and_columns() -> None:
    rows = _rows(MATH, "train")
    task = load_task(MATH)
    env = make_environment(task, "bwrap")
    for row in rows:
        BaseRunRequest.model_validate(row)  # what Gym's agents take on /run
        assert row["agent_ref"] == {"type": "responses_api_agents", "name": "prorl_agent"}
        assert row["prorl_task"] == MATH
        assert {"id", "question", "answer"} <= row.keys() and row["instance_id"] == row["id"]
        instance = TaskInstance(instance_id=row["id"], data={k: row[k] for k in ("id", "question", "answer")})
        params = row["responses_create_params"]
        assert params["input"] == env.prompt_messages(instance)
        assert [tool["name"] for tool in params["tools"]] == task.tools  # hermes: the model sees the schemas


def test_splits_are_disjoint_complete_and_the_same_whatever_the_row_order(tmp_path: Path) -> None:
    train, validation = _rows(MATH, "train"), _rows(MATH, "validation")
    ids = {r["instance_id"] for r in train}, {r["instance_id"] for r in validation}
    total = sum(1 for _ in (TASKS_DIR / "math/data/arithmetic.jsonl").open())
    assert not ids[0] & ids[1] and len(ids[0] | ids[1]) == total
    assert len(ids[1]) == round(0.1 * total)  # the task YAML's default validation_fraction

    # the same task over the same rows shuffled: the same split
    lines = (TASKS_DIR / "math/data/arithmetic.jsonl").read_text().splitlines()
    random.Random(0).shuffle(lines)
    (tmp_path / "shuffled.jsonl").write_text("\n".join(lines) + "\n")
    raw = yaml.safe_load((TASKS_DIR / "math/arithmetic.yaml").read_text())
    raw["dataset"]["path"] = "shuffled.jsonl"
    (tmp_path / "task.yaml").write_text(yaml.safe_dump(raw))
    assert {r["instance_id"] for r in _rows(str(tmp_path / "task.yaml"), "validation")} == ids[1]


def test_a_validation_file_of_its_own_is_the_validation_split(tmp_path: Path) -> None:
    source = (TASKS_DIR / "math/data/arithmetic.jsonl").read_text().splitlines()
    (tmp_path / "train.jsonl").write_text("\n".join(source[:5]) + "\n")
    (tmp_path / "val.jsonl").write_text("\n".join(source[5:7]) + "\n")
    raw = yaml.safe_load((TASKS_DIR / "math/arithmetic.yaml").read_text())
    raw["dataset"] = {"path": "train.jsonl", "validation_path": "val.jsonl", "id_key": "id"}
    (tmp_path / "task.yaml").write_text(yaml.safe_dump(raw))
    task = str(tmp_path / "task.yaml")
    assert [r["id"] for r in _rows(task, "train")] == [json.loads(line)["id"] for line in source[:5]]
    assert [r["id"] for r in _rows(task, "validation")] == [json.loads(line)["id"] for line in source[5:7]]


def test_codeact_rows_carry_no_tool_schemas_and_the_relay_agent_can_be_named() -> None:
    rows = _rows(MATH, "validation", tool_call_format="codeact", agent="prorl_service_agent", limit=2)
    assert len(rows) == 2
    assert all("tools" not in r["responses_create_params"] for r in rows)
    assert all(r["agent_ref"]["name"] == "prorl_service_agent" for r in rows)


def test_several_tasks_export_into_one_file_each_row_naming_its_task() -> None:
    rows = _rows("stem/algebra,stem/units", "validation")
    assert {r["prorl_task"] for r in rows} == {"stem/algebra", "stem/units"}
    assert rows == _rows("stem/algebra", "validation") + _rows("stem/units", "validation")


def test_bad_arguments_are_named() -> None:
    with pytest.raises(ExportUsageError, match="split='test'"):
        parse_export_args(["task=math/arithmetic", "split=test", "output=x.jsonl"])
    with pytest.raises(ExportUsageError, match="output: Field required"):
        parse_export_args(["task=math/arithmetic", "split=train"])
    with pytest.raises(ExportUsageError, match="unknown argument 'fraction=0.2'"):
        parse_export_args(["fraction=0.2"])


def test_prorl_data_export_writes_the_jsonl_nemo_rl_reads(tmp_path: Path) -> None:
    prorl = [sys.executable, "-m", "nemo_gym_prorl.cli"]
    output = tmp_path / "math" / "validation.jsonl"
    done = subprocess.run([*prorl, "data", "export", f"task={MATH}", "split=validation", f"output={output}"],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    lines = output.read_text().splitlines()
    assert f"wrote {len(lines)} validation rows of {MATH}" in done.stdout
    # one JSON object a line, as NemoGymDataset reads them
    assert [json.loads(line) for line in lines] == _rows(MATH, "validation")



def test_data_export_help_says_validation_sets_are_used_whole_and_errors_are_one_line(capsys) -> None:
    main(["data", "export", "--help"])
    assert "uses a validation set whole" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_:
        main(["data", "export", "task=nope", "split=train", "output=x.jsonl"])
    assert exit_.value.code == 2 and "unknown task 'nope'" in capsys.readouterr().err


@pytest.mark.parametrize("agent", ["prorl_agent", "prorl_service_agent"])
def test_rows_route_through_gym_by_task_source_without_the_deprecated_path(agent: str) -> None:
    """Gym's rollout collection warns that rows routed by their `agent_ref` alone are a deprecated path; exported
    rows also name their `task_source` (the agent's config instance), which Gym's own resolution routes to that
    agent when NeMo RL's stamping of `agent_ref` is gone."""
    from nemo_gym.rollout_collection import RolloutCollectionHelper
    from omegaconf import OmegaConf

    config = OmegaConf.create({agent: {"responses_api_agents": {agent: {"entrypoint": "app.py"}}}})
    rows = _rows(MATH, "train", agent=agent, limit=2)
    assert all(row["task_source"] == agent for row in rows)
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        RolloutCollectionHelper.resolve_task_sources(rows, config)  # as exported: agent_ref and task_source
    for row in rows:
        del row["agent_ref"]
    RolloutCollectionHelper.resolve_task_sources(rows, config)
    assert [row["agent_ref"] for row in rows] == [{"name": agent}] * 2
