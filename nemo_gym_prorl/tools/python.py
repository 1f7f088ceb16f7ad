"""`python`: a persistent Python interpreter inside the sandbox, like a notebook kernel.

Variables, functions and imports survive from one call to the next. A cell still running after the timeout gets
KeyboardInterrupt and the interpreter lives on; a cell that ignores it is killed with its interpreter, and the next
call starts a fresh one and says so. The interpreter (`_python_repl.py`) is copied into the workspace's hidden
`.prorl/python/` and driven from the sandbox's persistent shell, so it dies with the sandbox.

Design notes: docs/sandboxes.md#toolspythonpy
"""

from __future__ import annotations

import json
import secrets
import shlex
import weakref
from functools import cache
from pathlib import Path
from typing import Any

from nemo_gym_prorl.contracts.sandbox import WORKSPACE, Sandbox
from nemo_gym_prorl.tools.base import ToolOutput, function_schema, string_argument, workspace_dir

STATE_DIR = ".prorl/python"
"""Where the interpreter's program, socket, pid file and output live, relative to the workspace."""

_PROGRAM_NAME = "repl.py"
_RUN_MARGIN_S = 15.0  # on top of timeout + grace: the client's own start-up and the interpreter's


@cache
def _program() -> bytes:
    return (Path(__file__).parent / "_python_repl.py").read_bytes()


class PythonTool:
    name = "python"

    def __init__(
        self, timeout_s: float = 30.0, *, interrupt_grace_s: float = 2.0, max_output_bytes: int = 32_000
    ) -> None:
        self.timeout_s = timeout_s
        self.interrupt_grace_s = interrupt_grace_s
        self.max_output_bytes = max_output_bytes
        self._installed: weakref.WeakKeyDictionary[Sandbox, bool] = weakref.WeakKeyDictionary()

    def schema(self, workspace: str = WORKSPACE) -> dict[str, Any]:
        return function_schema(
            "python",
            "Run Python 3 code in a persistent interpreter (like a notebook: variables, functions and imports "
            "persist between calls). Returns everything printed, the value of a last expression, and tracebacks. "
            f"Code still running after {self.timeout_s:g}s is interrupted with KeyboardInterrupt.",
            {"code": {"type": "string", "description": "the Python code to run"}},
            ["code"],
        )

    async def __call__(self, sandbox: Sandbox, arguments: dict[str, Any]) -> ToolOutput:
        try:
            code = string_argument(arguments, "code")
        except ValueError as e:
            return ToolOutput(text=f"python: {e}")
        try:
            return await self._run_cell(sandbox, code, reinstall=False)
        except (OSError, ValueError) as e:  # the workspace refused a file (full disk, a path swapped by the agent)
            return ToolOutput(text=f"python: could not run the code: {type(e).__name__}: {e}")

    async def _run_cell(self, sandbox: Sandbox, code: str, reinstall: bool) -> ToolOutput:
        if reinstall or not self._installed.get(sandbox):
            await sandbox.write_file(f"{STATE_DIR}/{_PROGRAM_NAME}", _program())
            self._installed[sandbox] = True
        cell = f"cell-{secrets.token_hex(8)}.py"
        await sandbox.write_file(f"{STATE_DIR}/{cell}", code.encode("utf-8", "replace"))
        tag = f"PRORL-PYTHON-{secrets.token_hex(8)}"
        program = f"{workspace_dir(sandbox)}/{STATE_DIR}/{_PROGRAM_NAME}"
        command = " ".join(
            [
                "command python3",
                shlex.quote(program),
                "call",
                cell,
                f"--timeout {self.timeout_s:g}",
                f"--grace {self.interrupt_grace_s:g}",
                f"--max-output {self.max_output_bytes}",
                f"--tag {tag}",
            ]
        )
        result = await sandbox.run(command, timeout=self.timeout_s + self.interrupt_grace_s + _RUN_MARGIN_S)
        start = result.output.find(f'{tag} {{"status"')  # not the command line itself, should `set -x` echo it
        if start < 0:
            if not reinstall and result.exit_code == 2 and "can't open file" in result.output:
                return await self._run_cell(sandbox, code, reinstall=True)  # the agent removed the program
            if result.timed_out:
                return ToolOutput(text=f"python: the sandbox's shell did not answer in time:\n{result.output}")
            return ToolOutput(text=f"python: the interpreter could not be run in the sandbox:\n{result.output}")
        header, _, text = result.output[start + len(tag) + 1 :].partition("\n")
        try:
            status = json.loads(header).get("status")
        except ValueError:
            status = None
        if status == "tool-error":
            return ToolOutput(text=f"python: {text}")
        return ToolOutput(text=text)
