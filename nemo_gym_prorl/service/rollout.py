"""One rollout's whole life — init, run, eval — and many of them concurrently.

Every stage's failure ends up in the trajectory (``critical_error`` names the stage) instead of escaping, and the
sandbox is closed whatever happened.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable, Iterable

from nemo_gym_prorl.envs.base import Environment
from nemo_gym_prorl.envs.dataset import TaskInstance
from nemo_gym_prorl.service.agent_loop import AgentLoop
from nemo_gym_prorl.service.trajectory import Trajectory


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


async def run_rollout(env: Environment, agent: AgentLoop, instance: TaskInstance) -> Trajectory:
    trajectory = Trajectory(instance_id=instance.instance_id, trajectory_id=uuid.uuid4().hex)
    started = time.perf_counter()
    try:
        episode = await env.init(instance)
    except Exception as e:
        trajectory.critical_error, trajectory.error = "init", _describe(e)
        trajectory.timing.init = time.perf_counter() - started
        return trajectory
    try:
        trajectory.timing.init = time.perf_counter() - started
        started = time.perf_counter()
        try:
            outcome = await agent.run(env, episode)
        except Exception as e:
            trajectory.critical_error, trajectory.error, trajectory.finish = "run", _describe(e), "error"
            return trajectory
        finally:
            trajectory.timing.run = time.perf_counter() - started
        trajectory.messages, trajectory.tools, trajectory.finish = outcome.messages, outcome.tools, outcome.finish
        trajectory.num_tool_calls, trajectory.num_format_errors = outcome.num_tool_calls, outcome.num_format_errors
        started = time.perf_counter()
        try:
            evaluation = await env.eval(episode)
        except Exception as e:
            trajectory.critical_error, trajectory.error = "eval", _describe(e)
            return trajectory
        finally:
            trajectory.timing.eval = time.perf_counter() - started
        trajectory.reward, trajectory.resolved = evaluation.reward, evaluation.resolved
        trajectory.evaluation = evaluation.details
        return trajectory
    finally:
        await env.close(episode)


async def run_rollouts(
    jobs: Iterable[tuple[TaskInstance, AgentLoop]],
    env: Environment,
    concurrency: int,
    on_done: Callable[[Trajectory], None] | None = None,
) -> list[Trajectory]:
    """Run every (instance, agent) job with at most `concurrency` live at once; `on_done` sees each as it ends."""
    gate = asyncio.Semaphore(concurrency)

    async def one(instance: TaskInstance, agent: AgentLoop) -> Trajectory:
        queued = time.perf_counter()
        async with gate:
            waited = time.perf_counter() - queued
            trajectory = await run_rollout(env, agent, instance)
        trajectory.timing.queued = waited
        if on_done is not None:
            on_done(trajectory)
        return trajectory

    return list(await asyncio.gather(*(one(instance, agent) for instance, agent in jobs)))
