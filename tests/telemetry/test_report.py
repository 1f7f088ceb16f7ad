"""What `prorl rollout` prints when it ends, read as a user reads it: the summary written by the real report (the
JSONL written, the bar drawn), printed to an 80-column console as on a terminal that is not one (make, CI, logs)."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from rich.console import Console

from nemo_gym_prorl.contracts.progress import Generated
from nemo_gym_prorl.contracts.trajectory import Trajectory
from nemo_gym_prorl.telemetry.report import RolloutReport


def trajectory(job: str, sample: int, reward: float) -> Trajectory:
    """A trajectory as a JSONL row of the service holds one: sample `sample` of job `job` (one instance's group)."""
    return Trajectory.model_validate({
        "instance_id": f"instance-{job}", "trajectory_id": f"{job}:{sample}", "reward": reward,
        "resolved": reward == 1.0, "finish": "answer",
        "messages": [{"role": "user", "content": "Calculate 6 * 7."},
                     {"role": "assistant", "content": "42", "prompt_token_ids": [1, 2], "generation_token_ids": [3],
                      "generation_log_probs": [-0.1]}],
    })  # fmt: skip


def printed_summary(output: Path, trajectories: list[Trajectory]) -> str:
    """Run the report over `trajectories` as `prorl rollout` does and give the summary it prints, 80 columns wide."""
    with RolloutReport(output, "math/arithmetic") as report:
        report.expect(len(trajectories))
        for t in trajectories:
            report.add(t)
    text = io.StringIO()
    report.print_summary(Console(file=text, width=80))
    return text.getvalue()


def row(summary: str, name: str) -> str:
    (line,) = [line for line in summary.splitlines() if name in line]
    return line


def test_output_path_and_view_command_are_printed_whole(tmp_path: Path) -> None:
    output = tmp_path / ("a-run-folder-whose-name-alone-is-long-" * 3) / "rollouts.jsonl"
    assert len(str(output)) > 120
    summary = printed_summary(output, [trajectory("j1", 0, 1.0)])
    lines = summary.splitlines()
    assert f"rollouts: {output}" in lines
    assert f"view them: prorl view {output}" in lines
    assert output.is_file()


def test_groups_say_how_many_have_a_reward_spread(tmp_path: Path) -> None:
    runs = [trajectory("job-a", i, r) for i, r in enumerate([0, 1, 1, 0])]
    runs += [trajectory("job-b", i, r) for i, r in enumerate([1, 1, 1, 1])]
    summary = printed_summary(tmp_path / "rollouts.jsonl", runs)
    assert "2 × 4" in row(summary, "GRPO groups")
    assert "1 of 2 (50%)" in row(summary, "groups with reward spread")
    # group means 0.5 and 1.0; population stds 0.5 and 0
    assert "0.750 ± 0.250" in row(summary, "group mean reward ± mean group std")


def test_groups_of_different_sizes_are_counted_by_size(tmp_path: Path) -> None:
    runs = [trajectory(job, i, i % 2) for job, n in (("a", 4), ("b", 4), ("c", 2)) for i in range(n)]
    summary = printed_summary(tmp_path / "rollouts.jsonl", runs)
    assert "3 (2 × 4, 1 × 2)" in row(summary, "GRPO groups")
    assert "3 of 3 (100%)" in row(summary, "groups with reward spread")


def test_one_sample_per_instance_shows_no_group_rows(tmp_path: Path) -> None:
    summary = printed_summary(tmp_path / "rollouts.jsonl", [trajectory(f"j{i}", 0, i % 2) for i in range(3)])
    assert "0.333" in row(summary, "mean reward")
    assert "group" not in summary.lower()


def test_the_bar_shows_turns_and_tokens_per_second_before_any_rollout_ends(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with RolloutReport(tmp_path / "rollouts.jsonl", "swe/offline") as report:
        report.expect(4)
        report.live(Generated(answers=3, completion_tokens=480))
        drawn = capsys.readouterr().err.replace("\r", "\n").splitlines()[-1]
        report.add(trajectory("j1", 0, 1.0))
    assert " 0/4 " in drawn and "turns=3" in drawn and "tok/s=" in drawn and "reward" not in drawn
    assert float(drawn.split("tok/s=")[1].rstrip("]")) > 0
