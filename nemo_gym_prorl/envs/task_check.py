"""A task file checked against its data before anything runs, and its grader against answers of known grade.

`check_rows` runs wherever a task is loaded to run: every row of both dataset files must hold what the task reads
(its id, the prompt's columns, the grader's columns) and ids must be unique, so a typo is one line naming the file,
the field and the row, not a crash at eval after the model ran. `probe_rows` is `prorl task check`: each row's gold
answer must score 1 and an empty or wrong one 0 through the task's own grader, in a sandbox where it grades in one.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

from pydantic import BaseModel

from nemo_gym_prorl.contracts.task import DatasetConfig, TaskConfigError, TaskInstance
from nemo_gym_prorl.envs.base import Environment, Probe, RowError
from nemo_gym_prorl.envs.dataset import load_instances


class ProbeFailure(BaseModel):
    """A row whose grade for a probe is not the known one: the grader, or the row's gold, is wrong."""

    instance_id: str
    probe: str
    expected: float
    got: float | None
    reason: str


def dataset_files(env: Environment) -> list[Path]:
    dataset = env.task.dataset
    return [dataset.path, *([dataset.validation_path] if dataset.validation_path else [])]


def check_rows(env: Environment) -> list[TaskInstance]:
    """Every instance of the task's dataset files, each checked (`Environment.check_row`); TaskConfigError for the
    first row the task cannot use or a repeated id."""
    task, everything = env.task, []
    for file in dataset_files(env):
        try:
            rows = load_instances(DatasetConfig(path=file))  # ids read below, where a missing one can be named
        except ValueError as e:
            raise TaskConfigError(f"{task.origin}: field 'dataset.path': {e}") from None
        if not rows:
            raise TaskConfigError(f"{task.origin}: field 'dataset.path': {file} holds no rows")
        seen: dict[str, int] = {}
        for index, row in enumerate(rows):
            where = f"row {index + 1} of {file}"
            try:
                env.check_row(row)
            except ValueError as e:
                field = e.field if isinstance(e, RowError) else None
                detail = e.detail if isinstance(e, RowError) else str(e)
                named = f"field {field!r}: " if field else ""
                raise TaskConfigError(f"{task.origin}: {named}{detail} ({where})") from None
            instance_id = str(row.data[task.dataset.id_key]) if task.dataset.id_key else str(index)
            if instance_id in seen:
                rows_named = f"rows {seen[instance_id] + 1} and {index + 1} of {file}"
                raise TaskConfigError(f"{task.origin}: field 'dataset.id_key': id {instance_id!r} is in {rows_named}; "
                                      "ids must be unique")  # fmt: skip
            seen[instance_id] = index
            everything.append(row.model_copy(update={"instance_id": instance_id}))
    return everything


async def probe_rows(
    env: Environment,
    instances: list[TaskInstance],
    jobs: int = 2,
    on_done: Callable[[TaskInstance, list[ProbeFailure]], None] | None = None,
) -> list[ProbeFailure]:
    """Grade every probe of every instance (`Environment.probes`), `jobs` instances at a time; the failures."""
    slots = asyncio.Semaphore(jobs)

    async def one(instance: TaskInstance) -> list[ProbeFailure]:
        async with slots:
            failures = [f for probe in env.probes(instance) if (f := await _failure(env, instance, probe)) is not None]
        if on_done is not None:
            on_done(instance, failures)
        return failures

    return [f for failures in await asyncio.gather(*(one(i) for i in instances)) for f in failures]


async def _failure(env: Environment, instance: TaskInstance, probe: Probe) -> ProbeFailure | None:
    try:
        evaluation = await env.grade(instance, probe.submission)
    except Exception as e:  # a grader that raises on a row is that row's failure, reported with the rest
        return ProbeFailure(instance_id=instance.instance_id, probe=probe.label, expected=probe.reward, got=None,
                            reason=f"{type(e).__name__}: {e}")  # fmt: skip
    if evaluation.reward == probe.reward:
        return None
    reason = str(evaluation.details.get("reason") or evaluation.details)
    return ProbeFailure(instance_id=instance.instance_id, probe=probe.label, expected=probe.reward,
                        got=evaluation.reward, reason=reason)  # fmt: skip
