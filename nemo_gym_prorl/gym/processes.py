"""Running NeMo Gym's CLI from Python: each `gym` command in its own session, ready when its head server says so,
and nothing of it left afterwards (on SIGINT Gym's servers can orphan grandchildren, Ray among them, so the whole
session is killed at the end)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import sys
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from nemo_gym_prorl.child_lifetime import ends_with_parent
from nemo_gym_prorl.gym import PLUGIN_ROOT
from nemo_gym_prorl.gym.session_reaper import block_sigterm, session_members

GYM = Path(sys.executable).with_name("gym")
READY_DEADLINE_S = 300.0
STOP_GRACE_S = 30.0
REAPER_GRACE_S = 20.0  # after our death: gym's own shutdown first, then SIGKILL for what it left


def gym_environ(venvs_dir: Path | None = None) -> dict[str, str]:
    """The environment gym commands need: our plugin root, and the venv links (env.yaml's default, relative to the
    repo root, unless `venvs_dir` is given)."""
    environ = os.environ | {
        "PATH": f"{GYM.parent}{os.pathsep}{os.environ.get('PATH', '')}",
        "NEMO_GYM_EXTRA_ROOTS": str(PLUGIN_ROOT),
        "RAY_AUTH_MODE": "disabled",  # no token file under ~/.ray
    }
    if venvs_dir is not None:
        environ["PRORL_GYM_VENVS"] = str(venvs_dir)  # env.yaml's uv_venv_dir
    return environ


async def kill_session(sid: int) -> None:
    """SIGKILL whatever is left in session `sid` (a gym command's servers, Ray), then wait until it is gone."""
    deadline = time.monotonic() + 10
    while members := session_members(sid):
        for pid in members:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if time.monotonic() > deadline:
            raise RuntimeError(f"processes of session {sid} survive SIGKILL: {sorted(members)}")
        await asyncio.sleep(0.1)


def _gym_preexec() -> Callable[[], None]:
    """SIGINT is how gym stops its servers and Ray: what it gets from us when we stop it, and from the kernel if we
    die first. A child of a background job inherits SIGINT ignored, so it is reset to the default first."""
    return ends_with_parent(signal.SIGINT, then=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


async def run_gym(
    args: list[str], environ: dict[str, str], cwd: Path, timeout_s: float, on_start: Callable[[int], None] | None = None
) -> str:
    """Run one `gym` command in its own session (`on_start` gets its pid); its output. Nothing of it is left after."""
    proc = await asyncio.create_subprocess_exec(
        GYM, *args, cwd=cwd, env=environ, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        start_new_session=True, preexec_fn=_gym_preexec(),
    )  # fmt: skip
    if on_start is not None:
        on_start(proc.pid)
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), timeout_s)
    finally:
        await kill_session(proc.pid)
        await proc.wait()
    text = out.decode(errors="replace")
    if proc.returncode != 0:
        raise RuntimeError(f"gym {' '.join(args)} exited {proc.returncode}:\n{text[-6000:]}")
    return text


@dataclass
class GymEnv:
    head: str
    head_port: int
    pid: int
    log: Path
    servers: dict[str, dict[str, Any]]  # process name -> Gym's /server_instances entry (url, pid, ...)


@contextlib.asynccontextmanager
async def gym_env_start(
    args: list[str],
    environ: dict[str, str],
    cwd: Path,
    log: Path,
    head_port: int | None = None,
    hydra_dir: Path | None = None,
) -> AsyncIterator[GymEnv]:
    """`gym env start` in its own session, yielded once every server is ready. On exit it gets SIGINT (its servers
    and Ray shut down), then whatever is left of its session is killed. Hydra's run dir defaults to one under `cwd`."""
    head_port = head_port or free_port()
    hydra_dir = hydra_dir or cwd / "hydra-env-start"
    with log.open("wb") as log_file:
        proc = await asyncio.create_subprocess_exec(
            GYM, "env", "start", *args, f"+head_server.port={head_port}", f"hydra.run.dir={hydra_dir}",
            cwd=cwd, env=environ, stdout=log_file, stderr=asyncio.subprocess.STDOUT, start_new_session=True,
            preexec_fn=_gym_preexec(),
        )  # fmt: skip
    head, reaper = f"http://127.0.0.1:{head_port}", None
    try:
        # If we are killed, gym gets SIGINT from the kernel; this watchdog kills what it leaves (session_reaper.py).
        reaper = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "nemo_gym_prorl.gym.session_reaper", str(proc.pid), str(REAPER_GRACE_S),
            preexec_fn=ends_with_parent(signal.SIGTERM, then=block_sigterm),
        )  # fmt: skip
        await _wait_until_ready(proc, f"{head}/health", log)
        async with httpx.AsyncClient(timeout=10, trust_env=False) as client:
            instances = (await client.get(f"{head}/server_instances")).json()
        yield GymEnv(head, head_port, proc.pid, log, {i["process_name"]: i for i in instances})
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGINT)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(proc.wait(), STOP_GRACE_S)
        await kill_session(proc.pid)
        await proc.wait()
        if reaper is not None:
            with contextlib.suppress(ProcessLookupError):
                reaper.kill()
            await reaper.wait()


async def _wait_until_ready(proc: asyncio.subprocess.Process, health_url: str, log: Path) -> None:
    """Poll the head server's health (503 until every server and the model endpoint answer) within a deadline."""
    deadline = time.monotonic() + READY_DEADLINE_S
    async with httpx.AsyncClient(timeout=5, trust_env=False) as client:
        while True:
            if proc.returncode is not None:
                raise RuntimeError(f"gym env start exited {proc.returncode}:\n{log.read_text()[-6000:]}")
            with contextlib.suppress(httpx.HTTPError):
                if (await client.get(health_url)).status_code == 200:
                    return
            if time.monotonic() > deadline:
                raise RuntimeError(f"gym servers not ready in {READY_DEADLINE_S:g}s:\n{log.read_text()[-6000:]}")
            await asyncio.sleep(0.5)


def free_port() -> int:
    """A free port from the kernel's ephemeral range, outside Gym's own server port range (10001-20000)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
