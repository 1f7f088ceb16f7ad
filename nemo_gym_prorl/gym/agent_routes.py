"""NeMo Gym's agent API on the rollout service: ``POST /run`` (a Gym dataset row in, a Gym verify response out) and
``POST /aggregate_metrics`` (those verify responses in, Gym's run metrics out).

A row picks one of the service's tasks with ``prorl_task`` (default: the first); every call is a fresh rollout. A
result always carries what NeMo RL needs: ``mask_sample`` also at ``instance_config.mask_sample``, at least one
output item with generated tokens (masked when the rollout ended before its first turn), and top-level numbers it
logs as metrics. NeMo RL takes one contiguous token sequence per result: a harness rollout of several segments
puts its final segment in ``response.output`` (as NeMo Gym's own token capture delivers one chain per rollout) and
the others, as output items too, in ``other_segments``.

Design notes: docs/nemo-gym.md#gymagent_routespy
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from fastapi import FastAPI, HTTPException
from nemo_gym.base_resources_server import AggregateMetrics, AggregateMetricsRequest, BaseVerifyResponse
from nemo_gym.failure_kinds import AGENT_RUN_ERROR, AGENT_TIMEOUT, CANCELLED, PROVIDER_UNAVAILABLE, VERIFIER_ERROR
from nemo_gym.reward_profile import compute_aggregate_metrics
from pydantic import BaseModel, ConfigDict, Field

from nemo_gym_prorl.contracts.job import JobRequest
from nemo_gym_prorl.contracts.responses import gym_output_items
from nemo_gym_prorl.contracts.sampling import SamplingParams
from nemo_gym_prorl.contracts.trajectory import Trajectory
from nemo_gym_prorl.gym.rows import TASK_KEY
from nemo_gym_prorl.service.app import bearer_guard
from nemo_gym_prorl.service.orchestrator import Orchestrator, RejectedJob

_FAILURE_KINDS = {
    "init": PROVIDER_UNAVAILABLE,
    "run": AGENT_RUN_ERROR,
    "eval": VERIFIER_ERROR,
    "timeout": AGENT_TIMEOUT,
    "cancelled": CANCELLED,
}
# Row keys that are Gym's bookkeeping, not task data. `responses_create_params` is task data: a Gym resources
# server's task reads its prompt and tools there, and Gym's agents send it to /seed_session and /verify.
_BOOKKEEPING_KEYS = {"agent_ref", "task_source", "_ng_rollout_id"}


class GymRunRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    responses_create_params: dict[str, Any] = Field(default_factory=dict)
    prorl_task: str | None = Field(None, description="the service's task the row belongs to (default: the first)")


def row_sampling(params: dict[str, Any]) -> SamplingParams:
    """The row's Responses-API sampling parameters, unchanged, as ours."""
    values: dict[str, Any] = {}
    for ours, theirs in (("temperature", "temperature"), ("top_p", "top_p"), ("max_tokens", "max_output_tokens")):
        if params.get(theirs) is not None:
            values[ours] = params[theirs]
    if params.get("seed") is not None:
        values["seed"] = params["seed"]
    return SamplingParams(**values)


def _segment_items(trajectory: Trajectory) -> tuple[list[dict[str, Any]], list[list[dict[str, Any]]]]:
    """The output items NeMo RL trains on and those of the segments it cannot take. Our own loop's are its
    conversation (tool results included); a harness's are its final segment's turns (its tool results are in the
    next prompt's ids) and each other segment's, in the order they began."""
    if not trajectory.segments:
        return gym_output_items(trajectory.messages), []
    final = trajectory.final_segment()
    others = [segment for segment in trajectory.training_segments() if segment is not final]
    return gym_output_items(final), [gym_output_items(segment) for segment in others]


def _generated(segments: list[list[dict[str, Any]]]) -> int:
    return sum(len(turn["generation_token_ids"]) for segment in segments for turn in segment)


def gym_verify_response(row: GymRunRequest, trajectory: Trajectory, model: str) -> dict[str, Any]:
    verdict = trajectory.evaluation  # what the grader said beside the reward: a Gym server's own mask and failure
    masked = trajectory.mask_reason() is not None
    output, other_segments = _segment_items(trajectory)
    segments = trajectory.training_segments()
    generated = _generated(segments)
    response = {
        "id": f"resp_{trajectory.trajectory_id}",
        "object": "response",
        "created_at": time.time(),
        "model": model,
        "output": output,
        "parallel_tool_calls": True,
        "tool_choice": "auto",
        "tools": [],
    }
    body = {
        **row.model_dump(exclude={TASK_KEY}),
        "response": response,
        "reward": trajectory.reward,
        "mask_sample": masked,
        "failure_kind": _FAILURE_KINDS.get(trajectory.critical_error or "") or verdict.get("failure_kind"),
        "failure_reason": trajectory.error or verdict.get("failure_reason"),
    }
    BaseVerifyResponse.model_validate(body)  # the shape Gym and NeMo RL read; fails loudly here, not there
    timing = trajectory.timing
    row_config = body.get("instance_config")
    return body | {
        # where NeMo RL reads the mask (beside what a row's own instance_config carries)
        "instance_config": {**(row_config if isinstance(row_config, dict) else {}), "mask_sample": masked},
        "resolved": trajectory.resolved,
        "finish": trajectory.finish,
        "critical_error": trajectory.critical_error,
        "evaluation": trajectory.evaluation,
        "instance_id": trajectory.instance_id,
        "trajectory_id": trajectory.trajectory_id,
        "other_segments": other_segments,
        # NeMo RL logs every top-level number of a result as a metric (per agent): these, always present.
        "num_turns": sum(1 for segment in segments for m in segment if "first_turn_only" not in m),
        "num_segments": len(segments),
        # the share of generated tokens in response.output (NeMo Gym's token capture reports its delivered_fraction)
        "delivered_fraction": _generated([trajectory.final_segment()]) / generated if generated else 0.0,
        "num_tool_calls": trajectory.num_tool_calls,
        "num_format_errors": trajectory.num_format_errors,
        "init_time_s": timing.init,
        "run_time_s": timing.run,
        "eval_time_s": timing.eval,
        "queued_time_s": timing.queued,
    }


async def run_row(orchestrator: Orchestrator, row: GymRunRequest) -> dict[str, Any]:
    """One Gym row as one rollout; its verify response. It asks for ``first_turn_fallback``: a rollout that ends
    before the model's first turn comes back with that turn generated alone and masked, since a result without
    generated tokens would end NeMo RL's training step."""
    instance = {k: v for k, v in row.model_dump(exclude={TASK_KEY}).items() if k not in _BOOKKEEPING_KEYS}
    request = JobRequest(
        task=row.prorl_task, instance=instance, sampling_params=row_sampling(row.responses_create_params),
        first_turn_fallback=True,
    )  # fmt: skip
    try:
        job_id = orchestrator.submit(request)
    except RejectedJob as e:  # named as the row names it
        raise RejectedJob({"task": TASK_KEY, "instance": "row"}.get(e.field, e.field), e.message) from None
    (trajectory,) = (await orchestrator.wait(job_id)).results
    return gym_verify_response(row, trajectory, orchestrator.model.name)


async def aggregate_metrics(body: AggregateMetricsRequest) -> AggregateMetrics:
    # Gym's profiler (pandas) is CPU-bound over a whole run's rollouts: off the loop the pipeline runs on.
    try:
        return await asyncio.to_thread(compute_aggregate_metrics, body.verify_responses)
    except Exception as e:  # the items are free-form dicts; what Gym's profiler cannot take is a bad request
        raise HTTPException(422, f"verify_responses: Gym cannot aggregate them: {type(e).__name__}: {e}") from e


def add_gym_agent_routes(app: FastAPI, orchestrator: Orchestrator, token: str | None) -> None:
    @app.post("/run", dependencies=[bearer_guard(token)])
    async def run(row: GymRunRequest) -> dict[str, Any]:
        return await run_row(orchestrator, row)

    app.post("/aggregate_metrics", dependencies=[bearer_guard(token)])(aggregate_metrics)
