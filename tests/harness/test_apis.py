"""The proxy's three APIs, each spoken by its vendor's own client (OpenAI's for Chat Completions and Responses,
Anthropic's for Messages) over the proxy's real socket to the stand-in model: plain and streamed replies, a tool call
round trip, the same recorded tokens whichever API carried the conversation, and the rollout's limits answered as
each API's error and recorded as refusals."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import anthropic
import httpx
import openai
import pytest
from standin_helpers import running_standin

from nemo_gym_prorl.agent.turns import Turn, http_poster
from nemo_gym_prorl.contracts.sampling import SamplingParams
from nemo_gym_prorl.harness.calls import ModelCalls
from nemo_gym_prorl.harness.proxy import ModelProxy, ProxyConfig
from nemo_gym_prorl.json_http import JsonHttp
from nemo_gym_prorl.models.tokenizer import Tokenizer

TRAINER = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=40, seed=7)
TOOL_REPLY = 'Let me look.\n<tool_call>\n{"name": "bash", "arguments": {"command": "ls -la"}}\n</tool_call>'
SYSTEM, TASK, LISTING = "You are terse.", "List the files.", "a.txt\nb.txt"
SCHEMA = {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}
CHAT_TOOLS = [{"type": "function", "function": {"name": "bash", "description": "Run a shell command.", "parameters": SCHEMA}}]
RESPONSES_TOOLS = [{"type": "function", "name": "bash", "description": "Run a shell command.", "parameters": SCHEMA}]
MESSAGES_TOOLS = [{"name": "bash", "description": "Run a shell command.", "input_schema": SCHEMA}]


@pytest.fixture(scope="module")
def tool_model() -> Iterator[str]:
    """The stand-in model, always answering TOOL_REPLY."""
    yield from running_standin([TOOL_REPLY])


@pytest.fixture(scope="module")
def slow_tool_model() -> Iterator[str]:
    """TOOL_REPLY after 2 s: long past a 0.5 s deadline, short enough to let the server stop at once afterwards."""
    yield from running_standin([TOOL_REPLY], latency_s=2.0)


Conversation = Callable[[httpx.AsyncClient], Awaitable[None]]


@pytest.fixture
def through_proxy(tool_model: str, tokenizer: Tokenizer) -> Callable[..., Awaitable[ModelCalls]]:
    async def run(conversation: Conversation, config: ProxyConfig | None = None, model: str | None = None) -> ModelCalls:
        http = JsonHttp()
        calls = ModelCalls(http_poster(http, model or tool_model), "standin", tokenizer, TRAINER)
        try:
            async with ModelProxy(calls, config) as proxy, unix_client(proxy) as client:
                await conversation(client)
        finally:
            await http.aclose()
        return calls

    return run


def unix_client(proxy: ModelProxy) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(uds=str(proxy.socket_path)), base_url="http://proxy")


def openai_client(http: httpx.AsyncClient) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url="http://proxy/v1", api_key="unused", http_client=http, max_retries=0)


def anthropic_client(http: httpx.AsyncClient) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url="http://proxy", api_key="unused", http_client=http, max_retries=0)


async def chat_conversation(http: httpx.AsyncClient) -> None:
    client = openai_client(http)
    messages: list[Any] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": TASK}]
    plain = await client.chat.completions.create(model="m", messages=messages, tools=CHAT_TOOLS)  # type: ignore[arg-type]
    stream = await client.chat.completions.create(model="m", messages=messages, tools=CHAT_TOOLS, stream=True)  # type: ignore[arg-type]
    _ = [chunk async for chunk in stream]
    message = plain.choices[0].message
    (call,) = message.tool_calls or []
    result = {"role": "tool", "tool_call_id": call.id, "content": LISTING}
    await client.chat.completions.create(model="m", messages=[*messages, message.model_dump(exclude_none=True), result], tools=CHAT_TOOLS)  # type: ignore[arg-type]


async def responses_conversation(http: httpx.AsyncClient) -> None:
    client = openai_client(http)
    asked: dict[str, Any] = {"model": "m", "instructions": SYSTEM, "tools": RESPONSES_TOOLS, "store": False}
    plain = await client.responses.create(input=TASK, temperature=1.5, **asked)
    assert plain.status == "completed" and plain.output_text == "Let me look."
    (call,) = [item for item in plain.output if item.type == "function_call"]
    assert (call.name, json.loads(call.arguments)) == ("bash", {"command": "ls -la"})

    events = [event async for event in await client.responses.create(input=TASK, stream=True, **asked)]
    kinds = [event.type for event in events]
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert {"response.output_text.delta", "response.function_call_arguments.done", "response.output_item.done"} <= set(kinds)
    streamed = events[-1].response  # type: ignore[union-attr]
    text = "".join(event.delta for event in events if event.type == "response.output_text.delta")  # type: ignore[union-attr]
    (streamed_call,) = [item for item in streamed.output if item.type == "function_call"]
    assert (text, streamed.output_text, streamed_call.arguments) == ("Let me look.", "Let me look.", call.arguments)
    assert [event.sequence_number for event in events] == list(range(len(events)))

    # Codex's way: store false, the whole input again, the reply's items as they came and the tool's output
    history = [{"role": "user", "content": TASK}, *(item.model_dump(exclude_none=True) for item in plain.output)]
    output = {"type": "function_call_output", "call_id": call.call_id, "output": LISTING}
    await client.responses.create(input=[*history, output], **asked)  # type: ignore[list-item]


async def messages_conversation(http: httpx.AsyncClient) -> None:
    client = anthropic_client(http)
    asked: dict[str, Any] = {"model": "m", "system": SYSTEM, "tools": MESSAGES_TOOLS, "max_tokens": 256}
    user = {"role": "user", "content": TASK}
    plain = await client.messages.create(messages=[user], temperature=0.1, **asked)
    assert plain.stop_reason == "tool_use"
    text, use = plain.content
    assert (text.type, text.text, use.type, use.name, use.input) == ("text", "Let me look.", "tool_use", "bash", {"command": "ls -la"})  # type: ignore[union-attr]

    async with client.messages.stream(messages=[user], **asked) as stream:  # type: ignore[arg-type]
        kinds = [event.type async for event in stream]
        streamed = await stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "content_block_delta" in kinds
    seen = {"type", "text", "name", "input"}  # each call's tool_use id is its own
    assert [b.model_dump(include=seen) for b in streamed.content] == [b.model_dump(include=seen) for b in plain.content]
    assert (streamed.stop_reason, streamed.usage.output_tokens) == ("tool_use", plain.usage.output_tokens)

    result = {"type": "tool_result", "tool_use_id": use.id, "content": LISTING}  # type: ignore[union-attr]
    reply = {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in plain.content]}
    await client.messages.create(messages=[user, reply, {"role": "user", "content": [result]}], **asked)  # type: ignore[list-item]


def tokens(calls: ModelCalls) -> list[Turn]:
    return [call.turn for call in calls.calls]


async def test_responses_and_messages_record_the_same_tokens_as_chat_completions(through_proxy: Any) -> None:
    chat = await through_proxy(chat_conversation)
    for conversation, api in ((responses_conversation, "responses"), (messages_conversation, "messages")):
        calls = await through_proxy(conversation)
        assert [c.api for c in calls.calls] == [api] * 3
        # plain, streamed, and the tool round trip continuing the streamed call's exact tokens, as via chat
        assert [c.continues for c in calls.calls] == [c.continues for c in chat.calls] == [None, None, 1]
        assert tokens(calls) == tokens(chat)
        functions = [[t["function"] for t in c.reply["tool_calls"]] for c in (*calls.calls, *chat.calls)]
        assert functions == [[{"name": "bash", "arguments": '{"command": "ls -la"}'}]] * 6
        first = calls.calls[0]
        # the trainer's sampling, whatever the harness asked; its own recorded
        assert (first.sampling.temperature, first.sampling.top_p) == (0.8, 0.95)
        assert first.harness_params["temperature"] in (1.5, 0.1) and first.harness_params["model"] == "m"
    assert calls.calls[0].sampling.max_tokens == 40  # Anthropic's max_tokens 256 does not raise the trainer's 40


async def test_past_the_token_budget_each_api_answers_its_own_error_and_the_call_is_recorded_refused(
    through_proxy: Any,
) -> None:
    async def conversation(http: httpx.AsyncClient) -> None:
        chat, claude = openai_client(http), anthropic_client(http)
        messages: list[Any] = [{"role": "user", "content": TASK}]
        first = await chat.chat.completions.create(model="m", messages=messages)
        assert first.usage is not None and first.usage.completion_tokens > 5  # the stand-in ignores the cap
        with pytest.raises(openai.BadRequestError) as refused:
            await chat.chat.completions.create(model="m", messages=messages)
        assert refused.value.code == "token_budget"
        assert "token budget (5 generated tokens) is spent" in refused.value.message
        with pytest.raises(openai.BadRequestError, match="token budget"):
            await chat.responses.create(model="m", input=TASK)
        with pytest.raises(anthropic.BadRequestError, match="token budget") as claude_refused:
            await claude.messages.create(model="m", max_tokens=10, messages=messages)
        assert claude_refused.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]

    calls = await through_proxy(conversation, ProxyConfig(token_budget=5))
    assert len(calls.calls) == 1 and calls.calls[0].sampling.max_tokens == 5  # capped at the budget left
    assert [(r.api, r.reason, r.cut) for r in calls.refused] == [
        ("chat.completions", "token_budget", False), ("responses", "token_budget", False), ("messages", "token_budget", False)
    ]  # fmt: skip


async def test_a_call_in_flight_at_the_deadline_is_cut_and_later_ones_refused(
    through_proxy: Any, slow_tool_model: str
) -> None:
    async def conversation(http: httpx.AsyncClient) -> None:
        client = anthropic_client(http)
        messages: list[Any] = [{"role": "user", "content": TASK}]
        with pytest.raises(anthropic.BadRequestError, match=r"deadline \(0.5 s\) came while it was generating"):
            await client.messages.create(model="m", max_tokens=10, messages=messages)
        with pytest.raises(anthropic.BadRequestError, match=r"deadline \(0.5 s\) has passed"):
            await client.messages.create(model="m", max_tokens=10, messages=messages)

    calls = await through_proxy(conversation, ProxyConfig(deadline_s=0.5), model=slow_tool_model)
    assert calls.calls == [] and [(r.reason, r.cut) for r in calls.refused] == [("deadline", True), ("deadline", False)]


@pytest.mark.parametrize(
    ("path", "body", "message"),
    [
        ("/v1/responses", {"model": "m"}, "responses request: input: Field required"),
        ("/v1/responses", {"input": "hi", "previous_response_id": "resp_1"}, "responses request: previous_response_id: not supported"),
        ("/v1/responses", {"input": [{"type": "image_generation_call"}]}, "responses request: input.0.type: expected message"),
        ("/v1/messages", {"messages": [{"role": "user", "content": "hi"}]}, "messages request: max_tokens: Field required"),
        ("/v1/messages", {"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image"}]}]},
         "messages request: messages.0.content.0.type: 'image' is not supported in a user message"),
        ("/v1/messages", {"max_tokens": 5, "messages": [{"role": "user", "content": "hi"}], "tools": [{"name": "x"}]},
         "messages request: tools.0: expected a name and an input_schema object"),
    ],
)  # fmt: skip
async def test_a_request_the_proxy_cannot_read_is_a_400_naming_the_field(
    through_proxy: Any, path: str, body: dict[str, Any], message: str
) -> None:
    async def conversation(http: httpx.AsyncClient) -> None:
        answer = await http.post(path, json=body)
        error = answer.json()["error"]
        assert (answer.status_code, error["message"][: len(message)]) == (400, message), error

    calls = await through_proxy(conversation)
    assert calls.calls == [] and calls.refused == []


async def test_past_its_number_of_calls_a_rollout_is_refused(through_proxy: Any) -> None:
    async def conversation(http: httpx.AsyncClient) -> None:
        client = openai_client(http)
        await client.responses.create(model="m", input=TASK)
        with pytest.raises(openai.BadRequestError, match="the rollout's 1 model calls are made") as refused:
            await client.responses.create(model="m", input=TASK)
        assert refused.value.code == "max_calls"

    calls = await through_proxy(conversation, ProxyConfig(max_calls=1))
    assert len(calls.calls) == 1 and [r.reason for r in calls.refused] == ["max_calls"]
