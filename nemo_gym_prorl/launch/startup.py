"""Checks that what `prorl rollout` / `prorl serve` needs can start, made before anything is started: each failure
is a `StartupError` whose message names the cause and what to do (the CLI shows it as one line)."""

from __future__ import annotations

import asyncio
import errno
import socket
from typing import TYPE_CHECKING

import httpx

from nemo_gym_prorl.contracts.task import TaskConfig
from nemo_gym_prorl.models.launcher import check_gguf
from nemo_gym_prorl.sandbox import SandboxSpec, backends, open_sandbox

if TYPE_CHECKING:
    from nemo_gym_prorl.launch.runtime import ModelConfig


class StartupError(RuntimeError):
    """Something a command needs cannot start; the message says why and what to do."""


def check_service_can_start(model: ModelConfig, sandbox_backend: str, tasks: list[TaskConfig]) -> None:
    """What a service in this process will start besides itself: the local model (its GGUF, its port), sandboxes
    of `sandbox_backend`, and the tasks' NeMo Gym resources servers must be reachable."""
    if model.kind == "local":
        check_gguf(model)
        check_port_free(model.host, model.port, "model.port")
    asyncio.run(check_sandbox_backend(sandbox_backend))
    check_gym_servers(tasks)


async def check_sandbox_backend(backend: str) -> None:
    """Start and close one sandbox of `backend`, as every rollout will."""
    try:
        sandbox = open_sandbox(backend, SandboxSpec())
    except ValueError:
        raise StartupError(
            f"unknown sandbox backend {backend!r}: choose sandbox=bwrap or sandbox=apptainer "
            f"(backends: {', '.join(backends())}), or sandbox.backend=gym:<provider> for a NeMo Gym provider"
        ) from None
    try:
        await sandbox.start()
    except Exception as e:
        detail = " ".join(str(e).split()) or type(e).__name__
        raise StartupError(f"the {backend} sandbox backend cannot start a sandbox: {detail}") from e
    finally:
        await sandbox.close()


def check_port_free(host: str, port: int, setting: str) -> None:
    """`port` on `host` can be listened on (0, any free port, always can); `setting` names the config key."""
    if port == 0:
        return
    try:
        socket.create_server((host, port)).close()
    except OSError as e:
        if e.errno == errno.EADDRINUSE:
            raise StartupError(
                f"{setting}={port}: port {port} on {host} is already in use: stop what listens there "
                f"or choose another {setting}"
            ) from None
        raise StartupError(f"{setting}={port}: cannot listen on {host}:{port}: {e.strerror}") from None


def check_gym_servers(tasks: list[TaskConfig], timeout_s: float = 10.0) -> None:
    """Each task's NeMo Gym resources server answers HTTP (with any status: it is up)."""
    for task in tasks:
        if task.resources_server_url is None:
            continue
        try:
            httpx.get(task.resources_server_url, timeout=timeout_s)
        except httpx.HTTPError as e:
            raise StartupError(
                f"task {task.name!r}: its NeMo Gym resources server {task.resources_server_url} does not answer "
                f"({type(e).__name__}): start it (gym env start ...) or fix resources_server_url in the task file"
            ) from None
