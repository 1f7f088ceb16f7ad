"""One rollout row as the viewer shows it, from either shape of file it opens:

- a trajectory as ``prorl rollout`` and the service write it (``contracts/trajectory.py``): ``messages`` with the token
  fields on assistant turns, ``reward``, ``finish``, ``critical_error``, ``evaluation``, ``timing``;
- a row as NeMo Gym's ``gym eval run`` writes it: a verify response (``responses_create_params.input``,
  ``response.output`` items, ``reward``) with Gym's ``_ng_task_index`` / ``_ng_rollout_index`` and whatever the
  verifier and agent added at the top level (ours add ``finish``, ``critical_error``, stage times, ...).

`summarize` is what the list needs (cheap, once per row); `conversation` is what one trajectory's page shows.
"""

from __future__ import annotations

import math
import re
from typing import Any

from pydantic import BaseModel, Field

from nemo_gym_prorl.contracts.trajectory import grpo_group

STAGES = ("queued", "init", "run", "eval")
_OBSERVATION = re.compile(r"^Observation \(([^)]*)\):\n", re.DOTALL)  # codeact tool results come as user messages
_GYM_STAGE_KEYS = {stage: f"{stage}_time_s" for stage in STAGES}


class RowShapeError(ValueError):
    """A row that is neither a prorl trajectory nor a NeMo Gym rollout row."""


class Summary(BaseModel):
    """A row of the list: what filters, sorts and groups read."""

    index: int
    trajectory_id: str
    instance_id: str
    task: str | None = None
    group: str
    sample: int | None = None
    reward: float
    resolved: bool | None = None
    finish: str | None = None
    critical_error: str | None = None
    turns: int = 0
    tool_calls: int = 0
    format_errors: int = 0
    seconds: float = 0.0
    old_reward: float | None = Field(None, description="graded again (`prorl reverify`): the reward it had")
    changed: bool | None = Field(None, description="graded again: whether reward or resolved changed")


def is_gym_row(row: dict[str, Any]) -> bool:
    return "messages" not in row and ("response" in row or "responses_create_params" in row)


def _number(value: Any) -> float:
    try:
        number = float(value)
    except (TypeError, ValueError):
        return 0.0
    return number if math.isfinite(number) else 0.0


def timing(row: dict[str, Any]) -> dict[str, float]:
    """Seconds per stage: a trajectory's ``timing``; a Gym row's ``<stage>_time_s`` (what our /run adds)."""
    if is_gym_row(row):
        return {stage: _number(row.get(key)) for stage, key in _GYM_STAGE_KEYS.items()}
    given = row.get("timing") or {}
    return {stage: _number(given.get(stage)) for stage in STAGES}


def summarize(index: int, row: dict[str, Any], task: str | None = None) -> Summary:
    """`task`: the file's or the job's task, when the row does not name one itself."""
    if not isinstance(row, dict):
        raise RowShapeError("a row must be a JSON object")
    stage_times = timing(row)
    seconds = stage_times["init"] + stage_times["run"] + stage_times["eval"]
    if is_gym_row(row):
        return _gym_summary(index, row, task, seconds)
    if "trajectory_id" not in row or "instance_id" not in row:
        raise RowShapeError(
            "neither a prorl trajectory (instance_id, trajectory_id, messages) nor a NeMo Gym rollout row "
            "(responses_create_params, response)"
        )
    trajectory_id = str(row["trajectory_id"])
    group, sample = grpo_group(trajectory_id, str(row["instance_id"]))
    turns = sum(1 for m in row.get("messages") or [] if m.get("role") == "assistant" and "generation_token_ids" in m)
    regraded = row.get("reverify") if isinstance(row.get("reverify"), dict) else {}
    return Summary(
        index=index,
        trajectory_id=trajectory_id,
        instance_id=str(row["instance_id"]),
        task=row.get("task") or task,
        group=group,
        sample=int(sample) if sample is not None and sample.isdigit() else None,
        reward=_number(row.get("reward")),
        resolved=bool(row.get("resolved")),
        finish=row.get("finish"),
        critical_error=row.get("critical_error"),
        turns=turns,
        tool_calls=int(row.get("num_tool_calls") or 0),
        format_errors=int(row.get("num_format_errors") or 0),
        seconds=seconds,
        old_reward=_number(regraded["old_reward"]) if "old_reward" in regraded else None,
        changed=bool(regraded["changed"]) if "changed" in regraded else None,
    )


def _gym_summary(index: int, row: dict[str, Any], task: str | None, seconds: float) -> Summary:
    task_index, rollout_index = row.get("_ng_task_index"), row.get("_ng_rollout_index")
    output = (row.get("response") or {}).get("output") or []
    agent = row.get("agent_ref") if isinstance(row.get("agent_ref"), dict) else {}
    group = str(task_index) if task_index is not None else str(row.get("instance_id") or f"row {index}")
    instance_id = row.get("instance_id") or (f"task {task_index}" if task_index is not None else f"row {index}")
    resolved = row.get("resolved")
    return Summary(
        index=index,
        trajectory_id=str(row.get("trajectory_id") or f"{group}:{rollout_index or 0}"),
        instance_id=str(instance_id),
        task=row.get("prorl_task") or agent.get("name") or row.get("_ng_environment_server") or task,
        group=group,
        sample=int(rollout_index) if isinstance(rollout_index, int) else None,
        reward=_number(row.get("reward")),
        resolved=bool(resolved) if resolved is not None else None,
        finish=row.get("finish"),
        critical_error=row.get("critical_error") or (row.get("failure_kind") or None),
        turns=int(row.get("num_turns") or sum(1 for item in output if "generation_token_ids" in item)),
        tool_calls=int(row.get("num_tool_calls") or sum(1 for item in output if item.get("type") == "function_call")),
        format_errors=int(row.get("num_format_errors") or 0),
        seconds=seconds,
    )


def conversation(row: dict[str, Any]) -> list[dict[str, Any]]:
    """The conversation as entries of one shape for both kinds of file: ``role`` (system, user, assistant, tool),
    ``content``, ``tool_calls`` [{name, arguments}], ``name`` (a tool output's tool), ``format_error``, and on an
    assistant turn with token fields, ``token_ids`` / ``log_probs`` / ``prompt_tokens``."""
    return _gym_conversation(row) if is_gym_row(row) else _trajectory_conversation(row.get("messages") or [])


def _assistant_entry(message: dict[str, Any]) -> dict[str, Any]:
    entry: dict[str, Any] = {"role": "assistant", "content": _text(message.get("content")), "tool_calls": []}
    for call in message.get("tool_calls") or []:
        function = call.get("function") or call
        entry["tool_calls"].append({"name": function.get("name"), "arguments": function.get("arguments")})
    for key in ("format_error", "finish_reason", "contiguity_error", "mask"):
        if message.get(key) is not None:
            entry[key] = message[key]
    _take_tokens(entry, message)
    return entry


def _take_tokens(entry: dict[str, Any], item: dict[str, Any]) -> None:
    if "generation_token_ids" in item:
        entry["token_ids"] = list(item.get("generation_token_ids") or [])
        entry["log_probs"] = list(item.get("generation_log_probs") or [])
        entry["prompt_tokens"] = len(item.get("prompt_token_ids") or [])


def _trajectory_conversation(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A CodeAct observation (a user message) is a tool output once the model has generated; before, it is part of
    the prompt (a task's worked example)."""
    entries: list[dict[str, Any]] = []
    generated = False
    for message in messages:
        role = message.get("role")
        if role == "assistant":
            entries.append(_assistant_entry(message))
            generated = generated or "generation_token_ids" in message
            continue
        content = _text(message.get("content"))
        observation = _OBSERVATION.match(content) if role == "user" and generated else None
        if role == "tool":
            entries.append({"role": "tool", "name": message.get("name"), "content": content})
        elif observation:
            entries.append({"role": "tool", "name": observation.group(1), "content": content[observation.end():]})
        else:
            entries.append({"role": str(role), "content": content})
    return entries


def _gym_conversation(row: dict[str, Any]) -> list[dict[str, Any]]:
    given = (row.get("responses_create_params") or {}).get("input")
    entries: list[dict[str, Any]] = []
    if isinstance(given, str):
        entries.append({"role": "user", "content": given})
    for item in given if isinstance(given, list) else []:
        entries.append({"role": str(item.get("role") or item.get("type")), "content": _text(item.get("content"))})
    turn: dict[str, Any] | None = None  # the assistant turn the next function_call or token fields belong to
    for item in (row.get("response") or {}).get("output") or []:
        kind = item.get("type")
        if kind == "function_call_output":
            entries.append({"role": "tool", "name": _call_name(entries, item.get("call_id")),
                            "content": _text(item.get("output")), "call_id": item.get("call_id")})
            turn = None
            continue
        if turn is None or "token_ids" in turn:
            turn = {"role": "assistant", "content": "", "tool_calls": []}
            entries.append(turn)
        if kind == "message":
            turn["content"] += _text(item.get("content"))
        elif kind == "function_call":
            turn["tool_calls"].append({"name": item.get("name"), "arguments": item.get("arguments"),
                                       "call_id": item.get("call_id")})
        elif kind == "reasoning":
            turn["reasoning"] = "\n".join(_text(part) for part in item.get("summary") or [])
        _take_tokens(turn, item)
    return [e for e in entries if e["role"] != "assistant" or e["content"] or e["tool_calls"] or "token_ids" in e
            or e.get("reasoning")]


def _call_name(entries: list[dict[str, Any]], call_id: Any) -> str | None:
    for entry in reversed(entries):
        for call in entry.get("tool_calls") or []:
            if call.get("call_id") == call_id:
                return call.get("name")
    return None


def _text(content: Any) -> str:
    """Chat content as text: a string, or the text parts of a list of content parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(_text(part) for part in content)
    if isinstance(content, dict):
        return str(content.get("text") or content.get("output_text") or "")
    return str(content)


def _submission(row: dict[str, Any]) -> dict[str, Any]:
    """What grading was given (the answer, the program, the patch), as the trajectory keeps it."""
    return row["submission"] if isinstance(row.get("submission"), dict) else {}


def final_answer(row: dict[str, Any]) -> str | None:
    evaluation = row.get("evaluation") or {}
    for value in (evaluation.get("parsed_answer"), evaluation.get("extracted_answer"), row.get("extracted_answer"),
                  _submission(row).get("answer")):
        if value not in (None, ""):
            return str(value)
    return None


def patch(row: dict[str, Any]) -> str | None:
    """A SWE rollout's patch (what grading was given, the grader's ``evaluation.patch``, or Gym's ``model_patch``),
    for the diff view."""
    evaluation = row.get("evaluation") or {}
    for value in (_submission(row).get("patch"), evaluation.get("patch"), evaluation.get("model_patch"),
                  row.get("model_patch")):
        if isinstance(value, str) and value.strip():
            return value
    return None
