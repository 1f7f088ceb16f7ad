"""OpenAI's Responses API over the proxy's core: ``POST /v1/responses``, plain JSON or ``stream: true`` (Codex CLI).

``instructions`` become the system message and ``input`` (a string, or items) the chat messages: ``message`` items
(``input_text``/``output_text`` parts; ``developer`` read as ``system``), ``function_call`` items joined onto the
assistant message before them as its tool calls, ``function_call_output`` items as tool messages; ``reasoning``
items are dropped (the proxy's replies carry none). Function tools (``{"type": "function", "name", "parameters"}``)
become OpenAI function tools; other tool types (web search, ...) are left out and named in ``harness_params``.
The reply is a ``message`` output item and one ``function_call`` item per tool call. Nothing is stored: Codex sends
``store: false`` and its whole input every call, so ``previous_response_id`` is a 400. A stream is the finished
call as Responses events (``response.created`` ... ``response.output_text.delta`` ...
``response.function_call_arguments.done`` ... ``response.completed``). Errors have OpenAI's shape.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from nemo_gym_prorl.harness.calls import CallRequest, ModelCall
from nemo_gym_prorl.harness.chat_completions import error_response
from nemo_gym_prorl.harness.wire import (
    Api,
    BadRequest,
    event,
    text_of,
    validated,
)

API = "responses"
_USED = {"input", "instructions", "tools", "stream", "max_output_tokens", "previous_response_id"}
_TEXT = {"input_text", "output_text", "text"}


class ResponsesRequest(BaseModel):
    """The fields the proxy acts on; every other one is kept as sent, on the call (`harness_params`)."""

    model_config = ConfigDict(extra="allow")

    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    stream: bool = False
    max_output_tokens: int | None = Field(None, ge=1)
    previous_response_id: str | None = None


def call_request(body: Any) -> tuple[CallRequest, ResponsesRequest]:
    """The core's request for a Responses body; `BadRequest` names what is wrong."""
    request = validated(ResponsesRequest, body, "responses request")
    if request.previous_response_id is not None:
        raise BadRequest("responses request: previous_response_id: not supported, nothing is stored; send the whole input")
    messages = [{"role": "system", "content": request.instructions}] if request.instructions else []
    if isinstance(request.input, str):
        messages.append({"role": "user", "content": request.input})
    else:
        for i, item in enumerate(request.input):
            _add_item(messages, item, f"input.{i}")
    if not messages:
        raise BadRequest("responses request: input: no messages")
    tools, other = [], []
    for tool in request.tools or ():
        if tool.get("type") == "function" and isinstance(tool.get("name"), str):
            function = {k: tool[k] for k in ("name", "description", "parameters") if k in tool}
            tools.append({"type": "function", "function": function})
        else:
            other.append(tool.get("type"))
    asked = request.model_dump(exclude=_USED, exclude_unset=True) | ({"unserved_tools": other} if other else {})
    core = CallRequest(
        api=API, messages=messages, tools=tools or None, max_tokens=request.max_output_tokens, harness_params=asked
    )
    return core, request


def _add_item(messages: list[dict[str, Any]], item: dict[str, Any], where: str) -> None:
    kind = item.get("type", "message" if "role" in item else None)
    if kind == "message":
        role = {"developer": "system"}.get(item.get("role"), item.get("role"))
        if role not in {"system", "user", "assistant"}:
            raise BadRequest(f"responses request: {where}.role: expected user, assistant, system or developer")
        messages.append({"role": role, "content": text_of(item.get("content"), _TEXT, f"{where}.content")})
    elif kind == "function_call":
        call = {"id": item.get("call_id"), "type": "function"}
        call["function"] = {"name": item.get("name"), "arguments": item.get("arguments") or "{}"}
        if not messages or messages[-1]["role"] != "assistant":  # else: the text the model wrote before its calls
            messages.append({"role": "assistant", "content": None})
        messages[-1].setdefault("tool_calls", []).append(call)
    elif kind == "function_call_output":
        output = item.get("output")
        content = output if isinstance(output, str) else text_of(output, _TEXT, f"{where}.output")
        messages.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": content})
    elif kind != "reasoning":
        raise BadRequest(
            f"responses request: {where}.type: expected message, function_call, function_call_output or reasoning, "
            f"got {kind!r}"
        )


def _response(call: ModelCall, request: ResponsesRequest, model: str) -> dict[str, Any]:
    output: list[dict[str, Any]] = []
    if call.reply.get("content"):
        part = {"type": "output_text", "text": call.reply["content"], "annotations": []}
        output.append({"type": "message", "id": f"msg_{uuid.uuid4().hex}", "role": "assistant", "content": [part]})
    for tool_call in call.reply.get("tool_calls") or ():
        function = tool_call["function"]
        output.append({
            "type": "function_call", "id": f"fc_{uuid.uuid4().hex}", "call_id": tool_call["id"],
            "name": function["name"], "arguments": function["arguments"],
        })  # fmt: skip
    for item in output:
        item["status"] = "completed"
    prompt, generated = len(call.turn.prompt_token_ids), len(call.turn.generation_token_ids)
    cut = call.finish_reason == "length"
    return {
        "id": f"resp_{uuid.uuid4().hex}", "object": "response", "created_at": int(time.time()), "model": model,
        "status": "incomplete" if cut else "completed",
        "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
        "error": None, "instructions": request.instructions, "output": output, "tools": request.tools or [],
        "tool_choice": "auto", "parallel_tool_calls": True, "temperature": call.sampling.temperature,
        "top_p": call.sampling.top_p, "max_output_tokens": call.sampling.max_tokens, "metadata": {},
        "usage": {
            "input_tokens": prompt, "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": generated, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt + generated,
        },
    }  # fmt: skip


def _events(response: dict[str, Any], request: ResponsesRequest) -> Iterator[bytes]:
    numbers = iter(range(1 << 30))

    def sent(kind: str, **data: Any) -> bytes:
        return event({"type": kind, "sequence_number": next(numbers), **data}, kind)

    started = response | {"status": "in_progress", "output": [], "usage": None, "incomplete_details": None}
    yield sent("response.created", response=started)
    yield sent("response.in_progress", response=started)
    for index, item in enumerate(response["output"]):
        where = {"item_id": item["id"], "output_index": index}
        if item["type"] == "message":
            text = item["content"][0]["text"]
            empty = {"type": "output_text", "text": "", "annotations": []}
            yield sent("response.output_item.added", output_index=index, item=item | {"status": "in_progress", "content": []})
            yield sent("response.content_part.added", **where, content_index=0, part=empty)
            yield sent("response.output_text.delta", **where, content_index=0, delta=text, logprobs=[])
            yield sent("response.output_text.done", **where, content_index=0, text=text, logprobs=[])
            yield sent("response.content_part.done", **where, content_index=0, part=item["content"][0])
        else:
            yield sent("response.output_item.added", output_index=index, item=item | {"status": "in_progress", "arguments": ""})
            yield sent("response.function_call_arguments.delta", **where, delta=item["arguments"])
            yield sent("response.function_call_arguments.done", **where, name=item["name"], arguments=item["arguments"])
        yield sent("response.output_item.done", output_index=index, item=item)
    kind: Literal["response.completed", "response.incomplete"] = (
        "response.completed" if response["status"] == "completed" else "response.incomplete"
    )
    yield sent(kind, response=response)


endpoint = Api("responses request", call_request, _response, _events, error_response).endpoint
