"""A stand-in model server process for a module's tests (synchronous fixtures, so module-scoped ones can share it),
and the arithmetic row and script most service tests give it."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

from nemo_gym_prorl.models.launcher import ModelServerProcess
from nemo_gym_prorl.models.standin import standin_argv

SCRIPT = ["```bash\necho $((6 * 7))\n```", "\\boxed{42}"]  # a tool call, then the answer
STAGED_SCRIPT = ["```bash\ncat problem.txt; echo $((6 * 7))\n```", "\\boxed{42}"]  # reads what init staged
ROW = {"id": "q1", "question": "Calculate 6 * 7.", "answer": "42"}
# mini-swe-agent's text action format: a new file in the repository (and the answer to arithmetic's first row,
# -42 / 7, in answer.txt), then its submit command.
MINI_SWE_AGENT_SCRIPT = [
    "THOUGHT: leave a mark.\n\n```mswea_bash_command\necho fixed > harness_was_here.txt; echo -6 > answer.txt\n```",
    "THOUGHT: done.\n\n```mswea_bash_command\necho COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT\n```",
]


def running_standin(script: list[str], latency_s: float = 0.0) -> Iterator[str]:
    """Yield the base URL of a started stand-in model scripted with `script`; stop it afterwards."""
    loop = asyncio.new_event_loop()
    server = ModelServerProcess(standin_argv(script, latency_s))
    loop.run_until_complete(server.__aenter__())
    try:
        yield server.base_url
    finally:
        loop.run_until_complete(server.stop())
        loop.close()
