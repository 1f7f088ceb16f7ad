"""Anthropic's Messages API over the proxy's core: ``POST /v1/messages``, plain JSON or ``stream: true`` (Claude Code
and other Anthropic-client harnesses, ``ANTHROPIC_BASE_URL`` pointing at the proxy).

``system`` (a string or text blocks) becomes the system message; a message's content (a string or blocks) becomes
chat messages: ``text`` blocks joined, an assistant's ``tool_use`` blocks its OpenAI tool calls (``input`` as JSON
arguments), a user's ``tool_result`` blocks tool messages (before the user's own text, as Anthropic orders them);
``thinking`` blocks are dropped (the proxy's replies carry none). Tools (``name``, ``description``,
``input_schema``) become OpenAI function tools; ``max_tokens`` (required) caps the trainer's. The reply is a
``text`` block and one ``tool_use`` block per tool call, ``stop_reason`` ``end_turn``/``tool_use``/``max_tokens``.
A stream is the finished call as Anthropic's events (``message_start``, ``content_block_start``/``_delta``/
``_stop`` per block, ``message_delta``, ``message_stop``). Errors have Anthropic's shape
(``{"type": "error", "error": {"type", "message"}}``), no backend the 529 ``overloaded_error``.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from starlette.responses import Response

from nemo_gym_prorl.harness.calls import CallRequest, ModelCall
from nemo_gym_prorl.harness.wire import (
    Api,
    BadRequest,
    Failure,
    event,
    json_response,
    text_of,
    validated,
)

API = "messages"
_USED = {"messages", "system", "tools", "stream", "max_tokens"}
_STOP = {"tool_calls": "tool_use", "length": "max_tokens"}
_ERRORS = {
    Failure.BAD_REQUEST: (None, "invalid_request_error"),
    Failure.CONTEXT_LENGTH: (None, "invalid_request_error"),
    Failure.ROLLOUT_LIMIT: (None, "invalid_request_error"),
    Failure.UPSTREAM: (None, "api_error"),
    Failure.UNAVAILABLE: (529, "overloaded_error"),
}


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]


class MessagesRequest(BaseModel):
    """The fields the proxy acts on; every other one is kept as sent, on the call (`harness_params`)."""

    model_config = ConfigDict(extra="allow")

    messages: list[Message] = Field(min_length=1)
    max_tokens: int = Field(ge=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    stream: bool = False


def error_response(failure: Failure, status: int, message: str, code: str | None) -> Response:
    override, kind = _ERRORS[failure]
    return json_response({"type": "error", "error": {"type": kind, "message": message}}, override or status)


def call_request(body: Any) -> tuple[CallRequest, MessagesRequest]:
    """The core's request for a Messages body; `BadRequest` names what is wrong."""
    request = validated(MessagesRequest, body, "messages request")
    system = text_of(request.system, {"text"}, "system")
    messages = [{"role": "system", "content": system}] if system else []
    for i, message in enumerate(request.messages):
        messages += _chat_messages(message, f"messages.{i}.content")
    tools = []
    for i, tool in enumerate(request.tools or ()):
        if not isinstance(tool.get("name"), str) or not isinstance(tool.get("input_schema"), dict):
            raise BadRequest(f"messages request: tools.{i}: expected a name and an input_schema object")
        function = {"name": tool["name"], "description": tool.get("description", ""), "parameters": tool["input_schema"]}
        tools.append({"type": "function", "function": function})
    asked = request.model_dump(exclude=_USED, exclude_unset=True)
    core = CallRequest(api=API, messages=messages, tools=tools or None, max_tokens=request.max_tokens, harness_params=asked)
    return core, request


def _chat_messages(message: Message, where: str) -> list[dict[str, Any]]:
    if isinstance(message.content, str):
        return [{"role": message.role, "content": message.content}]
    texts, calls, results = [], [], []
    for j, block in enumerate(message.content):
        kind = block.get("type")
        if kind == "text":
            texts.append(block)
        elif kind == "tool_use" and message.role == "assistant":
            arguments = json.dumps(block.get("input") or {})
            calls.append({"id": block.get("id"), "type": "function", "function": {"name": block.get("name"), "arguments": arguments}})
        elif kind == "tool_result" and message.role == "user":
            content = text_of(block.get("content"), {"text"}, f"{where}.{j}.content")
            results.append({"role": "tool", "tool_call_id": block.get("tool_use_id"), "content": content})
        elif kind not in {"thinking", "redacted_thinking"}:
            raise BadRequest(f"messages request: {where}.{j}.type: {kind!r} is not supported in a {message.role} message")
    text = text_of(texts, {"text"}, where)
    if message.role == "assistant":
        return [{"role": "assistant", "content": text or None} | ({"tool_calls": calls} if calls else {})]
    return results + ([{"role": "user", "content": text}] if text or not results else [])


def _message(call: ModelCall, request: MessagesRequest, model: str) -> dict[str, Any]:
    content: list[dict[str, Any]] = []
    if call.reply.get("content"):
        content.append({"type": "text", "text": call.reply["content"]})
    for tool_call in call.reply.get("tool_calls") or ():
        function = tool_call["function"]
        content.append({"type": "tool_use", "id": tool_call["id"], "name": function["name"], "input": json.loads(function["arguments"])})
    return {
        "id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant", "model": model, "content": content,
        "stop_reason": _STOP.get(call.finish_reason, "end_turn"), "stop_sequence": None,
        "usage": {"input_tokens": len(call.turn.prompt_token_ids), "output_tokens": len(call.turn.generation_token_ids)},
    }  # fmt: skip


def _events(message: dict[str, Any], request: MessagesRequest) -> Iterator[bytes]:
    def sent(kind: str, **data: Any) -> bytes:
        return event({"type": kind, **data}, kind)

    usage = message["usage"]
    started = message | {"content": [], "stop_reason": None, "usage": usage | {"output_tokens": 0}}
    yield sent("message_start", message=started)
    for index, block in enumerate(message["content"]):
        if block["type"] == "text":
            yield sent("content_block_start", index=index, content_block={"type": "text", "text": ""})
            delta = {"type": "text_delta", "text": block["text"]}
        else:
            yield sent("content_block_start", index=index, content_block=block | {"input": {}})
            delta = {"type": "input_json_delta", "partial_json": json.dumps(block["input"])}
        yield sent("content_block_delta", index=index, delta=delta)
        yield sent("content_block_stop", index=index)
    stop = {"stop_reason": message["stop_reason"], "stop_sequence": None}
    yield sent("message_delta", delta=stop, usage={"output_tokens": usage["output_tokens"]})
    yield sent("message_stop")


endpoint = Api("messages request", call_request, _message, _events, error_response).endpoint
