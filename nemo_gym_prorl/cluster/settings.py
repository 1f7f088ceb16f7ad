"""The ``ray`` knobs of ``prorl serve``: where the rollout workers run, and how many."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class RaySettings(BaseModel):
    model_config = ConfigDict(extra="forbid")
    address: str | None = Field(
        None, description="a running Ray cluster ('auto', 'host:port'); None with local_workers unset: in-process"
    )
    local_workers: int | None = Field(
        None, ge=1, description="no address: start a one-machine Ray with this many worker actors (one per core)"
    )
    workers_per_node: int | None = Field(None, ge=0, description="worker actors per node; None: the node's CPUs")
    sandbox_slots_per_worker: int = Field(64, ge=1, description="live sandboxes one worker holds; placement counts")
    max_reruns: int = Field(1, ge=0, description="times a rollout whose worker was lost is run again elsewhere")
    keep_group_on_node: bool = Field(True, description="the samples of a job (a GRPO group) on one node")
    node_poll_s: float = Field(2.0, gt=0, description="how often the head looks for nodes that came or went")
    worker_ping_interval_s: float = Field(
        5.0, gt=0, description="how often the head pings each worker (one tiny actor call, whatever its rollouts)"
    )
    worker_unresponsive_s: float = Field(
        30.0, gt=0, description="a worker that has not answered a ping for this long is killed and counted lost "
        "(a wedged event loop, a stopped process): its rollouts run again elsewhere",
    )  # fmt: skip
    worker_max_concurrency: int = Field(10_000, ge=1, description="calls one worker actor runs at once")
    object_store_mb: int = Field(256, ge=80, description="a local cluster's object store (rollouts pass little)")
    namespace: str = "prorl"

    @property
    def enabled(self) -> bool:
        return self.address is not None or self.local_workers is not None
