"""The answer an agent submitted, read from its Gym response: the `finish` call's answer, else its last words."""

from __future__ import annotations

import json
from typing import Any, Literal

from nemo_gym_prorl.tool_calls import FINISH_TOOL

AnswerSource = Literal["finish", "message", "none"]


def submitted_answer(response: Any) -> tuple[str | None, AnswerSource]:
    """The `answer` of the last well-formed `finish` call in `response.output`, else the text of the final
    assistant message, else None."""
    for item in reversed(response.output):
        if item.type == "function_call" and item.name == FINISH_TOOL:
            try:
                arguments = json.loads(item.arguments)
            except (json.JSONDecodeError, TypeError):
                continue
            if isinstance(arguments, dict) and arguments.get("answer") is not None:
                return str(arguments["answer"]), "finish"
    for item in reversed(response.output):
        if item.type == "message" and item.role == "assistant":
            text = "".join(part.text for part in item.content if part.type == "output_text")
            return text, "message"
    return None, "none"
