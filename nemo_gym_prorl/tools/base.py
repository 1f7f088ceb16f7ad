"""The tool contract: an OpenAI function schema plus an async implementation over a sandbox.

Tools never raise for what the model asked: a bad argument, a failed command or a path outside the workspace
comes back as text the model can read, so one sloppy call never ends a rollout. Only `SandboxError` (the sandbox
itself is gone) propagates: the rollout cannot go on, and the orchestrator records it as a `run` failure.

A tool object holds no per-rollout state of its own: one instance serves every sandbox of an environment, so
state that belongs to a sandbox (the editor's undo history, the Python interpreter) is keyed by the sandbox.
"""

from __future__ import annotations

from typing import Any, Protocol

from pydantic import BaseModel

from nemo_gym_prorl.contracts.sandbox import WORKSPACE, Sandbox, SandboxSpec


class ToolOutput(BaseModel):
    text: str
    finished: bool = False
    answer: str | None = None


class Tool(Protocol):
    name: str

    def schema(self, workspace: str = WORKSPACE) -> dict[str, Any]:
        """The OpenAI function-tool definition the model sees, for sandboxes whose workspace is at `workspace`
        (its description may name paths there: an SWE task's is /testbed, not /workspace)."""
        ...

    async def __call__(self, sandbox: Sandbox, arguments: dict[str, Any]) -> ToolOutput: ...


def function_schema(name: str, description: str, properties: dict[str, Any], required: list[str]) -> dict[str, Any]:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {"type": "object", "properties": properties, "required": required},
        },
    }


def string_argument(arguments: dict[str, Any], key: str) -> str:
    """The string argument `key`, or ValueError with a message meant for the model."""
    value = arguments.get(key)
    if not isinstance(value, str):
        got = "nothing" if value is None else type(value).__name__
        raise ValueError(f'argument "{key}" (a string) is required, got {got}')
    return value


def workspace_dir(sandbox: Sandbox) -> str:
    """The workspace as commands inside `sandbox` see it.

    Our own backends mount it at their spec's `workspace` (/workspace unless set). A sandbox over a NeMo Gym provider
    keeps it wherever that provider puts its working directory (the host's temp dir, for Gym's `local`) and says so
    in its `workdir` attribute.
    """
    workdir = getattr(sandbox, "workdir", None)
    if isinstance(workdir, str) and workdir.startswith("/"):
        return workdir
    spec = getattr(sandbox, "spec", None)
    return spec.workspace if isinstance(spec, SandboxSpec) else WORKSPACE
