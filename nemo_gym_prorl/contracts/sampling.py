"""Sampling parameters of a job: what the trainer sets for every turn of its rollouts."""

from __future__ import annotations

from pydantic import BaseModel, Field


class SamplingParams(BaseModel):
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(-1, description="-1 or 0: no top-k")
    seed: int | None = None
    stop: list[str] = Field(default_factory=list)
    top_logprobs: int = Field(0, ge=0, le=20)
