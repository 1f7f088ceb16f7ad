"""The tool contract: an OpenAI function schema plus an async implementation over a sandbox.

Tools never raise for what the model asked: a bad argument or a failed command comes back as text the model can
read, so one sloppy call never ends a rollout.
"""

from __future__ import annotations

from typing import Any, Protocol

from pydantic import BaseModel

from nemo_gym_prorl.sandbox.base import Sandbox


class ToolOutput(BaseModel):
    text: str
    finished: bool = False
    answer: str | None = None


class Tool(Protocol):
    name: str

    def schema(self) -> dict[str, Any]:
        """The OpenAI function-tool definition the model sees."""
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
        raise ValueError(f'argument "{key}" (a string) is required, got {type(value).__name__}')
    return value
