"""`bash`: run a command in the sandbox's persistent shell (cwd, variables and functions survive between calls)."""

from __future__ import annotations

from typing import Any

from nemo_gym_prorl.contracts.sandbox import WORKSPACE, ExecResult, Sandbox, with_note
from nemo_gym_prorl.tools.base import ToolOutput, function_schema, string_argument


def describe_result(result: ExecResult, timeout: float) -> str:
    """Command output as the model should see it: the output, then why it stopped when that is not success.

    A backend that interrupted a command usually says how in the output itself (the PTY shell does: Ctrl-C, or a
    restarted shell); a note is added only when it did not.
    """
    text = result.output
    if result.timed_out:
        if "timed out" not in text[-500:]:
            text = with_note(text, f"[command timed out after {timeout:g}s]")
    elif result.exit_code not in (0, None):
        text = with_note(text, f"[exit code {result.exit_code}]")
    return text


class BashTool:
    name = "bash"

    def __init__(self, timeout_s: float = 30.0) -> None:
        self.timeout_s = timeout_s

    def schema(self, workspace: str = WORKSPACE) -> dict[str, Any]:
        return function_schema(
            "bash",
            "Run a bash command in a persistent shell (cwd, variables and functions persist between calls) and "
            f"return its output (stdout and stderr). A command still running after {self.timeout_s:g}s is "
            "interrupted; the shell survives. Do not start interactive programs.",
            {"command": {"type": "string", "description": "the command to run; several lines are allowed"}},
            ["command"],
        )

    async def __call__(self, sandbox: Sandbox, arguments: dict[str, Any]) -> ToolOutput:
        try:
            command = string_argument(arguments, "command")
        except ValueError as e:
            return ToolOutput(text=f"bash: {e}")
        if not command.strip():
            return ToolOutput(text='bash: argument "command" is empty')
        result = await sandbox.run(command, timeout=self.timeout_s)
        return ToolOutput(text=describe_result(result, self.timeout_s))
