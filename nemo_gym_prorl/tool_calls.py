"""Tool-call formats: how a model's reply text turns into tool calls, and how tool results go back.

Models really produce three shapes, selectable per model/task config (`tool_call_format`):

- ``hermes``: Hermes/Qwen ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks in the text.
- ``openai``: the server already parsed them into ``message.tool_calls`` (chat-completions mode).
- ``codeact``: fenced ```` ```bash ```` / ```` ```python ```` blocks are actions (ProRL's agents are CodeAct);
  a reply with no block is the agent's final answer.

A format never raises on what a model wrote: problems come back as ``ParsedReply.error`` so the loop can record
them per turn and tell the model.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any, Protocol

from pydantic import BaseModel, Field

from nemo_gym_prorl.contracts.task import ToolCallFormatName

FINISH_TOOL = "finish"


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:12]}"


class ToolCall(BaseModel):
    id: str = Field(default_factory=new_call_id)
    name: str
    arguments: dict[str, Any]

    def to_openai(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": json.dumps(self.arguments, ensure_ascii=False)},
        }


class ParsedReply(BaseModel):
    """A model reply split into free text and tool calls, with a format error if it was malformed."""

    content: str
    tool_calls: list[ToolCall] = Field(default_factory=list)
    error: str | None = None
    no_call: bool = Field(False, description="the error is that the reply holds no tool call at all")
    final_answer: str | None = Field(None, description="set when the reply itself ends the episode (codeact)")


class ToolCallFormat(Protocol):
    name: ToolCallFormatName

    def parse(self, text: str) -> ParsedReply: ...

    def tool_result_message(self, call: ToolCall, output: str) -> dict[str, Any]:
        """The chat message that carries `output` of `call` back to the model."""
        ...

    def format_error_message(self, error: str) -> dict[str, Any]:
        """The chat message telling the model its reply could not be used."""
        ...


_HERMES_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


def _tool_call_from_json(raw: str) -> ToolCall:
    """One Hermes tool call body -> ToolCall; raises ValueError naming what is wrong."""
    try:
        obj = json.loads(raw)
    except json.JSONDecodeError as e:
        raise ValueError(f"malformed tool call JSON ({e.msg} at char {e.pos}): {raw[:200]!r}") from None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        raise ValueError(f'a tool call must be an object with a string "name": {raw[:200]!r}')
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            raise ValueError(f'tool call "arguments" is a string that is not JSON: {args[:200]!r}') from None
    if not isinstance(args, dict):
        raise ValueError(f'tool call "arguments" must be an object, got {type(args).__name__}')
    return ToolCall(name=obj["name"], arguments=args)


def parse_hermes(text: str) -> ParsedReply:
    calls: list[ToolCall] = []
    errors: list[str] = []
    for match in _HERMES_BLOCK.finditer(text):
        try:
            calls.append(_tool_call_from_json(match.group(1)))
        except ValueError as e:
            errors.append(str(e))
    content = _HERMES_BLOCK.sub("", text).strip()
    if errors:
        return ParsedReply(content=content, tool_calls=calls, error="; ".join(errors))
    if not calls:
        return ParsedReply(
            content=content, error="no tool call: call a tool with <tool_call>{...}</tool_call>", no_call=True
        )
    return ParsedReply(content=content, tool_calls=calls)


def parse_openai_tool_calls(message: dict[str, Any]) -> ParsedReply:
    """Tool calls a chat-completions server already parsed (``message.tool_calls``)."""
    content = message.get("content") or ""
    calls: list[ToolCall] = []
    errors: list[str] = []
    for raw in message.get("tool_calls") or []:
        fn = raw.get("function") or {}
        try:
            args = json.loads(fn.get("arguments") or "{}")
            if not isinstance(args, dict):
                raise ValueError("arguments must be a JSON object")
            calls.append(ToolCall(id=raw.get("id") or new_call_id(), name=fn["name"], arguments=args))
        except (ValueError, KeyError, TypeError) as e:
            errors.append(f"malformed tool call {raw!r}: {e}")
    if errors:
        return ParsedReply(content=content, tool_calls=calls, error="; ".join(errors))
    if not calls:
        return ParsedReply(content=content, error="no tool call", no_call=True)
    return ParsedReply(content=content, tool_calls=calls)


class HermesFormat:
    """``<tool_call>`` JSON blocks; results go back as ``tool`` messages (rendered by the chat template)."""

    name: ToolCallFormatName = "hermes"

    def parse(self, text: str) -> ParsedReply:
        return parse_hermes(text)

    def tool_result_message(self, call: ToolCall, output: str) -> dict[str, Any]:
        return {"role": "tool", "tool_call_id": call.id, "name": call.name, "content": output}

    def format_error_message(self, error: str) -> dict[str, Any]:
        return {"role": "user", "content": f"Your last reply could not be used: {error}"}


class OpenAIFormat(HermesFormat):
    """Same messages as Hermes; the text parse is Hermes (our own server and vLLM's hermes parser agree)."""

    name: ToolCallFormatName = "openai"


_CODE_BLOCK = re.compile(r"```[ \t]*(bash|sh|shell|python|py|python3)[ \t]*\n(.*?)(?:```|$)", re.DOTALL)
_CODE_TOOLS = {"bash": "bash", "sh": "bash", "shell": "bash", "python": "python", "py": "python", "python3": "python"}
_CODE_ARG = {"bash": "command", "python": "code"}


class CodeActFormat:
    """Fenced code blocks are actions; a reply without one is the final answer."""

    name: ToolCallFormatName = "codeact"

    def parse(self, text: str) -> ParsedReply:
        calls = []
        for lang, body in _CODE_BLOCK.findall(text):
            tool = _CODE_TOOLS[lang]
            if body.strip():
                calls.append(ToolCall(name=tool, arguments={_CODE_ARG[tool]: body.rstrip()}))
        content = _CODE_BLOCK.sub("", text).strip()
        if not calls:
            return ParsedReply(content=content, final_answer=text.strip())
        return ParsedReply(content=content, tool_calls=calls)

    def tool_result_message(self, call: ToolCall, output: str) -> dict[str, Any]:
        return {"role": "user", "content": f"Observation ({call.name}):\n{output}"}

    def format_error_message(self, error: str) -> dict[str, Any]:
        return {"role": "user", "content": f"Your last reply could not be used: {error}"}


_FORMATS: dict[str, type[HermesFormat] | type[CodeActFormat]] = {
    "hermes": HermesFormat,
    "openai": OpenAIFormat,
    "codeact": CodeActFormat,
}


def tool_call_format(name: str) -> ToolCallFormat:
    try:
        return _FORMATS[name]()
    except KeyError:
        raise ValueError(f"unknown tool_call_format {name!r}; known: {', '.join(_FORMATS)}") from None


def hermes_tools_system_prompt(tools: list[dict[str, Any]]) -> str:
    """Tool definitions as a system prompt, for chat templates that do not render ``tools`` themselves."""
    specs = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return (
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n"
        f"<tools>\n{specs}\n</tools>\n\n"
        "For each function call, return a json object with function name and arguments within "
        "<tool_call></tool_call> XML tags:\n"
        '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    )
