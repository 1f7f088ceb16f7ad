"""Gym dataset rows from our tasks (task_server.instance_from_gym_row reads them back).

A row is what Gym's agents POST to a resources server: `responses_create_params` (the task's first prompt and
its tools, in the Responses API format) plus `instance_id` and the dataset row's own columns (`question`,
`answer`, ...) at the top level. Gym passes those columns unchanged to `/seed_session` (the whole row, or as
`task_data`) and to `/verify`.

    python -m nemo_gym_prorl.gym.rows math/arithmetic --limit 5 --output data/example.jsonl
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from nemo_gym_prorl.contracts.task import TaskInstance, load_task
from nemo_gym_prorl.envs import Environment, make_environment
from nemo_gym_prorl.envs.dataset import load_instances

INSTANCE_ID = "instance_id"
# The service task a row belongs to, written by `prorl data export`, read by /run. Not `task`: that is a column of
# some Gym datasets (iheval's verify dispatches on it).
TASK_KEY = "prorl_task"
# Keys Gym adds to or keeps on a row, which no task column may take (Gym prefixes its internal ones with "_").
_RESERVED_KEYS = frozenset({"responses_create_params", "response", "agent_ref", "task_source", "skills_ref"})


def responses_tool(schema: Mapping[str, Any]) -> dict[str, Any]:
    """A chat-completions function tool (`{"type": "function", "function": {...}}`) in the Responses format."""
    function = schema["function"]
    return {
        "type": "function",
        "name": function["name"],
        "description": function.get("description", ""),
        "parameters": function["parameters"],
        "strict": False,
    }


def gym_row(env: Environment, instance: TaskInstance) -> dict[str, Any]:
    clash = (_RESERVED_KEYS | {INSTANCE_ID}) & instance.data.keys()
    if clash:
        raise ValueError(f"instance {instance.instance_id}: dataset columns {sorted(clash)} clash with Gym row keys")
    return {
        "responses_create_params": {
            "input": env.prompt_messages(instance),
            "tools": [responses_tool(schema) for schema in env.tool_schemas()],
        },
        INSTANCE_ID: instance.instance_id,
        **instance.data,
    }


def task_rows(task_name: str, limit: int | None = None) -> list[dict[str, Any]]:
    """The Gym rows of a task's dataset (building them starts no sandbox)."""
    task = load_task(task_name)
    env = make_environment(task, sandbox_backend="bwrap")
    return [gym_row(env, instance) for instance in load_instances(task.dataset, limit=limit)]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Write a task's dataset as NeMo Gym JSONL rows.")
    parser.add_argument("task", help="task name under tasks/, e.g. math/arithmetic")
    parser.add_argument("--limit", type=int, default=None, help="first N instances only")
    parser.add_argument("--output", type=Path, required=True, help="JSONL file to write")
    args = parser.parse_args(argv)
    rows = task_rows(args.task, args.limit)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows))
    print(f"wrote {len(rows)} rows of {args.task} to {args.output}")


if __name__ == "__main__":
    main()
