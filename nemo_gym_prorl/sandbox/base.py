"""The sandbox contract: a spec to start from, the result of a command, and the protocol every backend implements.

A sandbox is an isolated place where an agent's commands run. It holds a persistent shell (cwd and environment
survive between commands), moves files in and out of its workspace, and is always torn down: `close()` is
idempotent and leaves no process, mount or temp dir behind, whatever happened before it.
"""

from __future__ import annotations

from typing import Protocol, Self

from pydantic import BaseModel, Field

WORKSPACE = "/workspace"


class SandboxLimits(BaseModel):
    """Resource limits applied to everything that runs inside one sandbox."""

    wall_clock_s: float = Field(1800.0, gt=0, description="lifetime of the sandbox; past it, it is killed")
    memory_mb: int = Field(2048, gt=0, description="address-space limit of each process inside")
    max_output_bytes: int = Field(64_000, gt=0, description="bytes of one command's output kept (head and tail)")


class SandboxSpec(BaseModel):
    """What to start a sandbox from."""

    network: bool = False
    env: dict[str, str] = Field(default_factory=dict)
    limits: SandboxLimits = Field(default_factory=SandboxLimits)


class ExecResult(BaseModel):
    """What one command produced."""

    output: str
    exit_code: int | None = Field(description="None when the command did not finish (timeout, sandbox died)")
    timed_out: bool = False
    truncated: bool = False
    duration_s: float = 0.0


class SandboxError(RuntimeError):
    """The sandbox itself failed (could not start, died); a command's own failure is an ExecResult instead."""


class Sandbox(Protocol):
    """An isolated workspace with a persistent shell. Use as `async with`."""

    async def start(self) -> None: ...

    async def run(self, command: str, timeout: float) -> ExecResult:
        """Run `command` in the persistent shell; cwd and environment persist to the next call."""
        ...

    async def write_file(self, path: str, data: bytes) -> None:
        """Write `data` at `path`, relative to the workspace or absolute under it."""
        ...

    async def read_file(self, path: str) -> bytes: ...

    async def close(self) -> None: ...

    async def __aenter__(self) -> Self: ...

    async def __aexit__(self, *exc: object) -> None: ...
