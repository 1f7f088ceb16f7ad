"""OpenAI Chat Completions over the proxy's core: ``POST /v1/chat/completions``, plain JSON or ``stream: true``.

The request becomes a `CallRequest` (text content parts joined, ``developer`` read as ``system``); the answer has
OpenAI's shape, tool calls in ``message.tool_calls`` with JSON-string arguments. A stream is the finished call sent
as server-sent chunks (role, content, one chunk per tool call, finish reason, usage when asked, ``[DONE]``): the
backend generates token-in/token-out in one request, so the harness gets its reply at once either way.

Errors have OpenAI's shape (``{"error": {"message", "type", "code"}}``): a request the proxy cannot read is a 400
naming the field; a prompt past the context window is the 400 ``context_length_exceeded`` harnesses act on.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, Literal

import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from nemo_gym_prorl.agent.llm_pool import LLMUnavailable
from nemo_gym_prorl.agent.turns import ContextLengthExceeded, LLMRequestError
from nemo_gym_prorl.harness.calls import CallRequest, ModelCall, ModelCalls

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


class BadRequest(ValueError):
    """A request the proxy cannot answer as sent; its message names the field."""


def _json(body: dict[str, Any], status: int = 200) -> Response:
    return Response(orjson.dumps(body), status_code=status, media_type="application/json")


def error_response(status: int, message: str, kind: str = "invalid_request_error", code: str | None = None) -> Response:
    return _json({"error": {"message": message, "type": kind, "param": None, "code": code}}, status)


def call_request(body: Any) -> tuple[CallRequest, ChatCompletionRequest]:
    """The core's request for a Chat Completions body; `BadRequest` names what is wrong."""
    try:
        request = ChatCompletionRequest.model_validate(body)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(part) for part in first["loc"]) or "body"
        raise BadRequest(f"chat completions request: {where}: {first['msg']}") from None
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
        texts = []
        for j, part in enumerate(message.content):
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise BadRequest(f"messages.{index}.content.{j}: only text parts are supported, got {part.get('type')!r}")
            texts.append(part["text"])
        out["content"] = "".join(texts)
    return out


async def endpoint(calls: ModelCalls, request: Request) -> Response:
    try:
        body = orjson.loads(await request.body())
    except orjson.JSONDecodeError as e:
        return error_response(400, f"chat completions request: the body is not JSON ({e})")
    try:
        core, chat = call_request(body)
        call = await calls.complete(core)
    except BadRequest as e:
        return error_response(400, str(e))
    except ContextLengthExceeded as e:
        return error_response(400, e.message, code="context_length_exceeded")
    except LLMRequestError as e:
        return error_response(e.status if e.status < 500 else 502, e.message, kind="upstream_error")
    except LLMUnavailable as e:
        return error_response(503, str(e), kind="upstream_unavailable")
    answer = _completion(call, body.get("model") or calls.model)
    if not chat.stream:
        return _json(answer)
    usage = bool((chat.stream_options or {}).get("include_usage"))
    return StreamingResponse(_chunks(answer, usage), media_type="text/event-stream")


def _completion(call: ModelCall, model: str) -> dict[str, Any]:
    prompt, generated = len(call.turn.prompt_token_ids), len(call.turn.generation_token_ids)
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "message": call.reply, "finish_reason": call.finish_reason, "logprobs": None}],
        "usage": {"prompt_tokens": prompt, "completion_tokens": generated, "total_tokens": prompt + generated},
    }


async def _chunks(answer: dict[str, Any], usage: bool) -> AsyncIterator[bytes]:
    choice = answer["choices"][0]
    message = choice["message"]
    head = {k: answer[k] for k in ("id", "created", "model")} | {"object": "chat.completion.chunk"}

    def chunk(delta: dict[str, Any], finish: str | None = None, **extra: Any) -> bytes:
        choices = [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}]
        return b"data: " + orjson.dumps(head | {"choices": choices} | extra) + b"\n\n"

    yield chunk({"role": "assistant", "content": ""})
    if message.get("content"):
        yield chunk({"content": message["content"]})
    for i, call in enumerate(message.get("tool_calls") or ()):
        yield chunk({"tool_calls": [{"index": i, **call}]})
    yield chunk({}, choice["finish_reason"])
    if usage:
        yield b"data: " + orjson.dumps(head | {"choices": [], "usage": answer["usage"]}) + b"\n\n"
    yield b"data: [DONE]\n\n"
