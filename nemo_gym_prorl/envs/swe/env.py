"""SWE: fix a repository so its hidden tests pass (SWE-bench / SWE-Gym / R2E-Gym rows, and the offline suite).

init: the row is checked (``swe_rows``), its image found (``swe_images``), and the repository staged on its base
in the sandbox's workspace, mounted at ``workdir`` (/testbed, where SWE-bench images and eval scripts have it;
``swe_stage``). The agent works there with bash, python, str_replace_editor and
finish. collect: the patch, taken while the run's sandbox is alive. grade: a fresh sandbox from the same image and
base, the patch and hidden tests applied, the tests run and graded with swebench (``swe_grade``).

Settings (the task's ``verifier`` mapping) are ``SweSettings`` below.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections import deque
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from nemo_gym_prorl.contracts.task import TaskConfig, TaskInstance
from nemo_gym_prorl.envs.base import Environment, Episode, Evaluation, Probe, SpecHook, Submission
from nemo_gym_prorl.envs.swe import repo as swe_repo
from nemo_gym_prorl.envs.swe.images import resolve_image
from nemo_gym_prorl.envs.swe.rows import RowFormat, SweRow, SweRowError, parse_row
from nemo_gym_prorl.envs.swe.stage import WORKDIR, extract_patch, image_tree, stage_repository
from nemo_gym_prorl.sandbox import Sandbox, SandboxSpec, open_sandbox

_MEASURED = 32  # stagings and forks the group forking decision looks back on
_FORK_OF_STAGING = "fork_of_staging"  # in an episode's session: its sandbox forked from a fresh staging
DEFAULT_TEST_COMMAND = "python3 -m pytest -rA -p no:cacheprovider {test_files}"


class SweSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")
    row_format: RowFormat = "auto"
    image: str | None = Field(None, description="a SIF/rootfs path or a template over row fields (swe_images)")
    workdir: str = Field(WORKDIR, description="where the repository is staged and the agent works (the sandbox's "
                         "workspace); SWE-bench / SWE-Gym / R2E-Gym images and eval scripts expect /testbed")
    test_command: str = Field(DEFAULT_TEST_COMMAND, description="rows without test_command/eval_script; {test_files}")
    test_timeout_s: float = Field(300.0, gt=0)
    apply_timeout_s: float = Field(120.0, gt=0)
    stage_timeout_s: float = Field(300.0, gt=0)
    max_patch_bytes: int = Field(500_000, gt=0)
    partial_reward: bool = Field(False, description="fraction of FAIL_TO_PASS passing while every PASS_TO_PASS does")
    skip_empty_patch: bool = Field(True, description="grade an empty patch 0 without running the tests")
    @field_validator("workdir")
    @classmethod
    def _workdir_mountable(cls, path: str) -> str:
        return SandboxSpec(workspace=path).workspace

    fork_groups: bool | None = Field(None, description="a GRPO group's samples share one staging, each in a "
                                     "copy-on-write fork of it (backends that can fork); None: while this task's "
                                     "stagings, as measured, take longer than a fork per sample (the first group "
                                     "forks); the service's pipeline.fork_groups, when set, decides instead")


class SweEnvironment(Environment):
    Settings = SweSettings

    def __init__(self, task: TaskConfig, sandbox_backend: str = "bwrap") -> None:
        super().__init__(task, sandbox_backend)
        self.base_dir = task.dataset.path.parent
        self.staging_s: deque[float] = deque(maxlen=_MEASURED)
        """Wall seconds of the recent stagings of episodes (sandbox start included)."""
        self.fork_s: deque[float] = deque(maxlen=_MEASURED)
        """Wall seconds per sample of the recent forks of a staged episode (`fork(n)`'s time over n)."""

    @property
    def shares_group_init(self) -> bool:
        """`verifier.fork_groups` when set; else whether a staging, as measured, takes longer than a fork per sample
        (both p50 of the recent ones; no fork measured yet: yes, which measures one)."""
        if self.settings.fork_groups is not None:
            return self.settings.fork_groups
        if not self.fork_s or not self.staging_s:
            return True
        return statistics.median(self.staging_s) > statistics.median(self.fork_s)

    @property
    def workspace(self) -> str:
        return self.settings.workdir

    def row(self, instance: TaskInstance) -> SweRow:
        data = instance.data if "instance_id" in instance.data else instance.data | {"instance_id": instance.instance_id}
        row = parse_row(data, instance.instance_id, self.settings.row_format)
        try:
            swe_repo.check_source(row.repo_source)
        except ValueError as e:
            raise SweRowError(f"row {row.instance_id}: field 'repo_source': {e}") from None
        return row

    def probes(self, instance: TaskInstance) -> list[Probe]:
        """The gold patch resolves (1); an empty one does not (0; graded without tests unless skip_empty_patch is
        false, as `prorl swe check` sets it)."""
        return [Probe("gold", {"patch": instance.data.get("patch") or ""}, 1.0), Probe("empty", {"patch": ""}, 0.0)]

    def prompt_messages(self, instance: TaskInstance) -> list[dict[str, Any]]:
        row = self.row(instance)
        values = {k: v for k, v in row.fields.items() if isinstance(v, str)}
        values |= {"problem_statement": row.problem_statement, "repo": row.repo, "workdir": self.settings.workdir}
        try:
            user = self.task.prompt_template.format(**values)
        except KeyError as e:
            raise SweRowError(f"row {row.instance_id}: the prompt template needs field {e}") from None
        system = [{"role": "system", "content": self.task.system_prompt.format(workdir=self.settings.workdir)}]
        opening = [*(system if self.task.system_prompt else []), *self.task.example_messages()]
        return [*opening, {"role": "user", "content": user}]

    async def init(self, instance: TaskInstance, spec_hook: SpecHook | None = None) -> Episode:
        row = self.row(instance)
        started = time.perf_counter()
        sandbox, base = await self._staged_sandbox(row, spec_hook)
        self.staging_s.append(time.perf_counter() - started)
        return Episode(instance=instance, sandbox=sandbox, session={"base_commit": base})

    async def fork(self, episode: Episode, into: list[Environment]) -> list[Episode]:
        """`Environment.fork` of an episode as its init left it (group forking forks nothing else): what each fork
        changes from then on is what it changed since the staging, which its overlay lists (`collect`)."""
        started = time.perf_counter()
        forks = await super().fork(episode, into)
        self.fork_s.append((time.perf_counter() - started) / len(forks))
        for fork in forks:  # a fork's fork starts from its parent's changes, which its overlay does not list
            fork.session[_FORK_OF_STAGING] = _FORK_OF_STAGING not in episode.session
        return forks

    async def collect(self, episode: Episode) -> Submission:
        if episode.sandbox is None:  # graded without a live sandbox (a Gym verify after its session closed)
            return {"patch": "", "patch_notes": ["no live sandbox to take a patch from"]}
        settings = self.settings
        changed_paths = getattr(episode.sandbox, "changed_paths", None)
        changed = await changed_paths() if changed_paths and episode.session.get(_FORK_OF_STAGING) else None
        extracted = await extract_patch(
            episode.sandbox, settings.workdir, episode.session["base_commit"], settings.max_patch_bytes,
            settings.apply_timeout_s, self.task.limits.max_output_bytes, changed,
        )
        return {"patch": extracted.patch, "patch_notes": extracted.notes}

    async def grade(self, instance: TaskInstance, submission: Submission) -> Evaluation:
        row = self.row(instance)
        patch = submission.get("patch") or ""
        notes = {"patch_notes": submission["patch_notes"]} if submission.get("patch_notes") else {}
        if not patch.strip() and self.settings.skip_empty_patch:
            return Evaluation(reward=0.0, resolved=False,
                              details={"reason": "empty patch: the agent changed nothing", "patch_applied": False,
                                       **notes})  # fmt: skip
        from nemo_gym_prorl.envs.swe import grade as swe_grade  # swebench's harness: imported on the first grade (~1 s)

        settings = swe_grade.GradeSettings(**self.settings.model_dump(include=set(swe_grade.GradeSettings.model_fields)))
        sandbox, base = await self._staged_sandbox(row)
        try:
            evaluation = await swe_grade.evaluate(sandbox, row, patch, base, settings)
        finally:
            await asyncio.shield(sandbox.close())
        evaluation.details |= notes | {"patch_bytes": len(patch.encode())}
        return evaluation

    async def _staged_sandbox(self, row: SweRow, spec_hook: SpecHook | None = None) -> tuple[Sandbox, str]:
        """A started sandbox with the row's base staged, and the base commit's id."""
        settings = self.settings
        image = resolve_image(settings.image, row, self.base_dir)
        if row.repo_source is not None:
            tree = await asyncio.to_thread(swe_repo.tree_tar, row.repo_source, row.base_commit)
        else:
            tree = await image_tree(self.sandbox_backend, image, WORKDIR, settings.stage_timeout_s)
        env = {"PYTHONDONTWRITEBYTECODE": "1", "GIT_PAGER": "cat", "PAGER": "cat"}  # a pager would wait for a key
        spec = SandboxSpec(image=image, limits=self.task.limits, env=env, workspace=settings.workdir)
        sandbox = open_sandbox(self.sandbox_backend, spec_hook(spec) if spec_hook else spec)
        try:
            await sandbox.start()
            base = await stage_repository(
                sandbox, settings.workdir, tree, row.base_patch, settings.stage_timeout_s, row.hidden_test_files,
                install=row.repo_source is not None,  # an image's /testbed comes installed in its environment
            )
        except BaseException:
            await asyncio.shield(sandbox.close())
            raise
        return sandbox, base

