"""The sandbox benchmarks stay runnable: tiny runs of `prorl bench tools` and `prorl bench sandbox`, each ending with
its ratio and leaving no instance, log or temp dir behind. (What they measure is not asserted.)"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from sandbox_helpers import reachable_temp_dir

from nemo_gym_prorl.sandbox.apptainer import _instance_logs, list_instances

pytestmark = pytest.mark.timeout(300)


def gym_leftovers() -> set[str]:
    """NeMo Gym's apptainer instances and their logs there are now (Gym's names do not say who started them)."""
    return {name for name in list_instances() if name.startswith("nemo-gym-")} | {
        str(log) for log in _instance_logs("nemo-gym-*")
    }


def bench(*args: str) -> list[str]:
    """Run `prorl bench ARGS` with a temp dir of its own; check that it leaves nothing behind."""
    before = gym_leftovers()
    with reachable_temp_dir() as temp:
        process = subprocess.Popen(
            [sys.executable, "-m", "nemo_gym_prorl.cli", "bench", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "TMPDIR": str(temp)},
        )
        stdout, stderr = process.communicate(timeout=280)
        assert process.returncode == 0, stderr[-3000:]
        ours = f"prorl-{process.pid}-"
        assert not [name for name in list_instances() if name.startswith(ours)] and not _instance_logs(f"{ours}*")
        assert gym_leftovers() <= before and list(temp.iterdir()) == []
    return stdout.strip().splitlines()


def test_tools_benchmark_runs_and_ends_with_the_apptainer_ratio(sif: Path) -> None:
    lines = bench("tools", "--commands", "3", "--warmup", "1")
    assert sum("p50" in line and "p95" in line for line in lines) == 4
    assert lines[-2].startswith("ours-bwrap vs Gym local (p50): ")
    assert lines[-1].startswith("ours-apptainer vs Gym apptainer (p50): ")


def test_sandbox_benchmark_runs_and_ends_with_the_fork_ratio(sif: Path) -> None:
    lines = bench("sandbox", "--rounds", "2", "--group", "2", "--files", "20", "--native-modules", "2", "--fork-rounds", "1")
    assert sum(line.startswith("  ") and "total p50" in line for line in lines) == 4
    assert lines[-1].startswith("fork ratio (fresh / forked, time until all 2 ready): ")
