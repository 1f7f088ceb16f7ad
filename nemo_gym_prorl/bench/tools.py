"""The bash tool's round trip on each sandbox, in one run: the same command (`echo hi`), from the call to its result.

Sides, each started once before measuring:
- ours, bwrap: `BashTool` on a `BwrapSandbox` (the default image's rootfs); the command goes to the sandbox's
  persistent shell.
- ours, Apptainer: `BashTool` on an `ApptainerSandbox` (the default image's SIF); the shell runs in the instance.
- Gym apptainer: NeMo Gym's own `apptainer` provider (`AsyncSandbox.exec`) on the same SIF with the same Apptainer
  binary (`gym_apptainer_config`): one `apptainer exec instance://...` per command.
- Gym local: Gym's `local` provider: one `bash -c` subprocess on the host per command, no isolation at all.

The sides are called in turn, one command each, round after round, so whatever else the machine does falls on all
of them alike; every answer is checked. Prints p50/p95 per side, then ratios of the p50s: ours-bwrap vs Gym local
(goal >= 1: isolation at no cost over a bare subprocess) and, last, ours-apptainer vs Gym apptainer (goal >= 25x).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import statistics
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from nemo_gym.sandbox import AsyncSandbox
from nemo_gym.sandbox import SandboxSpec as GymSandboxSpec

from nemo_gym_prorl.contracts.sandbox import Sandbox, SandboxSpec
from nemo_gym_prorl.gym.sandbox_providers import gym_apptainer_config
from nemo_gym_prorl.sandbox import images
from nemo_gym_prorl.sandbox.apptainer import ApptainerSandbox, remove_instance_logs
from nemo_gym_prorl.sandbox.bwrap import BwrapSandbox
from nemo_gym_prorl.tools.bash import BashTool

COMMAND = "echo hi"
EXPECTED = "hi\n"


@dataclass
class Side:
    name: str
    call: Callable[[], Awaitable[str]]
    samples: list[float] = field(default_factory=list)

    async def measure(self) -> None:
        started = time.perf_counter()
        answer = await self.call()
        self.samples.append(time.perf_counter() - started)
        if answer != EXPECTED:
            raise RuntimeError(f"{self.name} answered {answer!r} to {COMMAND!r}")


class Measured(Protocol):
    samples: list[Any]

    async def measure(self) -> None: ...


async def take_turns(sides: Sequence[Measured], rounds: int, warmup: int) -> None:
    """Measure each side once a round, in turn, so whatever else the machine does falls on all of them alike;
    `warmup` rounds first, not kept. Each round takes the sides in an order of its own (shuffled, the same from
    run to run), so that no side always comes right after the same one: an Apptainer cycle leaves the next start
    ~10 ms colder, which in a fixed order fell on one side only."""
    order = random.Random(0)

    async def one_round() -> None:
        for side in order.sample(list(sides), len(sides)):
            await side.measure()

    for _ in range(warmup):
        await one_round()
    for side in sides:
        side.samples.clear()
    for _ in range(rounds):
        await one_round()


def p50_p95(seconds: list[float]) -> tuple[float, float]:
    return statistics.median(seconds), statistics.quantiles(seconds, n=20, method="inclusive")[-1]


def default_images() -> tuple[str, str]:
    """The default image's rootfs (bwrap) and SIF (Apptainer); built once if missing."""
    rootfs = images.build_rootfs()
    return str(rootfs), str(images.build_sif(rootfs))


@contextlib.asynccontextmanager
async def gym_sandbox(config: dict[str, Any], spec: GymSandboxSpec) -> AsyncIterator[AsyncSandbox]:
    """A started NeMo Gym `AsyncSandbox`; on exit it is stopped, and for Gym's apptainer provider the instance's
    log files it leaves behind are removed."""
    async with AsyncSandbox(config, spec) as box:
        await box.start()
        name = (await box.serialize())["sandbox_id"] if "apptainer" in config else None
        try:
            yield box
        finally:
            await box.stop()
            if name is not None:
                remove_instance_logs(name)


def bash_tool_call(sandbox: Sandbox) -> Callable[[], Awaitable[str]]:
    tool = BashTool()

    async def call() -> str:
        return (await tool(sandbox, {"command": COMMAND})).text

    return call


def gym_exec_call(box: AsyncSandbox) -> Callable[[], Awaitable[str]]:
    async def call() -> str:
        result = await box.exec(COMMAND, timeout_s=30)
        return result.stdout if result.return_code == 0 else f"{result!r}"

    return call


async def _run(commands: int, warmup: int) -> None:
    rootfs, sif = default_images()
    async with contextlib.AsyncExitStack() as stack:
        bwrap = await stack.enter_async_context(BwrapSandbox(SandboxSpec(image=rootfs)))
        apptainer = await stack.enter_async_context(ApptainerSandbox(SandboxSpec(image=sif)))
        gym_apptainer = await stack.enter_async_context(
            gym_sandbox(gym_apptainer_config(), GymSandboxSpec(image=sif, workdir="/sandbox"))
        )
        gym_local = await stack.enter_async_context(gym_sandbox({"local": {}}, GymSandboxSpec()))
        sides = [
            Side("ours, bwrap (BashTool, persistent shell)", bash_tool_call(bwrap)),
            Side("ours, Apptainer instance (BashTool, persistent shell)", bash_tool_call(apptainer)),
            Side("NeMo Gym apptainer provider (exec)", gym_exec_call(gym_apptainer)),
            Side("NeMo Gym local provider (exec, bare subprocess)", gym_exec_call(gym_local)),
        ]
        await take_turns(sides, commands, warmup)
    print(f"bash tool round trip of {COMMAND!r}, {commands} commands per side (after {warmup} warm-up), same image:")
    for side in sides:
        p50, p95 = p50_p95(side.samples)
        print(f"  {side.name:<54} p50 {p50 * 1e3:8.2f} ms   p95 {p95 * 1e3:8.2f} ms")
    ours_bwrap, ours_apptainer, gym_apptainer_p50, gym_local_p50 = (statistics.median(s.samples) for s in sides)
    print(f"ours-bwrap vs Gym local (p50): {gym_local_p50 / ours_bwrap:.2f}x (goal >= 1x)")
    print(f"ours-apptainer vs Gym apptainer (p50): {gym_apptainer_p50 / ours_apptainer:.1f}x faster (goal >= 25x)")


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="prorl bench tools")
    parser.add_argument("--commands", type=int, default=200, help="measured commands per side")
    parser.add_argument("--warmup", type=int, default=10)
    args = parser.parse_args(argv)
    if args.commands < 2:
        parser.error("--commands must be at least 2")
    asyncio.run(_run(args.commands, args.warmup))
