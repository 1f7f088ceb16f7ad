"""The agent's tools, by name."""

from __future__ import annotations

from nemo_gym_prorl.tools.base import Tool, ToolOutput
from nemo_gym_prorl.tools.finish import FinishTool
from nemo_gym_prorl.tools.shell import BashTool, PythonTool

_TOOLS = {"bash": BashTool, "python": PythonTool, "finish": FinishTool}


def make_tools(names: list[str], timeout_s: float) -> dict[str, Tool]:
    """The tools named in a task config; raises ValueError naming an unknown one."""
    tools: dict[str, Tool] = {}
    for name in names:
        if name not in _TOOLS:
            raise ValueError(f"unknown tool {name!r}; known: {', '.join(_TOOLS)}")
        tools[name] = _TOOLS[name]() if name == "finish" else _TOOLS[name](timeout_s)
    return tools


__all__ = ["Tool", "ToolOutput", "make_tools"]
