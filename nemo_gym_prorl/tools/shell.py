"""`bash` and `python`: run code in the sandbox's persistent shell."""

from __future__ import annotations

import itertools
from typing import Any

from nemo_gym_prorl.sandbox.base import WORKSPACE, ExecResult, Sandbox
from nemo_gym_prorl.tools.base import ToolOutput, function_schema, string_argument


def describe_result(result: ExecResult, timeout: float) -> str:
    """Command output as the model should see it: the output, then why it stopped when that is not success."""
    text = result.output
    if result.timed_out:
        text += f"\n[command timed out after {timeout:g} s and was interrupted]"
    elif result.exit_code not in (0, None):
        text += f"\n[exit code {result.exit_code}]"
    return text


class BashTool:
    name = "bash"

    def __init__(self, timeout_s: float = 30.0) -> None:
        self.timeout_s = timeout_s

    def schema(self) -> dict[str, Any]:
        return function_schema(
            "bash",
            "Run a bash command in a persistent shell (cwd and environment persist). Returns its output.",
            {"command": {"type": "string", "description": "the command to run"}},
            ["command"],
        )

    async def __call__(self, sandbox: Sandbox, arguments: dict[str, Any]) -> ToolOutput:
        try:
            command = string_argument(arguments, "command")
        except ValueError as e:
            return ToolOutput(text=f"bash: {e}")
        result = await sandbox.run(command, timeout=self.timeout_s)
        return ToolOutput(text=describe_result(result, self.timeout_s))


class PythonTool:
    """Runs a Python program in the sandbox (the sandbox's own python3); prints are its output."""

    name = "python"

    def __init__(self, timeout_s: float = 30.0) -> None:
        self.timeout_s = timeout_s
        self._cells = itertools.count()

    def schema(self) -> dict[str, Any]:
        return function_schema(
            "python",
            "Run a Python 3 program and return what it prints. Use print() to see values.",
            {"code": {"type": "string", "description": "the Python source to run"}},
            ["code"],
        )

    async def __call__(self, sandbox: Sandbox, arguments: dict[str, Any]) -> ToolOutput:
        try:
            code = string_argument(arguments, "code")
        except ValueError as e:
            return ToolOutput(text=f"python: {e}")
        path = f"{WORKSPACE}/.prorl/cell_{next(self._cells)}.py"
        await sandbox.write_file(path, code.encode())
        result = await sandbox.run(f"python3 {path}", timeout=self.timeout_s)
        return ToolOutput(text=describe_result(result, self.timeout_s))
