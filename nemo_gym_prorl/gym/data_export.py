"""`prorl data export`: a task's instances as NeMo Gym rows that NeMo RL's GRPO reads unchanged.

NeMo RL's `NemoGymDataset` takes a JSONL of Gym rows and hands each to Gym as it is: `responses_create_params`
(the first prompt as the task renders it, and the tools when the model sees them as function schemas),
`agent_ref` (which Gym agent runs the row: ours) and `task_source` (the config instance the rows belong to: that
agent, which Gym resolves to itself; Gym warns that rows routed by `agent_ref` alone are a deprecated path),
`prorl_task` (which of the service's tasks it belongs to) and the instance's own columns, which the service reads the
instance from. Rows that are Gym rows already (a task over a Gym
dataset) keep their prompt and tools.

Splits come from the task YAML's `dataset`: a `validation_path` of their own, or else `validation_fraction` of
`path` held out — the instances whose id hashes lowest, so a split is the same on every export, whatever the row
order, and adding rows moves few instances between splits.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ValidationError

if TYPE_CHECKING:
    from nemo_gym_prorl.contracts.task import TaskConfig, TaskInstance

Split = Literal["train", "validation"]
AGENT_REF = "agent_ref"
TASK_SOURCE = "task_source"

USAGE = """usage: prorl data export task=TASK split=train|validation output=FILE.jsonl [key=value ...]

Writes a task's instances as NeMo Gym rows for NeMo RL's GRPO (data.train / data.validation: data_path, with
dataset_name NemoGymDataset and processor nemo_gym_data_processor; recipes/grpo/ recipes name them).

  task=              a task under tasks/ (math/arithmetic) or a task YAML's path; several, comma-separated
                     (stem/algebra,stem/units): the rows of each in turn, each naming its own prorl_task
  split=             train | validation: the task YAML's dataset.validation_path, or else dataset.validation_fraction
                     of dataset.path held out by a hash of each instance id (the same split on every export)
  output=            the JSONL file to write
  agent=             the Gym agent that runs the rows (agent_ref.name): prorl_agent (default; the service in Gym's
                     process, one node) or prorl_service_agent (the relay to a running `prorl serve`)
  tool_call_format=  the format the agent's model uses when the task names none: hermes (default, as the agents'
                     configs) | openai | codeact (codeact rows carry no tool schemas: the prompt describes the tools)
  limit=             the first N rows of the split only

NeMo RL uses a validation set whole: run_grpo_nemo_gym.py sets grpo.max_val_samples and val_batch_size to its
length and runs all of it at every validation, so export the validation split at the size to run each time.
"""


class ExportUsageError(ValueError):
    """The export asked for cannot be made; the message is the one line shown."""


class ExportRequest(BaseModel):
    task: str
    split: Split
    output: Path
    agent: str = "prorl_agent"
    tool_call_format: Literal["hermes", "openai", "codeact"] = "hermes"
    limit: int | None = None


def parse_export_args(args: list[str]) -> ExportRequest:
    values: dict[str, str] = {}
    for arg in args:
        key, sep, value = arg.partition("=")
        if not sep or key not in ExportRequest.model_fields:
            keys = ", ".join(ExportRequest.model_fields)
            raise ExportUsageError(f"unknown argument {arg!r}; expected key=value with keys {keys}")
        values[key] = value
    try:
        return ExportRequest.model_validate(values)
    except ValidationError as e:
        first = e.errors()[0]
        field = ".".join(str(p) for p in first["loc"])
        given = f"={values[field]!r}" if field in values else ""
        raise ExportUsageError(f"{field}{given}: {first['msg']}") from None


def _hash_order(instance: TaskInstance) -> str:
    return hashlib.sha256(instance.instance_id.encode()).hexdigest()


def split_instances(task: TaskConfig, split: Split) -> list[TaskInstance]:
    """The instances of one split, in dataset order."""
    from nemo_gym_prorl.envs.dataset import load_instances

    dataset = task.dataset
    if dataset.validation_path is not None:
        source = dataset if split == "train" else dataset.model_copy(update={"path": dataset.validation_path})
        return load_instances(source)
    instances = load_instances(dataset)
    held_out = round(dataset.validation_fraction * len(instances))
    if dataset.validation_fraction > 0:
        held_out = max(held_out, 1)
    if split == "validation" and held_out == 0:
        raise ExportUsageError(f"task {task.name!r} has no validation split: dataset.validation_fraction is 0 and "
                               "there is no dataset.validation_path")  # fmt: skip
    if held_out >= len(instances):
        raise ExportUsageError(f"task {task.name!r}: holding out {held_out} of {len(instances)} instances for "
                               "validation leaves none to train on")  # fmt: skip
    validation = {i.instance_id for i in sorted(instances, key=_hash_order)[:held_out]}
    return [i for i in instances if (i.instance_id in validation) == (split == "validation")]


def nemo_rl_rows(request: ExportRequest) -> list[dict[str, Any]]:
    rows = [row for name in request.task.split(",") for row in _task_rows(name.strip(), request)]
    return rows[: request.limit]


def _task_rows(task_name: str, request: ExportRequest) -> list[dict[str, Any]]:
    from nemo_gym_prorl.contracts.task import load_task
    from nemo_gym_prorl.envs import make_environment
    from nemo_gym_prorl.gym.rows import INSTANCE_ID, TASK_KEY, gym_row

    task = load_task(task_name)
    env = make_environment(task, sandbox_backend="bwrap")  # only renders prompts: starts no sandbox
    tool_call_format = task.tool_call_format or request.tool_call_format
    rows = []
    for instance in split_instances(task, request.split)[: request.limit]:
        if TASK_KEY in instance.data:
            raise ExportUsageError(f"instance {instance.instance_id}: the dataset has a {TASK_KEY!r} column, "
                                   "which the rows use to name their task")  # fmt: skip
        if "responses_create_params" in instance.data:  # a Gym row already: its prompt and tools are the task's
            row = {INSTANCE_ID: instance.instance_id, **instance.data}
        else:
            row = gym_row(env, instance)
            if tool_call_format == "codeact":  # the agent offers no function schemas to a CodeAct model
                del row["responses_create_params"]["tools"]
        row[AGENT_REF] = {"type": "responses_api_agents", "name": request.agent}
        row[TASK_SOURCE] = request.agent
        row[TASK_KEY] = task.name
        rows.append(row)
    return rows


def export(request: ExportRequest) -> int:
    rows = nemo_rl_rows(request)
    request.output.parent.mkdir(parents=True, exist_ok=True)
    with request.output.open("w") as out:
        out.writelines(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
    return len(rows)


def data_command(args: list[str]) -> None:
    if not args or args[0] in ("-h", "--help", "help") or (args[0] == "export" and {"-h", "--help"} & set(args)):
        print(USAGE)
        return
    if args[0] != "export":
        print(f"prorl data: unknown subcommand {args[0]!r}; subcommands: export (prorl data --help)", file=sys.stderr)
        raise SystemExit(2)
    try:
        request = parse_export_args(args[1:])
        written = export(request)
    except ExportUsageError as e:
        print(f"prorl data export: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    print(f"wrote {written} {request.split} rows of {request.task} for agent {request.agent} to {request.output}")
