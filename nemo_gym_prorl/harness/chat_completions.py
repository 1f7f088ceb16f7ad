"""OpenAI Chat Completions over the proxy's core: ``POST /v1/chat/completions``, plain JSON or ``stream: true``.

The request becomes a `CallRequest` (text content parts joined, ``developer`` read as ``system``); the answer has
OpenAI's shape, tool calls in ``message.tool_calls`` with JSON-string arguments. A stream is the finished call sent
as server-sent chunks (role, content, one chunk per tool call, finish reason, usage when asked, ``[DONE]``): the
backend generates token-in/token-out in one request, so the harness gets its reply at once either way.

Errors have OpenAI's shape (``{"error": {"message", "type", "code"}}``): a request the proxy cannot read is a 400
naming the field; a prompt past the context window is the 400 ``context_length_exceeded`` harnesses act on; a call
past the rollout's deadline or token budget a 400 ``rollout_limit_error`` (code ``deadline`` or ``token_budget``).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from starlette.responses import Response

from nemo_gym_prorl.harness.calls import CallRequest, ModelCall
from nemo_gym_prorl.harness.wire import (
    Api,
    Failure,
    event,
    json_response,
    text_of,
    validated,
)

API = "chat.completions"
_USED = {"messages", "tools", "stream", "stream_options", "n", "max_tokens", "max_completion_tokens"}


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    name: str | None = None


class ChatCompletionRequest(BaseModel):
    """The fields the proxy acts on; every other one is kept as sent, on the call (`harness_params`)."""

    model_config = ConfigDict(extra="allow")

    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    n: Literal[1] = Field(1, description="one choice per call: a rollout's harness follows one reply")
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)


_KINDS = {
    Failure.BAD_REQUEST: "invalid_request_error",
    Failure.CONTEXT_LENGTH: "invalid_request_error",
    Failure.ROLLOUT_LIMIT: "rollout_limit_error",
    Failure.UPSTREAM: "upstream_error",
    Failure.UNAVAILABLE: "upstream_unavailable",
}


def error_response(failure: Failure, status: int, message: str, code: str | None) -> Response:
    """OpenAI's error shape (the Responses API answers with it too)."""
    return json_response({"error": {"message": message, "type": _KINDS[failure], "param": None, "code": code}}, status)


def call_request(body: Any) -> tuple[CallRequest, ChatCompletionRequest]:
    """The core's request for a Chat Completions body; `BadRequest` names what is wrong."""
    request = validated(ChatCompletionRequest, body, "chat completions request")
    messages = [_message(i, m) for i, m in enumerate(request.messages)]
    asked = request.model_dump(exclude=_USED, exclude_unset=True)
    core = CallRequest(
        api=API, messages=messages, tools=request.tools or None,
        max_tokens=request.max_completion_tokens or request.max_tokens, harness_params=asked,
    )  # fmt: skip
    return core, request


def _message(index: int, message: ChatMessage) -> dict[str, Any]:
    out = message.model_dump(exclude_none=True, include={"role", "content", "tool_calls", "tool_call_id", "name"})
    if message.role == "developer":
        out["role"] = "system"
    if isinstance(message.content, list):
        out["content"] = text_of(message.content, {"text"}, f"messages.{index}.content")
    return out


def _completion(call: ModelCall, request: ChatCompletionRequest, model: str) -> dict[str, Any]:
    prompt, generated = len(call.turn.prompt_token_ids), len(call.turn.generation_token_ids)
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "message": call.reply, "finish_reason": call.finish_reason, "logprobs": None}],
        "usage": {"prompt_tokens": prompt, "completion_tokens": generated, "total_tokens": prompt + generated},
    }


def _chunks(answer: dict[str, Any], request: ChatCompletionRequest) -> Iterator[bytes]:
    usage = bool((request.stream_options or {}).get("include_usage"))
    choice = answer["choices"][0]
    message = choice["message"]
    head = {k: answer[k] for k in ("id", "created", "model")} | {"object": "chat.completion.chunk"}

    def chunk(delta: dict[str, Any], finish: str | None = None, **extra: Any) -> bytes:
        choices = [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}]
        return event(head | {"choices": choices} | extra)

    yield chunk({"role": "assistant", "content": ""})
    if message.get("content"):
        yield chunk({"content": message["content"]})
    for i, call in enumerate(message.get("tool_calls") or ()):
        yield chunk({"tool_calls": [{"index": i, **call}]})
    yield chunk({}, choice["finish_reason"])
    if usage:
        yield event(head | {"choices": [], "usage": answer["usage"]})
    yield b"data: [DONE]\n\n"


endpoint = Api("chat completions request", call_request, _completion, _chunks, error_response).endpoint
