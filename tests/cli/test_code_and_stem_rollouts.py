"""`prorl rollout task=code/humaneval` and `task=stem/...` run real rollouts with the embedded model (the session's
llama.cpp server), graded in the sandbox; `prorl bench code` runs and ends with its ratio."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from conftest import TEST_N_CTX

from nemo_gym_prorl.contracts.trajectory import TOKEN_FIELDS, Trajectory, contiguity_violation
from nemo_gym_prorl.models.launcher import LocalModelServer

PRORL = [str(Path(sys.executable).with_name("prorl"))]  # the console script pip installed


def prorl(*args: str, cwd: Path, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*PRORL, *args], capture_output=True, text=True, timeout=timeout, cwd=cwd)


@pytest.mark.parametrize(
    ("task", "n_samples", "full_marks"),
    [("code/humaneval", 1, "all tests passed"), ("stem/arithmetic_choice", 2, "correct")],  # HumanEval prompts are long
)
def test_rollouts_with_the_embedded_model_are_graded(
    task: str, n_samples: int, full_marks: str, model_server: LocalModelServer, tmp_path: Path
) -> None:
    output = tmp_path / "rollouts.jsonl"
    result = prorl(
        "rollout", f"task={task}", "model=remote", f"model.addresses=[{model_server.base_url}]",
        f"model.n_ctx={TEST_N_CTX}", f"n_samples={n_samples}", "limit=1", "sampling.max_tokens=64", f"output={output}",
        cwd=tmp_path, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    trajectories = [Trajectory.model_validate_json(line) for line in output.read_text().splitlines()]
    assert len(trajectories) == n_samples and len({t.instance_id for t in trajectories}) == 1
    for t in trajectories:
        assert t.critical_error is None, t.error
        turns = t.assistant_turns()
        assert turns and contiguity_violation(turns) is None
        assert all(all(field in turn for field in TOKEN_FIELDS) for turn in turns)
        assert t.reward in (0.0, 1.0) and (t.reward == 1.0) == (t.evaluation["reason"] == full_marks), t.evaluation
        if task.startswith("code") and t.submission and t.submission.get("code"):
            assert "tests" in t.evaluation, t.evaluation  # the program ran against the row's tests in a sandbox


def test_code_bench_runs_and_ends_with_the_ratio(tmp_path: Path) -> None:
    result = prorl("bench", "code", "--rounds", "1", "--repeat", "1", cwd=tmp_path, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    lines = result.stdout.strip().splitlines()
    assert "rewards agree on all" in lines[-2], lines
    assert lines[-1].startswith("code grading: ours / Gym's graded programs per second = "), lines
