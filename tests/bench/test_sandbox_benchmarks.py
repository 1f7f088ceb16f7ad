"""The sandbox benchmarks stay runnable: tiny runs of `prorl bench tools`, `prorl bench sandbox`, `prorl bench
swe` and `prorl bench code`, each printing its figures and leaving no instance, log, process or temp dir behind. (What they measure is not
asserted.)"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import psutil
import pytest
from sandbox_helpers import reachable_temp_dir

from nemo_gym_prorl.bench import swe
from nemo_gym_prorl.contracts.task import load_task
from nemo_gym_prorl.envs.dataset import load_instances
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


async def test_swe_benchmark_prints_its_figure_lines_and_leaves_nothing_behind(
    sif: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`prorl bench swe`'s three parts, each on the first instance of the suite: its smallest command line runs every
    project through both backends and the service (over a minute here), so the parts run through its functions."""
    (instance,) = swe.first_per_project(load_instances(load_task(swe.TASK).dataset))[:1]
    children = {p.pid for p in psutil.Process().children(recursive=True)}
    with reachable_temp_dir() as temp, tempfile.TemporaryDirectory(prefix="prorl-bench-swe-") as service_folder:
        monkeypatch.setattr(tempfile, "tempdir", str(temp))  # every sandbox's host dirs, and nothing else, go here
        await swe.stages([instance], rounds=1)
        await swe.fork_vs_fresh([instance], size=2, rounds=1)
        await swe.service_fork_vs_not([instance], size=2, rounds=1, folder=Path(service_folder))
        assert list(temp.iterdir()) == []
    lines = capsys.readouterr().out.splitlines()
    measured = [line.split()[0] for line in lines if line.startswith("  ") and "init" in line and "eval" in line]
    assert measured == ["bwrap", "apptainer"], lines  # (a): both backends measured, none "not measured"
    assert [line[:3] for line in lines if line.startswith("(")] == ["(a)", "(b)", "(c)"]
    assert sum(line.startswith(f"  {instance.instance_id} ") for line in lines) == 2  # (b) and (c)
    assert any(line.startswith("fork ratio: ") for line in lines)
    assert lines[-1].startswith("service fork_groups: ")
    assert not [name for name in list_instances() if name.startswith(f"prorl-{os.getpid()}-")]
    assert {p.pid for p in psutil.Process().children(recursive=True)} <= children  # the stand-in model is gone


def test_code_benchmark_grades_gyms_rollouts_as_gym_does_and_ends_with_the_ratio() -> None:
    lines = bench("code", "--rounds", "1", "--repeat", "1")
    assert "rewards agree on all 5" in lines[-2]
    assert lines[-1].startswith("code grading: ours / Gym's graded programs per second = ")
