"""What a remote rollout asks of the fleet: a worker to run on, held from init to close, and given back."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, Protocol

from ray.actor import ActorHandle

from nemo_gym_prorl.cluster.settings import RaySettings


@dataclass(eq=False)
class WorkerRef:
    actor: ActorHandle
    node_id: str
    name: str
    slots: int
    live: int = 0  # rollouts placed here holding a sandbox
    ready: bool = False
    info: dict[str, Any] = field(default_factory=dict)
    lost_reason: str | None = None  # why the head gave up on it, for the rollouts it held
    watch: asyncio.Task[None] | None = None  # its liveness pings, while it is ready


class Placement(Protocol):
    settings: RaySettings

    async def place(self, group: str) -> WorkerRef: ...

    def place_on(self, worker: WorkerRef, group: str) -> WorkerRef: ...

    def release(self, worker: WorkerRef, group: str) -> None: ...

    async def any_worker(self, prefer: WorkerRef | None = None) -> WorkerRef: ...

    def lost(self, worker: WorkerRef, error: BaseException | str) -> None: ...
