"""`prorl` as a user runs it: a real rollout end to end, and bad input stopped at once with one clear line."""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from nemo_gym_prorl.service.trajectory import TOKEN_FIELDS, Trajectory, contiguity_violation

PRORL = [sys.executable, "-m", "nemo_gym_prorl.cli"]


def prorl(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*PRORL, *args], capture_output=True, text=True, timeout=timeout)


def test_rollout_writes_token_faithful_trajectories_graded_by_math_verify(tmp_path: Path) -> None:
    output = tmp_path / "rollouts.jsonl"
    result = prorl(
        "rollout", "task=math", "model=local", "sandbox=bwrap", "n_samples=2", "limit=2", "concurrency=4",
        "sampling.max_tokens=96", "model.n_ctx=4096", f"output={output}", timeout=400,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "mean reward" in result.stdout and "tool calls run" in result.stdout
    trajectories = [Trajectory.model_validate_json(line) for line in output.read_text().splitlines()]
    assert len(trajectories) == 4
    assert sorted(t.instance_id for t in trajectories) == ["arith-000", "arith-000", "arith-001", "arith-001"]
    for t in trajectories:
        assert t.critical_error is None, t.error
        turns = t.assistant_turns()
        assert turns and contiguity_violation(turns) is None
        assert all(all(field in turn for field in TOKEN_FIELDS) for turn in turns)
        assert all(len(turn["generation_token_ids"]) <= 96 for turn in turns)
        assert t.reward in (0.0, 1.0) and t.evaluation["reason"] in (
            "correct", "wrong answer", "unparseable answer", "no answer submitted"
        )
        assert t.timing.init > 0 and t.timing.run > 0
    # the two samples of an instance share their first prompt (GRPO groups need that) but not their seed
    first_prompts = {t.instance_id: [] for t in trajectories}
    for t in trajectories:
        first_prompts[t.instance_id].append(t.assistant_turns()[0]["prompt_token_ids"])
    assert all(a == b for a, b in first_prompts.values())


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["task=nope"], "unknown task 'nope'; known: math"),
        (["model=gpt5"], "unknown model 'gpt5'; known: local"),
        (["sandbox=docker"], "unknown sandbox 'docker'; known: apptainer, bwrap"),
        (["n_samples=four"], "invalid n_samples='four'"),
        (["limit=0"], "invalid limit=0"),
    ],
)
def test_bad_overrides_stop_at_once_with_one_line(args: list[str], message: str, tmp_path: Path) -> None:
    result = prorl("rollout", *args, f"output={tmp_path / 'out.jsonl'}")
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and lines[0].startswith("prorl: error: ")
    assert message in lines[0]
    assert not (tmp_path / "out.jsonl").exists()


@pytest.mark.parametrize(
    ("yaml_text", "message"),
    [
        ("name: x\ntype: math\ndataset: {path: missing.jsonl}\nprompt_template: '{q}'\ntools: [bash]\n", "missing.jsonl does not exist"),
        ("name: x\n  type: [math\n", "is not valid YAML at line 2"),
        ("name: x\ntype: chess\ndataset: {path: d.jsonl}\nprompt_template: q\ntools: []\n", "field 'type'"),
    ],
)
def test_bad_task_files_stop_at_once_naming_the_problem(yaml_text: str, message: str, tmp_path: Path) -> None:
    task = tmp_path / "task.yaml"
    task.write_text(yaml_text)
    result = prorl("rollout", f"task.name={task}", f"output={tmp_path / 'out.jsonl'}")
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1
    assert message in result.stderr


def test_unknown_command_and_help() -> None:
    assert "usage: prorl" in prorl("--help").stdout
    result = prorl("train")
    assert result.returncode == 2 and "unknown command 'train'" in result.stderr


def test_pipeline_benchmark_runs_and_ends_with_its_ratio() -> None:
    result = prorl("bench", "pipeline", "--rollouts", "12", "--rounds", "1", timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().splitlines()[-1].startswith("ratio pipeline/naive: ")


def test_unknown_benchmark_names_the_known_ones() -> None:
    result = prorl("bench", "warp")
    assert result.returncode == 2 and "model, pipeline, scale" in result.stderr


def still_running(procs: list[psutil.Process], within_s: float) -> list[psutil.Process]:
    """Those of `procs` that have not exited within `within_s` (a zombie has exited: nobody here may reap it)."""
    deadline = time.monotonic() + within_s
    for proc in procs:
        with contextlib.suppress(ProcessLookupError), closing_fd(os.pidfd_open(proc.pid)) as pidfd:
            select.select([pidfd], [], [], max(0.0, deadline - time.monotonic()))  # readable once it has exited
    return [p for p in procs if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


@contextlib.contextmanager
def closing_fd(fd: int) -> Iterator[int]:
    try:
        yield fd
    finally:
        os.close(fd)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("stop", "within_s"),
    [
        (signal.SIGTERM, 0),  # the benchmark stops them itself before it exits
        (signal.SIGKILL, 60),  # no cleanup runs: the kernel tells each server its parent died, and they stop
    ],
    ids=["SIGTERM", "SIGKILL"],
)
def test_a_benchmark_stopped_or_killed_leaves_no_process_behind(stop: signal.Signals, within_s: float) -> None:
    """The throughput benchmark starts the most: a stand-in model, `gym env start` with its servers and Ray."""
    bench = subprocess.Popen(
        [*PRORL, "bench", "throughput", "--levels", "8", "--warmup", "0", "--min-rollouts", "8"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    assert bench.stdout is not None
    try:
        for line in bench.stdout:
            if line.startswith("gym env up"):
                break
        else:
            pytest.fail(f"the benchmark ended before its servers were up (exit {bench.wait()})")
        started = psutil.Process(bench.pid).children(recursive=True)
        assert len(started) >= 5  # the model, gym env start, its four servers
        bench.send_signal(stop)
        bench.communicate(timeout=120)
    finally:
        bench.kill()
    alive = still_running(started, within_s)
    assert not alive, [" ".join(p.cmdline())[:200] for p in alive]
