"""One rollout of a task that names a harness: the unmodified agent runs in the task's sandbox behind the proxy.

The env stages the task as for our loop (its init, with the proxy's socket and the harness's package layer bound
in), the harness runs as one sandbox process under the task's time limit, the env collects and grades as it
always does, and the trajectory is the proxy's recorded calls split into segments. Failures are told apart so a
trainer can mask what is not the policy's: the sandbox, proxy or backend failing, the harness crashing or hanging
is a `critical_error` with a reason (masked); the harness stopped by the turn limit or the deadline the proxy
enforces is the policy's (`finish: max_turns`). No harness process outlives the rollout: the sandbox closes,
with its pid namespace, in `finally`.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

from nemo_gym_prorl.contracts.sandbox import BindMount, ExecResult, SandboxSpec
from nemo_gym_prorl.contracts.task import HarnessConfig, TaskInstance
from nemo_gym_prorl.contracts.trajectory import Trajectory
from nemo_gym_prorl.envs.base import Environment, Episode
from nemo_gym_prorl.harness.calls import ModelCalls
from nemo_gym_prorl.harness.proxy import ModelProxy, ProxyConfig, ProxyError
from nemo_gym_prorl.harness.segments import segments
from nemo_gym_prorl.sandbox.images import ImageError, build_rootfs
from nemo_gym_prorl.sandbox.layers import SITE, build_pip_layer

LAYER_MOUNT = "/.prorl-harness"
CONFIG_MOUNT = "/.prorl-harness-config"
OUTPUT_TAIL = 2000  # characters of the harness's output kept in the error line of a failed run


class HarnessRunner:
    """Runs `env.task.harness` for one instance; `calls` answers and records its model calls."""

    def __init__(self, env: Environment, calls: ModelCalls, trajectory_id: str) -> None:
        if env.task.harness is None:
            raise ValueError(f"{env.task.origin}: names no harness")
        self.env = env
        self.harness: HarnessConfig = env.task.harness
        self.calls = calls
        self.trajectory_id = trajectory_id

    async def run(self, instance: TaskInstance) -> Trajectory:
        trajectory = Trajectory(instance_id=instance.instance_id, trajectory_id=self.trajectory_id)
        started = time.monotonic()
        config = ProxyConfig(deadline_s=self.harness.timeout_s, max_calls=self.harness.max_turns)
        try:
            layer = await asyncio.to_thread(self._layer)
        except ImageError as e:
            return _failed(trajectory, "init", f"harness {self.harness.name}: its layer could not be built: {e}")
        episode: Episode | None = None
        try:
            async with ModelProxy(self.calls, config) as proxy:
                try:
                    episode = await self.env.init(instance, lambda spec: self._spec(proxy.sandbox_spec(spec), layer))
                    if episode.sandbox is None:
                        return _failed(trajectory, "init", f"{self.env.task.origin}: its env gives no sandbox to "
                                       "run a harness in")  # fmt: skip
                    await proxy.connect(episode.sandbox, lifetime_s=self.harness.timeout_s + 60)
                except (ProxyError, OSError, RuntimeError) as e:
                    return _failed(trajectory, "init", f"harness {self.harness.name}: {e}")
                trajectory.timing.init = time.monotonic() - started
                result = await episode.sandbox.exec(self._argv(instance), timeout=self.harness.timeout_s)
                trajectory.timing.run = time.monotonic() - started - trajectory.timing.init
                self._judge_run(trajectory, result)
                graded = time.monotonic()
                submission = await self.env.collect(episode)
            evaluation = await self.env.grade(instance, submission)
            trajectory.timing.eval = time.monotonic() - graded
        except Exception as e:  # noqa: BLE001  # the sandbox, proxy or backend failed: not the policy's doing
            stage = "eval" if trajectory.timing.run else "run"
            return _failed(trajectory, stage, f"harness {self.harness.name}: {type(e).__name__}: {e}")
        finally:
            if episode is not None:
                await asyncio.shield(self.env.close(episode))
            trajectory.segments = segments(self.calls.calls)
        trajectory.submission = submission
        trajectory.reward, trajectory.resolved = evaluation.reward, evaluation.resolved
        trajectory.evaluation = evaluation.details
        return trajectory

    def _layer(self) -> Path | None:
        if not self.harness.install.pip:
            return None
        return build_pip_layer(self.harness.install.pip, build_rootfs())

    def _spec(self, spec: SandboxSpec, layer: Path | None) -> SandboxSpec:
        binds, env = list(spec.binds), {**spec.env, **self.harness.env}
        if layer is not None:
            binds.append(BindMount(source=str(layer), target=LAYER_MOUNT))
            env["PYTHONPATH"] = f"{LAYER_MOUNT}/{SITE}"
        if self.harness.config_file is not None:
            binds.append(BindMount(source=str(self.harness.config_file.parent), target=CONFIG_MOUNT))
        return spec.model_copy(update={"binds": binds, "env": env})

    def _argv(self, instance: TaskInstance) -> list[str]:
        prompt = self.env.first_prompt(instance)[-1]["content"]
        config = f"{CONFIG_MOUNT}/{self.harness.config_file.name}" if self.harness.config_file else ""
        values: dict[str, Any] = {k: v for k, v in instance.data.items() if isinstance(v, str)}
        values |= {"prompt": prompt, "workdir": self.env.workspace, "config": config, "model": self.calls.model,
                   "max_turns": self.harness.max_turns}  # fmt: skip
        return [part.format(**values) for part in self.harness.command]

    def _judge_run(self, trajectory: Trajectory, result: ExecResult) -> None:
        """Policy or infrastructure: a run the proxy's limits ended is the policy's; a crash or hang is not."""
        trajectory.num_tool_calls = len(self.calls.calls)
        if self.calls.refused:
            trajectory.finish = "max_turns"
            trajectory.error = f"harness {self.harness.name}: {self.calls.refused[0].message}"
        elif result.timed_out or result.exit_code is None:
            _failed(trajectory, "timeout", f"harness {self.harness.name}: no exit within {self.harness.timeout_s:g} s "
                    f"(it was stopped); output ends: {result.output[-OUTPUT_TAIL:]!r}")  # fmt: skip
        elif result.exit_code != 0:
            _failed(trajectory, "run", f"harness {self.harness.name}: exited {result.exit_code}; output ends: "
                    f"{result.output[-OUTPUT_TAIL:]!r}")  # fmt: skip
        else:
            trajectory.finish = "finish"


def _failed(trajectory: Trajectory, stage: str, reason: str) -> Trajectory:
    trajectory.critical_error = stage  # type: ignore[assignment]  # one of CriticalError
    trajectory.error = reason
    trajectory.finish = "error"
    return trajectory
