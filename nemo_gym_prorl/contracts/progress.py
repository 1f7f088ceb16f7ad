"""What the service reports of the generation in progress (`/status`'s `generated`).

A SWE rollout can take minutes, so counting finished rollouts shows nothing for a long time; the model requests
answered and the tokens they generated show the run moving from its first turn.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field


class Generated(BaseModel):
    """Counted since the service's pool started, over every backend it had (removed ones included)."""

    answers: int = Field(0, description="model requests answered: assistant turns generated")
    completion_tokens: int = Field(0, description="the answers' usage.completion_tokens")
    cut: int = Field(0, description="requests a weight update cut (weight_update: cut), each re-issued with its prefix")
    lost_requests: int = Field(0, description="cut requests whose re-issue failed: their rollouts lost to an update")
    lost_tokens: int = Field(0, description="tokens those lost requests had generated before their cut")

    def count(self, answer: Any) -> None:
        self.answers += 1
        usage = answer.get("usage") if isinstance(answer, dict) else None
        tokens = usage.get("completion_tokens") if isinstance(usage, dict) else None
        if isinstance(tokens, int) and not isinstance(tokens, bool) and tokens > 0:
            self.completion_tokens += tokens

    def since(self, earlier: Generated) -> Generated:
        """What was generated after `earlier` (a remote service may have served others before this run)."""
        return Generated(**{field: getattr(self, field) - getattr(earlier, field) for field in Generated.model_fields})
