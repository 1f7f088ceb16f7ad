"""The viewer under a running service (``/ui``): its stored results, its tokenizer, its live counters."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI

from nemo_gym_prorl.service.orchestrator import Orchestrator
from nemo_gym_prorl.viewer.app import create_viewer_app
from nemo_gym_prorl.viewer.detail import TokenTexts
from nemo_gym_prorl.viewer.sources import StoreSource


def service_viewer(orchestrator: Orchestrator, token: str | None) -> FastAPI:
    def live() -> dict[str, Any]:
        """What /status and /metrics report: per-stage queue and active counts, finished rollouts, reward sum."""
        return {
            **orchestrator.status(),
            "finished": dict(orchestrator.finished_rollouts),
            "reward_sum": orchestrator.reward_sum,
        }

    source = StoreSource(orchestrator.store, default_task=next(iter(orchestrator.envs)))
    return create_viewer_app(source, TokenTexts(orchestrator.tokenizer), live, token)
