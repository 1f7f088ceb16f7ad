"""A rollout service for a test: in this process on the stand-in model, or as a `prorl serve` child; and what a
trainer takes from a trajectory, to compare two runs."""

from __future__ import annotations

import asyncio
import signal
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from nemo_gym_prorl.contracts.trajectory import Trajectory
from nemo_gym_prorl.launch.runtime import ModelConfig, ServiceConfig, ServiceSettings
from nemo_gym_prorl.launch.serve import RunningService, run_service


def service_config(model_url: str, tmp_path: Path, **settings) -> ServiceConfig:
    model = ModelConfig(kind="remote", addresses=[model_url], served_model_name="standin", tool_call_format="codeact")
    return ServiceConfig(
        service=ServiceSettings(port=0, store=tmp_path / "service.db", **settings), model=model
    )


@asynccontextmanager
async def service(model_url: str, tmp_path: Path, **settings) -> AsyncIterator[RunningService]:
    async with run_service(service_config(model_url, tmp_path, **settings)) as running:
        yield running


@asynccontextmanager
async def prorl_serve(
    model_url: str, store: Path, *overrides: str, start_timeout_s: float = 60
) -> AsyncIterator[tuple[str, asyncio.subprocess.Process]]:
    argv = [
        sys.executable, "-m", "nemo_gym_prorl.cli", "serve", "model=remote", f"model.addresses=[{model_url}]",
        "model.served_model_name=standin", "model.tool_call_format=codeact", "service.port=0", f"service.store={store}",
        *overrides,
    ]
    process = await asyncio.create_subprocess_exec(*argv, stdout=asyncio.subprocess.PIPE, start_new_session=True)
    try:
        assert process.stdout is not None
        line = (await asyncio.wait_for(process.stdout.readline(), start_timeout_s)).decode()
        assert "listening on" in line, line
        yield line.split("listening on ")[1].split()[0], process
    finally:
        if process.returncode is None:
            process.send_signal(signal.SIGTERM)
            await asyncio.wait_for(process.wait(), 60)


def comparable(t: Trajectory) -> dict:
    """What a trainer takes from a trajectory (token ids on the messages, reward), without ids (a tool call's is
    random) and timings."""
    messages = [m | {"tool_calls": [c | {"id": None} for c in m["tool_calls"]]} if "tool_calls" in m else m
                for m in t.messages]  # fmt: skip
    return {"messages": messages, "reward": t.reward, "resolved": t.resolved, "finish": t.finish,
            "critical_error": t.critical_error, "evaluation": t.evaluation}  # fmt: skip
