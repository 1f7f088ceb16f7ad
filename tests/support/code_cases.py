"""What the code-grading tests share: a Gym code row, hostile programs and how each must end, and a check that
nothing they started is left on the host."""

from __future__ import annotations

import base64
import json
import os
import uuid
import zlib
from pathlib import Path

from nemo_gym_prorl.envs.code.cases import CodeProblem
from nemo_gym_prorl.envs.code.grading import GradingSettings

SETTINGS = GradingSettings(timeout_s=2, output_cap_bytes=1 << 20)
DOUBLE = CodeProblem(kind="stdin", inputs=["3\n", "4\n"], outputs=["6", "8"])

# name -> (program, the reason it must score 0 with)
HOSTILE = {
    "fork bomb": ("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass", "timeout"),
    "reads host files": ("print(open('/root/.bashrc').read())", "runtime_error"),
    "network": ("import socket\nsocket.create_connection(('1.1.1.1', 80), timeout=2)", "runtime_error"),
    "infinite loop": ("while True:\n    pass", "timeout"),
    "1 GB of output": ("import sys\nfor _ in range(16384):\n    sys.stdout.write('x' * 65536)", "output_limit"),
}
KILL_RUNNER = "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\nprint(int(input()) * 2)"


def gym_code_row(inputs: list[str], outputs: list[str], fn_name: str | None = None, packed: bool = False) -> dict:
    """A row as NeMo Gym's code_gen carries one: LiveCodeBench unit tests, plain or packed (zlib + base64)."""
    tests: dict = {"inputs": inputs, "outputs": outputs, "fn_name": fn_name}
    if packed:
        payload = json.dumps({"inputs": inputs, "outputs": outputs}).encode()
        tests = {"packed": base64.b64encode(zlib.compress(payload)).decode(), "fn_name": fn_name}
    return {"verifier_metadata": {"unit_tests": tests}}


def daemon_prefix() -> tuple[str, str]:
    """(marker, code): code that leaves a daemon in a session of its own under a name only it has (the marker),
    to put before a hostile program."""
    marker = f"prorl-hostile-{uuid.uuid4().hex}"
    return marker, f"import os\nif os.fork() == 0:\n    os.setsid()\n    os.execv('/bin/sleep', ['{marker}', '1000'])\n"


def processes_named_by(marker: str) -> list[str]:
    """Host pids whose command line holds `marker`."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if marker in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace"):
                found.append(pid)
        except OSError:
            continue
    return found
