"""The Responses adapter's tools beyond plain functions, spoken by OpenAI's own client over the proxy's socket to the
stand-in model: a custom (freeform) tool such as Codex's apply_patch and a namespace's tools are offered to the model
as functions, its calls come back as a `custom_tool_call` with its `input` and a `function_call` with its namespace,
plain and streamed, and the round trip re-sent in those forms continues the first call's exact tokens."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from standin_helpers import running_standin

from nemo_gym_prorl.agent.turns import http_poster
from nemo_gym_prorl.contracts.sampling import SamplingParams
from nemo_gym_prorl.harness.calls import ModelCalls
from nemo_gym_prorl.harness.proxy import ModelProxy
from nemo_gym_prorl.json_http import JsonHttp
from nemo_gym_prorl.models.tokenizer import Tokenizer

PATCH = "*** Begin Patch\n*** Add File: a.txt\n+a\n*** End Patch"
REPLY = (
    f"<tool_call>\n{json.dumps({'name': 'apply_patch', 'arguments': {'input': PATCH}})}\n</tool_call>\n"
    f"<tool_call>\n{json.dumps({'name': 'lookup', 'arguments': {'id': 7}})}\n</tool_call>"
)
GRAMMAR = 'start: "*** Begin Patch" /(.|\\n)*/ "*** End Patch"'
TOOLS: list[Any] = [
    {"type": "custom", "name": "apply_patch", "description": "Edit files with a patch.",
     "format": {"type": "grammar", "syntax": "lark", "definition": GRAMMAR}},
    {"type": "namespace", "name": "crm", "description": "Customer records.", "tools": [
        {"type": "function", "name": "lookup", "parameters": {"type": "object", "properties": {"id": {"type": "integer"}}}},
    ]},
    {"type": "web_search"},
]  # fmt: skip


@pytest.fixture(scope="module")
def model() -> Iterator[str]:
    yield from running_standin([REPLY])


async def test_custom_and_namespaced_tool_calls_round_trip_in_their_own_item_types(
    model: str, tokenizer: Tokenizer
) -> None:
    http = JsonHttp()
    calls = ModelCalls(http_poster(http, model), "standin", tokenizer, SamplingParams(max_tokens=200))
    try:
        async with ModelProxy(calls) as proxy:
            transport = httpx.AsyncHTTPTransport(uds=str(proxy.socket_path))
            async with httpx.AsyncClient(transport=transport, base_url="http://proxy") as client:
                sdk = openai.AsyncOpenAI(base_url="http://proxy/v1", api_key="k", http_client=client, max_retries=0)
                asked: dict[str, Any] = {"model": "m", "input": "Add a.txt.", "tools": TOOLS, "store": False}
                plain = await sdk.responses.create(**asked)
                events = [event async for event in await sdk.responses.create(stream=True, **asked)]
                patch, lookup = plain.output
                assert (patch.type, patch.name, patch.input) == ("custom_tool_call", "apply_patch", PATCH)  # type: ignore[union-attr]
                assert (lookup.type, lookup.name, lookup.namespace) == ("function_call", "lookup", "crm")  # type: ignore[union-attr]
                assert json.loads(lookup.arguments) == {"id": 7}  # type: ignore[union-attr]
                done = [event for event in events if event.type == "response.custom_tool_call_input.done"]
                assert [event.input for event in done] == [PATCH]  # type: ignore[union-attr]
                streamed = events[-1].response.output  # type: ignore[union-attr]
                assert [(item.type, item.name) for item in streamed] == [(i.type, i.name) for i in plain.output]  # type: ignore[union-attr]

                history = [{"role": "user", "content": "Add a.txt."}, *(i.model_dump(exclude_none=True) for i in plain.output)]
                outputs = [{"type": "custom_tool_call_output", "call_id": patch.call_id, "output": "Done."},  # type: ignore[union-attr]
                           {"type": "function_call_output", "call_id": lookup.call_id, "output": "Ada"}]  # type: ignore[union-attr]  # fmt: skip
                await sdk.responses.create(**asked | {"input": [*history, *outputs]})
    finally:
        await http.aclose()
    first, _, third = calls.calls
    offered = {tool["function"]["name"]: tool["function"] for tool in first.tools or ()}
    assert set(offered) == {"apply_patch", "lookup"} and first.harness_params["unserved_tools"] == ["web_search"]
    assert offered["apply_patch"]["parameters"]["required"] == ["input"] and GRAMMAR in offered["apply_patch"]["description"]
    # the calls re-sent as custom_tool_call and function_call: the prompt goes on from the exact tokens of the reply
    assert third.continues is not None
    prefix = first.turn.prompt_token_ids + first.turn.generation_token_ids
    assert third.turn.prompt_token_ids[: len(prefix)] == prefix
    assert [m["content"] for m in third.messages[-2:]] == ["Done.", "Ada"]
