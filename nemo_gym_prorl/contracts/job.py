"""A job, as a trainer submits it and reads it back: one task instance, its sampling parameters, n samples."""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from nemo_gym_prorl.contracts.sampling import SamplingParams
from nemo_gym_prorl.contracts.trajectory import Trajectory

_JOB_ID = re.compile(r"^[A-Za-z0-9_.:-]{1,128}$")
MAX_STALE_RERUNS = 3
"""How often a stale sample is run again (``on_stale: rerun``) before it is recorded masked: weight updates that
keep outpacing a rollout would otherwise rerun it for ever."""


class Deadlines(BaseModel):
    """Per-job deadlines in seconds of stage time (queue time never counts); unset ones use the service's."""

    model_config = ConfigDict(extra="forbid")
    init_s: float | None = Field(None, gt=0)
    run_s: float | None = Field(None, gt=0)
    eval_s: float | None = Field(None, gt=0)
    total_s: float | None = Field(None, gt=0)


class JobRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    task: str | None = Field(None, description="a task the service runs; its first task when unset")
    instance: dict[str, Any] = Field(description="one dataset row of that task")
    instance_id: str | None = None
    sampling_params: SamplingParams = Field(default_factory=SamplingParams)
    n: int = Field(1, ge=1, description="samples of this instance (a GRPO group)")
    stop_at_usable: int | None = Field(
        None, ge=1, description="early stop: once this many samples are usable (no critical error, nothing masked) "
        "the others are cancelled and their sandboxes freed, so a straggler does not hold the group; they come back "
        "as cancelled results. An infrastructure failure never counts as usable",
    )  # fmt: skip
    max_version_lag: int | None = Field(
        None, ge=0, description="staleness bound: a sample whose turns span more weight updates than this (last "
        "policy version minus first) is stale, handled as `on_stale` says",
    )  # fmt: skip
    on_stale: Literal["mask", "rerun"] = Field(
        "mask", description="mask: recorded with `stale` set (a trainer skips it); rerun: run again from its start, "
        "at most MAX_STALE_RERUNS times, then masked",
    )  # fmt: skip
    job_id: str | None = None
    deadlines: Deadlines = Field(default_factory=Deadlines)
    first_turn_fallback: bool = Field(
        False,
        description="a sample that ends before the model's first turn (its sandbox did not start, say) comes back "
        "with that turn generated on the prompt alone and masked: NeMo RL needs a generated token in every result",
    )

    @model_validator(mode="after")
    def _stop_within_group(self) -> JobRequest:
        if self.stop_at_usable is not None and self.stop_at_usable > self.n:
            raise ValueError(f"stop_at_usable must be at most n ({self.n}), got {self.stop_at_usable}")
        return self

    @field_validator("job_id")
    @classmethod
    def _job_id_shape(cls, job_id: str | None) -> str | None:
        if job_id is not None and not _JOB_ID.match(job_id):
            raise ValueError("job_id must be 1-128 characters of letters, digits, _ . : -")
        return job_id


class Acknowledgement(BaseModel):
    """A consumer (a trainer, by a name it keeps across its restarts) has taken these samples of a job: its
    streams (``?consumer=NAME``) skip them from now on, so a restarted trainer gets each result once."""

    model_config = ConfigDict(extra="forbid")
    consumer: str = Field(pattern=_JOB_ID.pattern)
    samples: list[int] = Field(min_length=1)


class JobView(BaseModel):
    job_id: str
    state: str
    n: int
    finished: int
    results: list[Trajectory]
