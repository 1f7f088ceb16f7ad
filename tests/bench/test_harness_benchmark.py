"""`prorl bench harness` stays runnable: a tiny run prints each side's figures (the proxy's two bare hops too), the
spread over rounds, the floor and the goal line, and leaves no proxy socket, sandbox or process behind. (What it
measures is not asserted.)"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import psutil
import pytest
from sandbox_helpers import reachable_temp_dir

pytestmark = pytest.mark.timeout(120)


def test_harness_benchmark_runs_and_ends_with_the_goal_line() -> None:
    with reachable_temp_dir() as temp:
        process = subprocess.Popen(
            [sys.executable, "-m", "nemo_gym_prorl.cli", "bench", "harness", "--rounds", "1", "--calls", "2"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, "TMPDIR": str(temp)},
        )  # fmt: skip
        stdout, stderr = process.communicate(timeout=100)
        assert process.returncode == 0, stderr[-3000:]
        assert list(temp.iterdir()) == []  # the proxy's socket directory is gone
    lines = stdout.strip().splitlines()
    assert lines[0] == "harness proxy: 1 rounds x 2 calls a side, stand-in backend, 5 calls recorded"
    assert [line.split()[0] for line in lines[1:5]] == ["direct", "proxy", "port", "pool"]
    assert all("(2 calls)" in line for line in lines[1:5])
    spread = r"added p50 per round: [-+]\d+\.\d\d \.\. [-+]\d+\.\d\d ms \(median [-+]\d+\.\d\d\)"
    assert re.fullmatch(spread, lines[-4]), lines[-4]
    assert re.fullmatch(r"floor, the two hops .*: [-+]\d+\.\d\d ms", lines[-3]), lines[-3]
    assert lines[-2].startswith("proxy vs direct (p50): ")
    assert re.fullmatch(r"goal <= 2 ms p50 added: (met|not met) \(-?\d+\.\d\d ms\)", lines[-1]), lines[-1]
    assert not [p for p in psutil.process_iter(["cmdline"]) if "forwarder.py" in " ".join(p.info["cmdline"] or [])]
