"""The head's LLM pool when rollouts run on Ray workers: each worker has a pool of its own, so what the trainer
does to the head's pool (``/add_llm_server``, ``/clear_llm_server``, ``/llm/pause`` for a weight sync, resume)
reaches every worker's too; a worker started later gets the backends and the pause state of the moment."""

from __future__ import annotations

import asyncio
from typing import Protocol

from nemo_gym_prorl.agent.llm_pool import LLMPool, normalize_address
from nemo_gym_prorl.cluster.worker import Backend


class Workers(Protocol):
    """The fleet, as its pool reaches every worker's pool."""

    def add_backend(self, backend: Backend) -> None: ...

    def remove_backend(self, address: str) -> None: ...

    async def pause(self) -> None: ...

    def resume(self, policy_version: int | None = None) -> None: ...


class FleetPool(LLMPool):
    def __init__(self, *args: object, **kwargs: object) -> None:
        self._known: dict[str, Backend] = {}
        self._fleet: Workers | None = None
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]

    def attach(self, fleet: Workers) -> None:
        self._fleet = fleet

    def backend_list(self) -> list[Backend]:
        return list(self._known.values())

    def add(self, address: str, model: str | None = None, api_key: str | None = None) -> str:
        base = super().add(address, model, api_key)
        backend = self._known[base] = Backend(address=base, model=model, api_key=api_key)
        if self._fleet is not None:
            self._fleet.add_backend(backend)
        return base

    def remove(self, address: str) -> bool:
        removed = super().remove(address)
        base = normalize_address(address)
        if self._known.pop(base, None) is not None and self._fleet is not None:
            self._fleet.remove_backend(base)
        return removed

    async def pause(self) -> None:
        self._paused = True  # before the workers are asked: one started meanwhile starts paused
        await asyncio.gather(super().pause(), *([self._fleet.pause()] if self._fleet is not None else []))

    def resume(self, policy_version: int | None = None) -> None:
        super().resume(policy_version)
        if self._fleet is not None:
            self._fleet.resume(policy_version)
