"""`prorl reverify`: grade stored rollouts again with the current graders, and say what changed.

After a grader fix, a corrected gold answer or a changed verifier setting, the rollouts already on disk can be
graded again without running a model: each trajectory keeps what grading was given (``submission``: the answer,
the program, the patch), and its task's environment grades that again — in-process for math and STEM, in a fresh
sandbox for code and SWE, exactly as the service's eval stage does. The output is a rollouts file like the input,
its rewards the new ones, each line with a ``reverify`` record holding the old grade beside the new
(``old_reward``, ``old_resolved``, ``old_evaluation``, ``reward``, ``resolved``, ``changed``, ``skipped``).
"""

from __future__ import annotations

import asyncio
import statistics
from collections import Counter
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from tqdm import tqdm

from nemo_gym_prorl.contracts.task import TaskConfig
from nemo_gym_prorl.contracts.trajectory import Reverification, Trajectory
from nemo_gym_prorl.envs import Environment, environment_class, make_environment
from nemo_gym_prorl.envs.dataset import load_instances
from nemo_gym_prorl.launch.job import TaskChoice
from nemo_gym_prorl.launch.runtime import SandboxConfig
from nemo_gym_prorl.launch.startup import check_sandbox_backend
from nemo_gym_prorl.telemetry.report import config_record_path, read_config_record

SANDBOX_GRADED = ("code", "swe")  # task types whose grader runs the submission in a fresh sandbox


class ReverifyConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    input: Path | None = Field(None, description="a rollouts file (`prorl rollout`'s JSON lines)")
    task: TaskChoice | None = Field(None, description="the task that made it; unset: the one its .config.yaml names")
    sandbox: SandboxConfig = Field(default_factory=SandboxConfig)
    verifier: dict[str, Any] = Field(default_factory=dict, description="over the task's verifier settings")
    output: Path
    concurrency: int = Field(4, ge=1, description="rollouts graded at once")


class ReverifyError(ValueError):
    """What was asked cannot be graded again (no such file, a line that is not a trajectory, a task graded only
    against a live session); the message says which and why."""


def recorded_task(rollouts: Path) -> str | None:
    """The task named in the record `prorl rollout` wrote beside `rollouts` (`<stem>.config.yaml`), if any."""
    return ((read_config_record(rollouts).get("config") or {}).get("task") or {}).get("name")


def task_name(config: ReverifyConfig) -> str:
    """The task to grade with: `task=` when given, else the one the rollouts file's record names."""
    if config.input is None:
        raise ReverifyError("reverify needs a rollouts file: prorl reverify ROLLOUTS.jsonl [task=NAME] [output=PATH]")
    if config.task is not None:
        return config.task.name
    name = recorded_task(config.input)
    if name is None:
        raise ReverifyError(
            f"{config.input}: no {config_record_path(config.input).name} beside it names the task that made it; "
            "give task=NAME (e.g. task=math)"
        )
    return name


def load_rollouts(path: Path) -> list[Trajectory]:
    if not path.is_file():
        raise ReverifyError(f"no rollouts file at {path}")
    trajectories = []
    with path.open() as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                trajectories.append(Trajectory.model_validate_json(line))
            except ValidationError as e:
                first = e.errors()[0]
                where = ".".join(str(p) for p in first["loc"]) or "the line"
                raise ReverifyError(f"{path}:{number}: not a trajectory ({where}: {first['msg']})") from None
    return trajectories


def with_verifier(task: TaskConfig, overrides: dict[str, Any]) -> TaskConfig:
    """`task` with `overrides` over its verifier settings."""
    return task.model_copy(update={"verifier": task.verifier | overrides}) if overrides else task


class Regrader:
    """Grades trajectories of one task again, `concurrency` at a time."""

    def __init__(self, task: TaskConfig, sandbox_backend: str, concurrency: int) -> None:
        if not environment_class(task.type).keeps_submission:  # a Gym task: its server grades its live session
            raise ReverifyError(
                f"task {task.name!r} is graded by a NeMo Gym resources server against the live session it seeded: its "
                "rollouts cannot be graded again from a file"
            )
        self.task = task
        self.env: Environment = make_environment(task, sandbox_backend)
        self.instances = {i.instance_id: i for i in load_instances(task.dataset)}
        self._slots = asyncio.Semaphore(concurrency)

    async def regrade(self, trajectory: Trajectory) -> Trajectory:
        old = Reverification(
            old_reward=trajectory.reward, old_resolved=trajectory.resolved, old_evaluation=trajectory.evaluation
        )
        instance = self.instances.get(trajectory.instance_id)
        if trajectory.submission is None:
            ended = f" (it ended with critical_error={trajectory.critical_error})" if trajectory.critical_error else ""
            return self._skipped(trajectory, old, f"no submission stored{ended}")
        if instance is None:
            return self._skipped(trajectory, old, f"instance {trajectory.instance_id!r} is not in {self.task.name}'s dataset")
        try:
            async with self._slots:
                evaluation = await self.env.grade(instance, trajectory.submission)
        except Exception as e:
            detail = " ".join(str(e).split()) or type(e).__name__
            return self._skipped(trajectory, old, f"grading failed: {type(e).__name__}: {detail}")
        changed = (evaluation.reward, evaluation.resolved) != (old.old_reward, old.old_resolved)
        record = old.model_copy(update={"reward": evaluation.reward, "resolved": evaluation.resolved, "changed": changed})
        return trajectory.model_copy(
            update={
                "reward": evaluation.reward, "resolved": evaluation.resolved, "evaluation": evaluation.details,
                "reverify": record,
            }
        )  # fmt: skip

    @staticmethod
    def _skipped(trajectory: Trajectory, old: Reverification, reason: str) -> Trajectory:
        return trajectory.model_copy(update={"reverify": old.model_copy(update={"skipped": reason})})

    async def regrade_all(self, trajectories: list[Trajectory]) -> list[Trajectory]:
        """Every trajectory graded again, in the input's order."""
        bar = tqdm(total=len(trajectories), desc="re-grading", unit="rollout", dynamic_ncols=True)

        async def one(trajectory: Trajectory) -> Trajectory:
            regraded = await self.regrade(trajectory)
            bar.update(1)
            return regraded

        try:
            return list(await asyncio.gather(*(one(t) for t in trajectories)))
        finally:
            bar.close()
            await self.env.aclose()


def _reason(evaluation: dict[str, Any]) -> str:
    reason = evaluation.get("reason")
    return str(reason) if reason is not None else "-"


def change_lines(trajectories: list[Trajectory]) -> list[str]:
    """One line per trajectory whose grade changed, by instance: old reward → new reward (and the graders' why)."""
    lines = []
    for t in sorted(trajectories, key=lambda t: t.instance_id):
        record = t.reverify
        if record is None or not record.changed:
            continue
        why = f"{_reason(record.old_evaluation)} → {_reason(t.evaluation)}"
        lines.append(f"  {t.instance_id} [{t.trajectory_id[:8]}]: reward {record.old_reward:g} → {t.reward:g} ({why})")
    return lines


def summary_lines(task: str, trajectories: list[Trajectory]) -> list[str]:
    records = [t.reverify for t in trajectories if t.reverify is not None]
    graded = [r for r in records if r.skipped is None]
    changed = [r for r in graded if r.changed]
    up = sum(1 for r in changed if (r.reward or 0.0) > r.old_reward)
    down = sum(1 for r in changed if (r.reward or 0.0) < r.old_reward)
    lines = [
        f"{len(trajectories)} rollouts of {task}: {len(graded)} graded again, {len(changed)} changed "
        f"({up} up, {down} down, {len(changed) - up - down} resolved only), {len(records) - len(graded)} skipped"
    ]
    for reason, count in Counter(r.skipped for r in records if r.skipped is not None).most_common():
        lines.append(f"  skipped {count}: {reason}")
    if graded:
        old_mean = statistics.fmean(r.old_reward for r in graded)
        new_mean = statistics.fmean(r.reward or 0.0 for r in graded)
        old_resolved = sum(r.old_resolved for r in graded)
        new_resolved = sum(bool(r.resolved) for r in graded)
        lines.append(
            f"mean reward {old_mean:.4g} → {new_mean:.4g}; resolved {old_resolved} → {new_resolved} of {len(graded)}"
        )
    return lines


def write_rollouts(path: Path, trajectories: list[Trajectory], config_record: str | None = None) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if config_record is not None:
        config_record_path(path).write_text(config_record)
    with path.open("w") as out:
        for trajectory in trajectories:
            out.write(trajectory.model_dump_json() + "\n")


def reverify_file(config: ReverifyConfig, task: TaskConfig, config_record: str | None = None) -> list[Trajectory]:
    """Grade `config.input` again with `task`'s current graders, write `config.output`, print what changed."""
    assert config.input is not None
    trajectories = load_rollouts(config.input)
    if task.type in SANDBOX_GRADED:  # before anything is graded or written
        asyncio.run(check_sandbox_backend(config.sandbox.backend))
    regrader = Regrader(task, config.sandbox.backend, config.concurrency)
    regraded = asyncio.run(regrader.regrade_all(trajectories))
    write_rollouts(config.output, regraded, config_record)
    for line in [*change_lines(regraded), *summary_lines(task.name, regraded), f"written to {config.output}"]:
        print(line)
    return regraded
