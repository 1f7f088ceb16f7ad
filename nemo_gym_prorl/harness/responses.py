"""OpenAI's Responses API over the proxy's core: ``POST /v1/responses``, plain JSON or ``stream: true`` (Codex CLI).

``instructions`` become the system message and ``input`` (a string, or items) the chat messages: ``message`` items
(``input_text``/``output_text`` parts; ``developer`` read as ``system``), ``function_call``/``custom_tool_call`` items
joined onto the assistant message before them as its tool calls, their ``*_output`` items as tool messages;
``reasoning`` items are dropped (the proxy's replies carry none). Function tools, custom (freeform) tools as a
function of one string ``input``, and the tools of a ``namespace`` become OpenAI function tools; other tool types
(web search, ...) are left out and named in ``harness_params``. The reply is a ``message`` item and a call item per
tool call in its tool's kind (with its namespace). Nothing is stored: Codex sends ``store: false`` and its whole
input every call, so ``previous_response_id`` is a 400. A stream is the finished call as Responses events
(``response.created`` ... ``response.output_text.delta`` ... ``response.completed``). Errors have OpenAI's shape.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from typing import Any, Literal, NamedTuple

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
    tools, other = served_tools(request.tools or ())
    asked = request.model_dump(exclude=_USED, exclude_unset=True) | ({"unserved_tools": other} if other else {})
    functions = [{"type": "function", "function": tool.function} for tool in tools.values()]
    core = CallRequest(
        api=API, messages=messages, tools=functions or None, max_tokens=request.max_output_tokens, harness_params=asked
    )
    return core, request


class Served(NamedTuple):
    """A Responses tool as the model sees it: an OpenAI function, and what its calls go back as."""

    function: dict[str, Any]
    custom: bool  # a freeform tool: its call's `input` is the function's one string argument
    namespace: str | None


def served_tools(tools: Any) -> tuple[dict[str, Served], list[str]]:
    """The function, custom and namespaced tools by the name the model calls them, and what is left out: other
    tool types (web search, ...) by their type, a name offered twice by its second offer."""
    served: dict[str, Served] = {}
    other: list[str] = []
    for tool in tools:
        namespaced = tool.get("type") == "namespace"
        for member in tool.get("tools") or () if namespaced else (tool,):
            kind, name = member.get("type"), member.get("name")
            if kind not in {"function", "custom"} or not isinstance(name, str) or name in served:
                left_out = name if kind in {"function", "custom"} else kind
                other.append(f"{tool.get('name')}.{left_out}" if namespaced else str(left_out))
                continue
            function = {k: member[k] for k in ("name", "description", "parameters") if k in member}
            if kind == "custom":
                function |= {"description": _freeform(member), "parameters": _INPUT}
            served[name] = Served(function, kind == "custom", tool.get("name") if namespaced else None)
    return served, other


_INPUT = {"type": "object", "properties": {"input": {"type": "string"}}, "required": ["input"]}


def _freeform(tool: dict[str, Any]) -> str:
    """A custom tool's description, with the grammar its input follows when it names one."""
    text, form = tool.get("description") or "", tool.get("format") or {}
    if form.get("type") == "grammar" and form.get("definition"):
        text += f"\n\nThe input follows this {form.get('syntax', '')} grammar:\n{form['definition']}"
    return text.strip()


def _add_item(messages: list[dict[str, Any]], item: dict[str, Any], where: str) -> None:
    kind = item.get("type", "message" if "role" in item else None)
    if kind == "message":
        role = {"developer": "system"}.get(item.get("role"), item.get("role"))
        if role not in {"system", "user", "assistant"}:
            raise BadRequest(f"responses request: {where}.role: expected user, assistant, system or developer")
        messages.append({"role": role, "content": text_of(item.get("content"), _TEXT, f"{where}.content")})
    elif kind in {"function_call", "custom_tool_call"}:
        custom = kind == "custom_tool_call"  # its `input` is the one argument of the function the model saw
        arguments = json.dumps({"input": item.get("input")}) if custom else (item.get("arguments") or "{}")
        call = {"id": item.get("call_id"), "type": "function"}
        call["function"] = {"name": item.get("name"), "arguments": arguments}
        if not messages or messages[-1]["role"] != "assistant":  # else: the text the model wrote before its calls
            messages.append({"role": "assistant", "content": None})
        messages[-1].setdefault("tool_calls", []).append(call)
    elif kind in {"function_call_output", "custom_tool_call_output"}:
        output = item.get("output")
        content = output if isinstance(output, str) else text_of(output, _TEXT, f"{where}.output")
        messages.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": content})
    elif kind != "reasoning":
        raise BadRequest(
            f"responses request: {where}.type: expected message, function_call, custom_tool_call, their outputs or "
            f"reasoning, got {kind!r}"
        )


def _response(call: ModelCall, request: ResponsesRequest, model: str) -> dict[str, Any]:
    output: list[dict[str, Any]] = []
    if call.reply.get("content"):
        part = {"type": "output_text", "text": call.reply["content"], "annotations": []}
        output.append({"type": "message", "id": f"msg_{uuid.uuid4().hex}", "role": "assistant", "content": [part]})
    served, _ = served_tools(request.tools or ())
    for tool_call in call.reply.get("tool_calls") or ():
        output.append(_call_item(tool_call, served.get(tool_call["function"]["name"])))
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


def _call_item(tool_call: dict[str, Any], tool: Served | None) -> dict[str, Any]:
    """A tool call as its tool's output item: a `function_call`, or a `custom_tool_call` with its `input`."""
    name, arguments = tool_call["function"]["name"], tool_call["function"]["arguments"]
    item: dict[str, Any] = {"call_id": tool_call["id"], "name": name}
    if tool is not None and tool.custom:
        parsed = json.loads(arguments)  # the core's calls carry JSON arguments
        given = parsed.get("input") if isinstance(parsed, dict) else None
        text = given if isinstance(given, str) else arguments
        item |= {"type": "custom_tool_call", "id": f"ctc_{uuid.uuid4().hex}", "input": text}
    else:
        item |= {"type": "function_call", "id": f"fc_{uuid.uuid4().hex}", "arguments": arguments}
    return item | ({"namespace": tool.namespace} if tool is not None and tool.namespace else {})


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
        elif item["type"] == "custom_tool_call":
            started_item = item | {"status": "in_progress", "input": ""}
            yield sent("response.output_item.added", output_index=index, item=started_item)
            yield sent("response.custom_tool_call_input.delta", **where, delta=item["input"])
            yield sent("response.custom_tool_call_input.done", **where, input=item["input"])
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
