"""The environment contract: one base every task type implements.

An environment turns a task instance into a staged sandbox (`init`), offers the tools the agent may call
(`call_tool`), takes what grading needs from the finished episode (`collect`: the answer, a patch) and grades it
(`grade`) — without the run's sandbox, so the service can close it before a long evaluation starts. Concrete task
types only say what differs: how to stage an instance, what to collect, how to grade. The agent loop never knows
which type it runs.
"""

from __future__ import annotations

import copy
import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar, NamedTuple

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from nemo_gym_prorl.contracts.task import TaskConfig, TaskConfigError, TaskInstance, field_error
from nemo_gym_prorl.sandbox import WORKSPACE, Sandbox, SandboxSpec, backend_forks, open_sandbox
from nemo_gym_prorl.tool_calls import ToolCall
from nemo_gym_prorl.tools import ToolOutput, make_tools

Submission = dict[str, Any]


class Evaluation(BaseModel):
    """A grade, and the diagnostics that explain it."""

    reward: float
    resolved: bool
    details: dict[str, Any] = Field(default_factory=dict)


class NoSettings(BaseModel):
    """The verifier settings of a task type that has none: any key is refused."""

    model_config = ConfigDict(extra="forbid")


class RowError(ValueError):
    """A dataset row the task cannot use. `field` is the task file's field that asks for what the row lacks
    (``verifier.answer_key``), None when the row's own shape is wrong."""

    def __init__(self, field: str | None, message: str) -> None:
        super().__init__(f"field {field!r}: {message}" if field else message)
        self.field = field
        self.detail = message


class Probe(NamedTuple):
    """A submission whose grade is known before grading (`prorl task check`): a row's gold answer scores 1, an
    empty or wrong one 0."""

    label: str
    submission: dict[str, Any]
    reward: float


@dataclass
class Episode:
    """One rollout's live state inside an environment."""

    instance: TaskInstance
    sandbox: Sandbox | None  # None for environments whose server owns the sandbox
    answer: str | None = None
    messages: list[dict[str, Any]] = field(default_factory=list)  # the conversation so far; the agent loop appends
    session: Any = None  # environment-specific state (a Gym session's cookies)


SpecHook = Callable[[SandboxSpec], SandboxSpec]


class Environment(ABC):
    # Whether an assistant reply without a tool call ends the episode as its answer (how NeMo Gym's agents end
    # one) rather than being a format error the model is told about (how our tool-driven tasks treat it).
    plain_reply_ends_episode: ClassVar[bool] = False
    # Whether the submission goes on the trajectory (what reverify grades again). A Gym task's is the server's
    # session (output items and cookies): the server grades it, and the trajectory's messages hold what it saw.
    keeps_submission: ClassVar[bool] = True
    # The task's `verifier:` mapping, validated whole: a misspelt key or a bad value stops the task from loading.
    Settings: ClassVar[type[BaseModel]] = NoSettings

    def __init__(self, task: TaskConfig, sandbox_backend: str = "bwrap") -> None:
        self.task = task
        self.sandbox_backend = sandbox_backend
        self.settings: Any = verifier_settings(type(self).Settings, task)
        try:
            self.tools = make_tools(task.tools, task.tool_timeout_s)
        except ValueError as e:
            raise TaskConfigError(f"{task.origin}: field 'tools': {e}") from None

    def prompt_messages(self, instance: TaskInstance) -> list[dict[str, Any]]:
        """The first prompt; the same for every sample of an instance (GRPO groups need that)."""
        try:
            user = self.task.prompt_template.format(**instance.data)
        except (KeyError, IndexError) as e:
            raise RowError("prompt_template", f"needs column {e}, missing from the row") from None
        system = [{"role": "system", "content": self.task.system_prompt}] if self.task.system_prompt else []
        return [*system, *self.task.example_messages(), {"role": "user", "content": user}]

    def check_row(self, instance: TaskInstance) -> list[dict[str, Any]]:
        """Raise RowError for the first thing this task reads from the row and does not find there, so a task file
        is refused before anything runs (and the service refuses such a job) rather than failing at eval. Returns
        the first prompt, which rendering checked (the service keeps it with the job)."""
        id_key = self.task.dataset.id_key
        if id_key is not None and instance.data.get(id_key) is None:
            raise RowError("dataset.id_key", f"no column {id_key!r} in the row")
        prompt = self.prompt_messages(instance)
        self.check_columns(instance)
        return prompt

    def check_columns(self, instance: TaskInstance) -> None:
        """What this task type's grader reads from a row, checked (RowError naming it): nothing here."""

    def probes(self, instance: TaskInstance) -> list[Probe]:
        """Submissions of known grade for `instance` (`prorl task check`): its gold answer and answers that must
        fail. Empty for a task type whose rows carry no gold answer to submit."""
        return []

    def first_prompt(self, instance: TaskInstance) -> list[dict[str, Any]]:
        """The instance's first prompt: as rendered when its job was accepted (``TaskInstance.prompt``), else now."""
        return instance.prompt if instance.prompt is not None else self.prompt_messages(instance)

    @property
    def workspace(self) -> str:
        """Where this environment's sandboxes have their workspace (the tools' descriptions name it)."""
        return WORKSPACE

    def tool_schemas(self, instance: TaskInstance | None = None) -> list[dict[str, Any]]:
        """The tools offered; an environment whose rows carry their own tools uses `instance`."""
        return [tool.schema(self.workspace) for tool in self.tools.values()]

    async def sandbox_image(self) -> str | None:
        """The root of this environment's sandboxes, the agent's and its grader's: None for the backend's default."""
        return None

    async def init(self, instance: TaskInstance, spec_hook: SpecHook | None = None) -> Episode:
        """The sandbox up and the task staged. `spec_hook` adjusts the episode's sandbox spec before it starts (a
        harness's model proxy binds its socket in); graders' own sandboxes never see it."""
        spec = SandboxSpec(limits=self.task.limits, image=await self.sandbox_image())
        sandbox = open_sandbox(self.sandbox_backend, spec_hook(spec) if spec_hook else spec)
        try:
            await sandbox.start()
            episode = Episode(instance=instance, sandbox=sandbox)
            await self.stage(episode)
        except BaseException:
            await sandbox.close()
            raise
        return episode

    async def call_tool(self, episode: Episode, call: ToolCall) -> ToolOutput:
        tool = self.tools.get(call.name)
        if tool is None:
            return ToolOutput(text=f"unknown tool {call.name!r}; available: {', '.join(self.tools)}")
        assert episode.sandbox is not None
        output = await tool(episode.sandbox, call.arguments)
        if output.finished:
            episode.answer = output.answer
        return output

    async def collect(self, episode: Episode) -> Submission:
        """What grading needs from the finished episode, read while its sandbox is alive."""
        return {"answer": episode.answer}

    async def eval(self, episode: Episode) -> Evaluation:
        """Collect and grade an episode whose sandbox is still alive."""
        return await self.grade(episode.instance, await self.collect(episode))

    @property
    def shares_group_init(self) -> bool:
        """Whether a GRPO group's samples should share one init, forked into each (what `pipeline.fork_groups`
        does when the service leaves it unset): worth it where staging costs more than a fork (a repository, an
        image). False: each sample inits on its own."""
        return False

    @property
    def can_fork(self) -> bool:
        """Whether an episode can be forked (`fork`): its whole state after init is its sandbox's workspace, and
        the sandbox backend forks."""
        return backend_forks(self.sandbox_backend)

    async def fork(self, episode: Episode, into: list[Environment]) -> list[Episode]:
        """GRPO group forking (service/group_fork.py): an episode for each environment of `into` (the samples' own;
        in one process, this one each time), each on a copy-on-write fork of `episode`'s sandbox with its own copy
        of the episode's fields; `episode`'s sandbox is closed on the way (its workspace handed over, not copied)."""
        fork = getattr(episode.sandbox, "fork", None)
        if fork is None:
            raise TypeError(f"the episode's sandbox ({type(episode.sandbox).__name__}) cannot fork")
        sandboxes = await fork(len(into), close=True)
        return [
            dataclasses.replace(
                episode, sandbox=s, messages=copy.deepcopy(episode.messages), session=copy.deepcopy(episode.session)
            )
            for s in sandboxes
        ]

    async def close(self, episode: Episode) -> None:
        if episode.sandbox is not None:
            await episode.sandbox.close()

    async def aclose(self) -> None:
        """Release what the environment holds across episodes, when its owner shuts down. Nothing by default."""

    async def stage(self, episode: Episode) -> None:
        """Put what the task needs into the fresh sandbox. Nothing by default."""

    @abstractmethod
    async def grade(self, instance: TaskInstance, submission: Submission) -> Evaluation:
        """Grade without the run's sandbox (a task that needs one starts its own, as SWE evaluation does)."""


def verifier_settings(model: type[BaseModel], task: TaskConfig) -> BaseModel:
    """`task.verifier` as `model`; a TaskConfigError naming the file, the key and what was expected otherwise."""
    try:
        return model.model_validate(task.verifier)
    except ValidationError as e:
        raise TaskConfigError(f"{task.origin}: {field_error(e, model, 'verifier.', show_input=True)}") from None

