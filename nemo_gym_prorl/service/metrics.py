"""Prometheus metrics of the rollout service, read from the orchestrator's live state at each scrape."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

if TYPE_CHECKING:
    from nemo_gym_prorl.service.orchestrator import Orchestrator


class _OrchestratorCollector:
    def __init__(self, orchestrator: Orchestrator) -> None:
        self._orchestrator = orchestrator

    def collect(self) -> Iterator[Metric]:
        o = self._orchestrator
        queued = GaugeMetricFamily("prorl_stage_queued", "rollouts waiting for a stage", labels=["stage"])
        active = GaugeMetricFamily("prorl_stage_active", "rollouts in a stage", labels=["stage"])
        for stage, counts in o.pipeline.status().items():
            queued.add_metric([stage], counts["queued"])
            active.add_metric([stage], counts["active"])
        yield queued
        yield active
        yield GaugeMetricFamily("prorl_live_rollouts", "rollouts accepted and not finished", value=o.pipeline.live)
        jobs = GaugeMetricFamily("prorl_jobs", "jobs by state", labels=["state"])
        for state, count in o.store.counts().items():
            jobs.add_metric([state], count)
        yield jobs
        finished = CounterMetricFamily("prorl_rollouts_finished", "finished rollouts by outcome", labels=["outcome"])
        for outcome, count in o.finished_rollouts.items():
            finished.add_metric([outcome], count)
        yield finished
        yield CounterMetricFamily("prorl_reward", "sum of rewards of finished rollouts", value=o.reward_sum)
        backends = GaugeMetricFamily("prorl_llm_backend_in_flight", "requests in flight per backend", labels=["address"])
        healthy = GaugeMetricFamily("prorl_llm_backend_healthy", "1 when a backend takes new trajectories", labels=["address"])
        for backend in o.pool.backends():
            backends.add_metric([backend.address], backend.in_flight)
            healthy.add_metric([backend.address], 1.0 if backend.healthy else 0.0)
        yield backends
        yield healthy


class ServiceMetrics:
    def __init__(self, orchestrator: Orchestrator) -> None:
        self._registry = CollectorRegistry()
        self._registry.register(_OrchestratorCollector(orchestrator))  # type: ignore[arg-type]

    def render(self) -> bytes:
        return generate_latest(self._registry)
