"""`prorl reverify` as a user runs it, on files `prorl rollout` wrote: unchanged graders give the same grades; a
changed grader setting is reported per instance and kept beside the old grade; bad input is one line."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from conftest import TEST_N_CTX
from standin_helpers import running_standin

from nemo_gym_prorl.contracts.task import load_task
from nemo_gym_prorl.contracts.trajectory import Trajectory
from nemo_gym_prorl.models.launcher import LocalModelServer
from nemo_gym_prorl.reverify import Regrader, ReverifyError

PRORL = [str(Path(sys.executable).with_name("prorl"))]


def prorl(*args: str, cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*PRORL, *args], capture_output=True, text=True, timeout=timeout, cwd=cwd)


def read(path: Path) -> list[Trajectory]:
    return [Trajectory.model_validate_json(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def math_rollouts(model_server: LocalModelServer, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Math rollouts as `make rollout` makes them (the CLI, the math task, bwrap), by the real local model."""
    folder = tmp_path_factory.mktemp("math-rollouts")
    output = folder / "rollouts.jsonl"
    result = prorl(
        "rollout", "task=math", "model=remote", f"model.addresses=[{model_server.base_url}]",
        f"model.n_ctx={TEST_N_CTX}", "n_samples=2", "limit=1", "sampling.max_tokens=32", f"output={output}",
        cwd=folder, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    return output


def test_unchanged_graders_give_every_rollout_its_grade_again(math_rollouts: Path) -> None:
    folder = math_rollouts.parent
    output = folder / "regraded.jsonl"
    result = prorl("reverify", str(math_rollouts), f"output={output}", cwd=folder)  # the task: from its record
    assert result.returncode == 0, result.stderr[-2000:]
    before, after = read(math_rollouts), read(output)
    assert [t.trajectory_id for t in after] == [t.trajectory_id for t in before] and len(after) == 2
    for old, new in zip(before, after, strict=True):
        assert old.critical_error is None, old.error
        assert old.submission is not None and "answer" in old.submission  # what grading was given, kept
        record = new.reverify
        assert record is not None and record.skipped is None, record
        assert (record.old_reward, record.reward, new.reward) == (old.reward, old.reward, old.reward)
        assert record.changed is False and new.evaluation == old.evaluation == record.old_evaluation
    assert "2 graded again, 0 changed" in result.stdout, result.stdout
    record = yaml.safe_load(output.with_suffix(".config.yaml").read_text())
    assert record["config"]["task"]["name"] == "math/arithmetic" and record["config"]["input"] == str(math_rollouts)


@pytest.fixture(scope="module")
def standin_model() -> Iterator[str]:
    yield from running_standin(["\\boxed{2}"])  # every reply: the answer 2


def test_a_changed_grader_setting_is_reported_per_instance(standin_model: str, tmp_path: Path) -> None:
    """A gold answer fixed in the task's data (a new answer column its verifier reads) changes one instance's grade."""
    rows = [{"id": "sum-0", "question": "Calculate 1 + 1.", "answer": "2", "fixed": "2"},
            {"id": "sum-1", "question": "Calculate 1 + 2.", "answer": "2", "fixed": "3"}]  # fmt: skip
    (tmp_path / "sums.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    task_yaml = tmp_path / "sums.yaml"
    task = "name: sums\ntype: math\ndataset: {path: sums.jsonl, id_key: id}\nprompt_template: '{question}'\n" \
           "tools: [finish]\nmax_turns: 2\nverifier: {answer_key: %s}\n"  # fmt: skip
    task_yaml.write_text(task % "answer")
    rollouts = tmp_path / "rollouts.jsonl"
    model = ["model=remote", f"model.addresses=[{standin_model}]", "model.served_model_name=standin",
             "model.tool_call_format=codeact"]  # fmt: skip
    result = prorl("rollout", f"task.name={task_yaml}", *model, f"output={rollouts}", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    assert [t.reward for t in read(rollouts)] == [1.0, 1.0]

    task_yaml.write_text(task % "fixed")  # the grader's setting changes in the task config
    regraded = tmp_path / "regraded.jsonl"
    result = prorl("reverify", str(rollouts), f"output={regraded}", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    by_instance = {t.instance_id: t for t in read(regraded)}
    same, fixed = by_instance["sum-0"], by_instance["sum-1"]
    assert same.reward == 1.0 and same.reverify.changed is False
    assert (fixed.reverify.old_reward, fixed.reverify.reward, fixed.reward, fixed.reverify.changed) == (1.0, 0.0, 0.0, True)
    assert fixed.reverify.old_evaluation["reason"] == "correct" and fixed.evaluation["reason"] == "wrong answer"
    assert f"sum-1 [{fixed.trajectory_id[:8]}]: reward 1 → 0 (correct → wrong answer)" in result.stdout
    assert "1 changed (0 up, 1 down" in result.stdout and "mean reward 1 → 0.5" in result.stdout, result.stdout

    # A verifier setting given on the command line wins over the task's: the old key gives the old grades back.
    again = tmp_path / "again.jsonl"
    result = prorl("reverify", str(rollouts), "+verifier.answer_key=answer", f"output={again}", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    assert [t.reward for t in read(again)] == [1.0, 1.0] and "0 changed" in result.stdout


@pytest.fixture(scope="module")
def programmer_model() -> Iterator[str]:
    yield from running_standin(["```python\na, b = map(int, input().split())\nprint(a + b)\n```"])


def test_code_rollouts_are_graded_again_in_a_sandbox_with_the_new_setting(programmer_model: str, tmp_path: Path) -> None:
    """The program is run again, in a fresh sandbox, by the code grader; partial credit turned on changes its reward."""
    tests = {"inputs": ["1 2\n", "5 7\n"], "outputs": ["3\n", "13\n"]}  # the second gold output is wrong
    (tmp_path / "add.jsonl").write_text(json.dumps({"id": "add", "question": "Print a + b.",
                                                    "verifier_metadata": {"unit_tests": tests}}) + "\n")
    task_yaml = tmp_path / "add.yaml"
    task_yaml.write_text("name: add\ntype: code\ndataset: {path: add.jsonl, id_key: id}\nprompt_template: '{question}'\n"
                         "tools: [finish]\nmax_turns: 1\n")  # fmt: skip
    rollouts = tmp_path / "rollouts.jsonl"
    model = ["model=remote", f"model.addresses=[{programmer_model}]", "model.served_model_name=standin",
             "model.tool_call_format=hermes"]  # fmt: skip  (the python block is the reply, not a tool call)
    result = prorl("rollout", f"task.name={task_yaml}", *model, f"output={rollouts}", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    [old] = read(rollouts)
    assert old.reward == 0.0 and "print(a + b)" in old.submission["code"], old.evaluation

    regraded = tmp_path / "regraded.jsonl"
    result = prorl("reverify", str(rollouts), "+verifier.partial_reward=true", f"output={regraded}", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    [new] = read(regraded)
    assert (new.reverify.old_reward, new.reward, new.reverify.changed) == (0.0, 0.5, True), new.evaluation
    assert f"add [{new.trajectory_id[:8]}]: reward 0 → 0.5" in result.stdout, result.stdout


def test_what_cannot_be_graded_again_is_one_line(tmp_path: Path) -> None:
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"instance_id": "a", "trajectory_id": "b"}\n{"reward": 1}\n')
    result = prorl("reverify", str(broken), "task=math", cwd=tmp_path, timeout=60)
    assert result.returncode == 2 and result.stderr.strip().splitlines() == [
        f"prorl: error: {broken}:2: not a trajectory (instance_id: Field required)"
    ], result.stderr
    result = prorl("reverify", str(broken), cwd=tmp_path, timeout=60)  # no record beside it names the task
    assert result.returncode == 2 and "give task=NAME" in result.stderr, result.stderr


def test_a_task_its_gym_server_grades_is_refused_before_anything_loads() -> None:
    """A Gym task's reward comes from its server's live session, which no file holds: refused, not graded wrong."""
    gym_task = load_task("math/arithmetic").model_copy(update={"type": "gym", "resources_server_url": "http://127.0.0.1:9", "verifier": {}})
    with pytest.raises(ReverifyError, match="graded by a NeMo Gym resources server"):
        Regrader(gym_task, "bwrap", concurrency=1)
