"""The rollout service stays responsive while twenty rollouts attack the host through their sandboxes at once: each
puts a FIFO where the python tool stages its interpreter and where the editor reads, a 96 MiB sparse file for the
editor to view, and four processes holding as many open files as they may. Meanwhile another job's rollouts finish
with their rewards and /status answers. The model is the scripted stand-in (hermes tool calls); sandboxes are real
bubblewrap sandboxes.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from standin_helpers import running_standin

from nemo_gym_prorl.contracts.job import JobRequest
from nemo_gym_prorl.contracts.task import TASKS_DIR
from nemo_gym_prorl.launch.runtime import ModelConfig, ServiceConfig, ServiceSettings
from nemo_gym_prorl.launch.serve import run_service
from nemo_gym_prorl.service.client import RolloutClient

pytestmark = pytest.mark.timeout(300)

ABUSIVE_MEMORY_MB = 1000
"""What tells the attacking rollouts' sandboxes from the others (`ulimit -v`): one script drives every rollout."""

ATTACK = f"""if [ "$(ulimit -v)" = {ABUSIVE_MEMORY_MB * 1024} ]; then
  mkfifo pipe; mkdir -p .prorl/python; mkfifo .prorl/python/repl.py; truncate -s 96M sparse
  for i in 1 2 3 4; do
    nohup python3 -c 'import os, time
held = []
try:
    while len(held) < 20000:
        held.append(os.eventfd(0))
except OSError:
    pass
time.sleep(600)' > /dev/null 2>&1 &
  done
fi
echo $((6 * 7))"""


def call(name: str, **arguments: object) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


SCRIPT = [
    call("bash", command=ATTACK),
    call("python", code="print(6 * 7)"),
    call("str_replace_editor", command="view", path="/workspace/pipe"),
    call("str_replace_editor", command="view", path="/workspace/sparse"),
    call("finish", answer="42"),
]
ROW = {"id": "q1", "question": "Calculate 6 * 7.", "answer": "42"}


@pytest.fixture(scope="module")
def scripted_model() -> Iterator[str]:
    yield from running_standin(SCRIPT)


def task_file(directory: Path, name: str, memory_mb: int) -> str:
    path = directory / f"{name}.yaml"
    task = {
        "name": name,
        "type": "math",
        "dataset": {"path": str(TASKS_DIR / "math/data/arithmetic.jsonl"), "id_key": "id"},
        "prompt_template": "{question}",
        "tools": ["bash", "python", "str_replace_editor", "finish"],
        "max_turns": 6,
        "tool_timeout_s": 20,
        "limits": {"memory_mb": memory_mb, "wall_clock_s": 240},
        "verifier": {"answer_key": "answer"},
    }
    path.write_text(json.dumps(task))
    return str(path)


async def test_the_service_stays_responsive_while_twenty_sandboxes_attack_the_host(
    scripted_model: str, tmp_path: Path
) -> None:
    tasks = [task_file(tmp_path, "attack", ABUSIVE_MEMORY_MB), task_file(tmp_path, "plain", 1024)]
    model = ModelConfig(
        kind="remote", addresses=[scripted_model], served_model_name="standin", tool_call_format="hermes"
    )
    config = ServiceConfig(service=ServiceSettings(port=0, store=tmp_path / "db", tasks=tasks), model=model)
    async with run_service(config) as svc, RolloutClient(svc.url) as client:
        attacks = await client.submit(JobRequest(task="attack", instance=ROW, n=20))
        plain = await client.submit(JobRequest(task="plain", instance=ROW, n=2))  # set up after the attackers
        finished = await client.wait(plain)
        async with httpx.AsyncClient(base_url=svc.url, timeout=20) as http:
            status = await http.get("/status")
        assert status.status_code == 200 and "stages" in status.json()
        assert [t.reward for t in finished.results] == [1.0, 1.0], [t.finish for t in finished.results]
        attacked = await client.wait(attacks)
    assert len(attacked.results) == 20
    for trajectory in attacked.results:
        assert trajectory.critical_error is None and trajectory.reward == 1.0, trajectory.error
        observations = [m["content"] for m in trajectory.messages if m["role"] == "tool"]
        assert "not a regular file" in observations[1] and "not a regular file" in observations[2], observations
        assert "max_read_mb" in observations[3], observations[3]

