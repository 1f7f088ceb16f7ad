"""The agent's tools, by the names task configs use: bash, python, str_replace_editor, finish."""

from __future__ import annotations

from collections.abc import Callable

from nemo_gym_prorl.tools.base import Tool, ToolOutput
from nemo_gym_prorl.tools.bash import BashTool
from nemo_gym_prorl.tools.editor import EditorTool
from nemo_gym_prorl.tools.finish import FinishTool
from nemo_gym_prorl.tools.python import PythonTool

_TOOLS: dict[str, Callable[[float], Tool]] = {
    "bash": BashTool,
    "python": PythonTool,
    "str_replace_editor": EditorTool,
    "finish": lambda timeout_s: FinishTool(),
}


def make_tools(names: list[str], timeout_s: float) -> dict[str, Tool]:
    """The tools named in a task config, each with `timeout_s` per call; raises ValueError naming an unknown one."""
    tools: dict[str, Tool] = {}
    for name in names:
        if name not in _TOOLS:
            raise ValueError(f"unknown tool {name!r}; known: {', '.join(_TOOLS)}")
        tools[name] = _TOOLS[name](timeout_s)
    return tools


__all__ = ["BashTool", "EditorTool", "FinishTool", "PythonTool", "Tool", "ToolOutput", "make_tools"]
