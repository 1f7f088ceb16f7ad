"""The trajectory contract: what one rollout returns to a trainer.

Token information lives on the assistant messages themselves (``prompt_token_ids``, ``generation_token_ids``,
``generation_log_probs``), exactly where NeMo RL reads it and where its server expects it echoed back.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field, computed_field

CriticalError = Literal["init", "run", "eval", "timeout", "cancelled"]
Finish = Literal["answer", "finish", "max_turns", "context_length", "error"]

TOKEN_FIELDS = ("prompt_token_ids", "generation_token_ids", "generation_log_probs")


class RolloutFailed(Exception):
    """A stage's failure that knows its `critical_error` (a harness that hung is ``timeout``, one that crashed
    ``run``): the pipeline ends the rollout with it and the message alone, no exception type in front."""

    def __init__(self, critical_error: CriticalError, message: str) -> None:
        super().__init__(message)
        self.critical_error: CriticalError = critical_error


class TimedSpan(BaseModel):
    """One timed piece of a rollout: a stage (``init``, ``run``, ``eval``), a model request (``model``) or a tool
    call (``tool``). The same spans go out as OpenTelemetry spans when tracing is on (telemetry/tracing.py)."""

    name: str = Field(description="init | run | eval | model | tool")
    start_s: float = Field(description="seconds from the rollout's submission to the pipeline")
    duration_s: float
    attributes: dict[str, Any] = Field(
        default_factory=dict,
        description="model: turn, backend, attempts, prompt_tokens, generated_tokens, finish_reason; tool: turn, "
        "tool, sandbox_id, sandbox_backend, finished; any span: error (the exception that ended it)",
    )


class Timing(BaseModel):
    """Seconds spent per stage (stage time only: waits for a weight sync count as queued) and the timed spans."""

    init: float = 0.0
    run: float = 0.0
    eval: float = 0.0
    queued: float = 0.0
    spans: list[TimedSpan] = Field(default_factory=list, description="stages, model requests, tool calls, in the order they ended")


class Reverification(BaseModel):
    """A stored rollout graded again by the current graders (`prorl reverify`): what it had, and what it gets now.
    The trajectory's own reward, resolved and evaluation are the new ones (the old ones when it was skipped)."""

    old_reward: float
    old_resolved: bool
    old_evaluation: dict[str, Any] = Field(default_factory=dict)
    reward: float | None = Field(None, description="the new reward; None when the rollout was not graded again")
    resolved: bool | None = None
    changed: bool = Field(False, description="reward or resolved differ from the old ones")
    skipped: str | None = Field(None, description="why it was not graded again (the old grade stands)")


def grpo_group(trajectory_id: str, instance_id: str) -> tuple[str, str | None]:
    """(group, sample) of a trajectory: a job is one instance's n samples, its GRPO group, and the service names
    each trajectory JOBID:SAMPLE; an id of another shape is its instance's group, with no sample number."""
    job, colon, sample = trajectory_id.rpartition(":")
    return (job, sample) if colon else (instance_id, None)


class Trajectory(BaseModel):
    instance_id: str
    trajectory_id: str
    messages: list[dict[str, Any]] = Field(default_factory=list)
    tools: list[dict[str, Any]] = Field(default_factory=list)
    reward: float = 0.0
    resolved: bool = False
    finish: Finish | None = None
    critical_error: CriticalError | None = None
    error: str | None = None
    evaluation: dict[str, Any] = Field(default_factory=dict)
    timing: Timing = Field(default_factory=Timing)
    num_tool_calls: int = Field(0, description="tool calls that ran in the sandbox")
    num_format_errors: int = 0
    submission: dict[str, Any] | None = Field(
        None, description="what grading was given (the answer, the program, the patch): stored rollouts can be graded "
        "again from it (`prorl reverify`); None when the run never got that far, or for Gym-server tasks",
    )
    reverify: Reverification | None = None
    stale: str | None = Field(
        None, description="why its turns span more weight updates than its job's max_version_lag allows (masked)"
    )
    segments: list[list[dict[str, Any]]] = Field(
        default_factory=list,
        description="an agent harness's model calls as contiguous segments (harness/segments.py), each a list of "
        "assistant turns with the token fields, in the order each began; empty for our own loop, whose messages "
        "are its one segment",
    )

    def assistant_turns(self) -> list[dict[str, Any]]:
        return [m for m in self.messages if m.get("role") == "assistant" and "generation_token_ids" in m]

    def training_segments(self) -> list[list[dict[str, Any]]]:
        """Every run of turns a trainer can take as one token sequence, for both kinds of rollout: a harness's
        segments, or our own loop's single one (its assistant turns); none when no turn was generated. Each gets
        the rollout's reward and its group advantage (docs/harness.md#rewards-and-advantages)."""
        if self.segments:
            return [segment for segment in self.segments if segment]
        turns = self.assistant_turns()
        return [turns] if turns else []

    def final_segment(self) -> list[dict[str, Any]]:
        """The segment of the rollout's last model call, whose reply ended it (empty when none was generated): what
        a trainer that takes one sequence per rollout trains on. A harness's turns carry their call number; the
        segment holding the highest one is the last to have been extended, wherever it began."""
        found = self.training_segments()
        if not found:
            return []
        return max(enumerate(found), key=lambda indexed: (indexed[1][-1].get("call", -1), indexed[0]))[1]

    @computed_field  # type: ignore[prop-decorator]
    @property
    def first_policy_version(self) -> int | None:
        """The version of the weights that generated the first turn (None where no turn says): with
        `last_policy_version`, how many weight updates the rollout spans, for an asynchronous trainer's staleness."""
        return next((v for v in self._versions()), None)

    @computed_field  # type: ignore[prop-decorator]
    @property
    def last_policy_version(self) -> int | None:
        return next((v for v in reversed(self._versions())), None)

    def _versions(self) -> list[int]:
        turns = sorted((m for s in self.training_segments() for m in s), key=lambda m: m.get("call", 0))
        versions = [v for m in turns for v, _ in m.get("version_spans") or [(m.get("policy_version"), 0)]]
        return [v for v in versions if v is not None]

    def mask_reason(self) -> str | None:
        """Why a trainer must not learn from this rollout, or None: it failed for a reason that is not the policy's
        (``critical_error``), a turn is masked (broken contiguity, a first turn generated alone), a segment's tokens
        break NeMo RL's contiguity rule, or the grader said so (``mask_sample``). NeMo RL reads it as
        ``mask_sample``; the TRL adapter excludes such samples."""
        if self.critical_error is not None:
            return f"critical_error={self.critical_error}" + (f": {self.error}" if self.error else "")
        if self.stale is not None:
            return f"stale: {self.stale}"
        masked = next((m for m in self.messages if m.get("mask")), None)
        if masked is not None:
            return f"a masked turn: {masked.get('contiguity_error') or masked.get('first_turn_only') or 'mask'}"
        for i, segment in enumerate(self.training_segments()):
            broken = contiguity_violation(segment)
            if broken is not None:
                return f"segment {i} breaks contiguity: {broken}" if self.segments else f"broken contiguity: {broken}"
        if self.evaluation.get("mask_sample"):
            return f"the grader masked it: {self.evaluation.get('failure_reason') or 'mask_sample'}"
        return None


def contiguity_violation(turns: list[dict[str, Any]]) -> str | None:
    """Check NeMo RL's rule: every turn's prompt extends all tokens seen before it. None when it holds."""
    seen: list[int] = []
    for i, turn in enumerate(turns):
        prompt, generation = turn["prompt_token_ids"], turn["generation_token_ids"]
        if len(turn["generation_log_probs"]) != len(generation):
            return f"turn {i}: {len(turn['generation_log_probs'])} log-probs for {len(generation)} generated tokens"
        if prompt[: len(seen)] != seen:
            return f"turn {i}: prompt does not extend the {len(seen)} tokens of earlier turns"
        seen = prompt + generation
    return None
