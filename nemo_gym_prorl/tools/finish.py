"""`finish`: the agent submits its final answer and the episode ends."""

from __future__ import annotations

from typing import Any

from nemo_gym_prorl.contracts.sandbox import WORKSPACE, Sandbox
from nemo_gym_prorl.tools.base import ToolOutput, function_schema


class FinishTool:
    name = "finish"

    def schema(self, workspace: str = WORKSPACE) -> dict[str, Any]:
        return function_schema(
            "finish",
            "Submit your final answer and end the task.",
            {"answer": {"type": "string", "description": "the final answer"}},
            ["answer"],
        )

    async def __call__(self, sandbox: Sandbox, arguments: dict[str, Any]) -> ToolOutput:
        answer = arguments.get("answer")
        if answer is None:
            return ToolOutput(text='finish: argument "answer" is required')
        return ToolOutput(text="Answer submitted.", finished=True, answer=str(answer))
