"""The list's queries over row summaries: filters, sort, a page; GRPO groups with their rewards and spread."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from nemo_gym_prorl.viewer.records import Summary

NONE = "none"  # the filter value that matches rows where the field is unset (no critical error, no finish)
SortKey = Literal["index", "reward", "old_reward", "instance_id", "task", "finish", "critical_error", "turns",
                  "tool_calls", "format_errors", "seconds"]


class ListQuery(BaseModel):
    model_config = ConfigDict(extra="forbid")
    task: str | None = None
    finish: str | None = Field(None, description=f"a finish value, or {NONE!r}")
    critical_error: str | None = Field(None, description=f"a critical error, or {NONE!r} for rollouts without")
    resolved: bool | None = None
    changed: bool | None = Field(None, description="graded again by `prorl reverify`: reward or resolved changed")
    reward_min: float | None = None
    reward_max: float | None = None
    search: str | None = Field(None, description="part of an instance or trajectory id")
    sort: SortKey = "index"
    desc: bool = False
    offset: int = Field(0, ge=0)
    limit: int = Field(50, ge=1, le=1000)


class Page(BaseModel):
    total: int = Field(description="rows that pass the filters")
    rows: list[Summary]


class Group(BaseModel):
    """The samples of one task instance (a GRPO group) as they came out: rewards in sample order."""

    group: str
    task: str | None
    instance_id: str
    indexes: list[int]
    rewards: list[float]
    mean: float
    std: float
    spread: float = Field(description="highest reward minus lowest: 0 means the group teaches GRPO nothing")


class GroupQuery(ListQuery):
    sort: Literal["group", "mean", "std", "spread", "n"] = "group"  # type: ignore[assignment]


class GroupPage(BaseModel):
    total: int
    groups: list[Group]


class Facets(BaseModel):
    """The values the filters offer, with how many rows have each."""

    total: int
    tasks: dict[str, int]
    finishes: dict[str, int]
    critical_errors: dict[str, int]
    regraded: int = Field(description="rows graded again by `prorl reverify` (they carry their old reward)")


def _matches(row: Summary, query: ListQuery) -> bool:
    if query.task is not None and row.task != query.task:
        return False
    if query.finish is not None and (row.finish or NONE) != query.finish:
        return False
    if query.critical_error is not None and (row.critical_error or NONE) != query.critical_error:
        return False
    if query.resolved is not None and bool(row.resolved) != query.resolved:
        return False
    if query.changed is not None and bool(row.changed) != query.changed:
        return False
    if query.reward_min is not None and row.reward < query.reward_min:
        return False
    if query.reward_max is not None and row.reward > query.reward_max:
        return False
    return not query.search or query.search in row.instance_id or query.search in row.trajectory_id


def filtered(rows: Sequence[Summary], query: ListQuery) -> list[Summary]:
    return [row for row in rows if _matches(row, query)]


def _sort_key(field: str) -> Callable[[Summary], tuple[bool, Any]]:
    """Rows without the field sort after those with it; text and numbers each compare among their own."""
    blank = "" if field in ("instance_id", "task", "finish", "critical_error") else 0

    def key(row: Summary) -> tuple[bool, Any]:
        value = getattr(row, field)
        return value is None, blank if value is None else value

    return key


def page(rows: Sequence[Summary], query: ListQuery) -> Page:
    kept = filtered(rows, query)
    if query.sort != "index" or query.desc:
        kept.sort(key=_sort_key(query.sort), reverse=query.desc)
    return Page(total=len(kept), rows=kept[query.offset : query.offset + query.limit])


def groups(rows: Sequence[Summary], query: GroupQuery) -> GroupPage:
    members: dict[str, list[Summary]] = {}
    for row in filtered(rows, query):
        members.setdefault(row.group, []).append(row)
    found = []
    for name, samples in members.items():
        samples.sort(key=lambda row: (row.sample is None, row.sample or 0, row.index))
        rewards = [row.reward for row in samples]
        found.append(Group(
            group=name, task=samples[0].task, instance_id=samples[0].instance_id, indexes=[r.index for r in samples],
            rewards=rewards, mean=statistics.fmean(rewards), std=statistics.pstdev(rewards),
            spread=max(rewards) - min(rewards),
        ))
    if query.sort == "n":
        found.sort(key=lambda g: len(g.rewards), reverse=query.desc)
    elif query.sort != "group" or query.desc:
        found.sort(key=lambda g: getattr(g, query.sort), reverse=query.desc)
    return GroupPage(total=len(found), groups=found[query.offset : query.offset + query.limit])


def facets(rows: Sequence[Summary]) -> Facets:
    tasks: dict[str, int] = {}
    finishes: dict[str, int] = {}
    errors: dict[str, int] = {}
    for row in rows:
        if row.task is not None:
            tasks[row.task] = tasks.get(row.task, 0) + 1
        finishes[row.finish or NONE] = finishes.get(row.finish or NONE, 0) + 1
        errors[row.critical_error or NONE] = errors.get(row.critical_error or NONE, 0) + 1
    regraded = sum(1 for row in rows if row.old_reward is not None)
    return Facets(total=len(rows), tasks=tasks, finishes=finishes, critical_errors=errors, regraded=regraded)
