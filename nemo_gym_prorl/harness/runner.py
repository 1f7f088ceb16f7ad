"""A harness in our agent loop's place: the pipeline's init, run and close of a rollout whose task names one.

`init` stages the task as for our loop, with the rollout's model proxy started and its socket, the harness's
package layer and its config file bound into the sandbox; `run` runs the unmodified harness as one sandbox process
under the task's time limit (the env then collects and grades as it always does: the workspace's patch, or the
answer the harness left in its `answer_file`); the trajectory's segments are the proxy's recorded calls. The proxy
lives from init to the end of run, and `close` (every path that frees the sandbox) stops it. Failures are told
apart so a trainer can mask what is not the policy's: the sandbox, proxy or backend failing, the harness crashing
or hanging is a `critical_error` with a reason (masked); the harness stopped by the turn limit or the deadline the
proxy enforces is the policy's (``finish: max_turns``). No harness process outlives the rollout: the sandbox
closes, with its pid namespace.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any, ClassVar

from nemo_gym_prorl.contracts.sandbox import IMAGE_PATH, BindMount, ExecResult, SandboxSpec
from nemo_gym_prorl.contracts.task import HarnessConfig, TaskInstance
from nemo_gym_prorl.contracts.trajectory import RolloutFailed, Trajectory
from nemo_gym_prorl.envs.base import Environment, Episode
from nemo_gym_prorl.harness.calls import ModelCalls
from nemo_gym_prorl.harness.proxy import ModelProxy, ProxyConfig, ProxyError
from nemo_gym_prorl.harness.segments import segments
from nemo_gym_prorl.sandbox.images import ImageError, build_rootfs
from nemo_gym_prorl.sandbox.layers import BIN, SITE, build_npm_layer, build_pip_layer

LAYER_MOUNT = "/.prorl-harness"  # the pip layer: its site/ on PYTHONPATH
NPM_LAYER_MOUNT = "/.prorl-harness-npm"  # the npm layer: its bin/ (native commands) first on PATH
CONFIG_MOUNT = "/.prorl-harness-config"
OUTPUT_TAIL = 2000  # characters of the harness's output kept in the error line of a failed run
FORWARDER_MARGIN_S = 60.0  # the forwarder outlives the harness's own time limit by this much at most


class HarnessRunner:
    """Runs `harness` for one rollout; `calls` answers and records its model calls."""

    # Each sample's sandbox binds its own proxy: a GRPO group's samples never share one init.
    can_share_init: ClassVar[bool] = False

    def __init__(self, harness: HarnessConfig, calls: ModelCalls, proxy: ProxyConfig | None = None) -> None:
        self.harness = harness
        self.calls = calls
        self.proxy_config = proxy or ProxyConfig()
        self._proxy: ModelProxy | None = None

    async def init(self, env: Environment, instance: TaskInstance) -> Episode:
        """The task staged in a sandbox that reaches the model through this rollout's proxy, and nothing else."""
        name = self.harness.name
        try:
            layers = await asyncio.to_thread(self._layers)
        except ImageError as e:
            raise RolloutFailed("init", f"harness {name}: its layer could not be built: {e}") from None
        self._proxy = proxy = ModelProxy(self.calls, self.proxy_config)
        try:
            await proxy.start()
            episode = await env.init(instance, lambda spec: self._spec(proxy.sandbox_spec(spec), layers))
            try:
                if episode.sandbox is None:
                    raise RolloutFailed("init", f"{env.task.origin}: its env gives no sandbox to run a harness in")
                await proxy.connect(episode.sandbox, lifetime_s=self.harness.timeout_s + FORWARDER_MARGIN_S)
            except BaseException:
                await env.close(episode)
                raise
        except BaseException as e:
            await self.close()
            if isinstance(e, ProxyError | OSError):
                raise RolloutFailed("init", f"harness {name}: {e}") from None
            raise
        return episode

    def start(self, env: Environment, episode: Episode, trajectory: Trajectory) -> None:
        """The harness's limits count from here: its turns, and its deadline for the model calls it makes."""
        trajectory.messages, trajectory.tools, trajectory.finish = [], [], None
        self.calls.set_limits(self.harness.timeout_s, self.proxy_config.token_budget, self.harness.max_turns)

    async def run(self, env: Environment, episode: Episode, trajectory: Trajectory) -> None:
        """The harness's one process; its calls become the trajectory's segments whatever ended it."""
        assert episode.sandbox is not None
        try:
            result = await episode.sandbox.exec(self._argv(env, episode.instance), timeout=self.harness.timeout_s)
        finally:
            trajectory.segments = segments(self.calls.calls)
            trajectory.num_tool_calls = len(self.calls.calls)
            await self.close()
        self._judge(trajectory, result)
        if self.harness.answer_file is not None:
            episode.answer = await self._answer(episode)

    async def close(self) -> None:
        """Idempotent: the proxy, its socket and its forwarder are gone when it returns."""
        proxy, self._proxy = self._proxy, None
        if proxy is not None:
            await proxy.close()

    async def _answer(self, episode: Episode) -> str | None:
        """`collect: answer_file`: the file's text, what the env grades as the answer; none written (or not a
        readable file) is no answer, the policy's outcome."""
        assert episode.sandbox is not None and self.harness.answer_file is not None
        try:
            data = await episode.sandbox.read_file(self.harness.answer_file)
        except OSError:
            return None
        return data.decode("utf-8", errors="replace").strip()

    def _layers(self) -> dict[str, Path]:
        """The harness's package layers, built unless cached, by where its sandbox binds them."""
        install, layers = self.harness.install, {}
        if install.pip:
            layers[LAYER_MOUNT] = build_pip_layer(install.pip, build_rootfs())
        if install.npm:
            layers[NPM_LAYER_MOUNT] = build_npm_layer(install.npm)
        return layers

    def _spec(self, spec: SandboxSpec, layers: dict[str, Path]) -> SandboxSpec:
        binds, env = list(spec.binds), {**spec.env, **self.harness.env}
        binds += [BindMount(source=str(layer), target=mount) for mount, layer in layers.items()]
        if LAYER_MOUNT in layers:
            env["PYTHONPATH"] = f"{LAYER_MOUNT}/{SITE}"
        if NPM_LAYER_MOUNT in layers:
            env["PATH"] = f"{NPM_LAYER_MOUNT}/{BIN}:{env.get('PATH', IMAGE_PATH)}"
        if (config := self.harness.config_file) is not None:  # the file alone: its folder may hold the gold answers
            binds.append(BindMount(source=str(config), target=f"{CONFIG_MOUNT}/{config.name}"))
        return spec.model_copy(update={"binds": binds, "env": env})

    def _argv(self, env: Environment, instance: TaskInstance) -> list[str]:
        prompt = env.first_prompt(instance)[-1]["content"]
        config = f"{CONFIG_MOUNT}/{self.harness.config_file.name}" if self.harness.config_file else ""
        values: dict[str, Any] = {k: v for k, v in instance.data.items() if isinstance(v, str)}
        values |= {"prompt": prompt, "workdir": env.workspace, "config": config, "model": self.calls.model,
                   "max_turns": self.harness.max_turns}  # fmt: skip
        return [part.format(**values) for part in self.harness.command]

    def _judge(self, trajectory: Trajectory, result: ExecResult) -> None:
        """Policy or infrastructure: a run the proxy's limits ended is the policy's; a crash or hang is not."""
        name, tail = self.harness.name, result.output[-OUTPUT_TAIL:]
        if self.calls.refused:
            trajectory.finish = "max_turns"
        elif result.timed_out or result.exit_code is None:
            raise RolloutFailed("timeout", f"harness {name}: no exit within {self.harness.timeout_s:g} s (it was "
                                f"stopped); output ends: {tail!r}")  # fmt: skip
        elif result.exit_code != 0:
            raise RolloutFailed("run", f"harness {name}: exited {result.exit_code}; output ends: {tail!r}")
        else:
            trajectory.finish = "finish"
