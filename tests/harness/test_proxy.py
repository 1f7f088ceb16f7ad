"""The per-rollout model proxy against real parts: a bubblewrap sandbox without network, the forwarder inside it,
the proxy on its Unix socket, the real embedded model behind a real LLM pool (the stand-in model where the reply
must be known), a stand-in harness that speaks plain HTTP from inside the sandbox, and OpenAI's own client."""

from __future__ import annotations

import json
import socket
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import openai
import pytest
from standin_helpers import running_standin

from nemo_gym_prorl.agent.llm_pool import LLMPool, LLMPoolConfig
from nemo_gym_prorl.agent.turns import PostJSON, http_poster
from nemo_gym_prorl.contracts.sampling import SamplingParams
from nemo_gym_prorl.contracts.trajectory import TOKEN_FIELDS, contiguity_violation
from nemo_gym_prorl.harness.calls import CallRequest, ModelCall, ModelCalls
from nemo_gym_prorl.harness.proxy import ModelProxy, ProxyConfig, ProxyError
from nemo_gym_prorl.harness.segments import segments
from nemo_gym_prorl.json_http import JsonHttp
from nemo_gym_prorl.models.launcher import LocalModelServer
from nemo_gym_prorl.models.tokenizer import Tokenizer
from nemo_gym_prorl.sandbox import SandboxLimits, SandboxSpec, open_sandbox

SPEC = SandboxSpec(limits=SandboxLimits(memory_mb=512, wall_clock_s=120))
TRAINER = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=12, seed=7)
TOOL_REPLY = 'Let me look.\n<tool_call>\n{"name": "bash", "arguments": {"command": "ls -la"}}\n</tool_call>'
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "bash",
            "description": "Run a shell command.",
            "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]},
        },
    }
]

# A harness as an unmodified agent would be one: it reads OPENAI_BASE_URL, speaks plain HTTP, keeps its own history,
# sets its own temperature, and compacts the history once it has made three calls.
HARNESS = """
import json, os, urllib.request

def chat(messages):
    body = {"model": "harness-model", "messages": messages, "temperature": 1.7, "top_p": 0.5, "max_tokens": 200}
    request = urllib.request.Request(
        os.environ["OPENAI_BASE_URL"] + "/chat/completions", json.dumps(body).encode(),
        {"Content-Type": "application/json", "Authorization": "Bearer " + os.environ["OPENAI_API_KEY"]},
    )
    with urllib.request.urlopen(request, timeout=60) as answer:
        return json.load(answer)["choices"][0]["message"]

messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Count to three."}]
for step in range(3):
    messages += [chat(messages), {"role": "user", "content": f"Go on ({step})."}]
chat([messages[0], {"role": "user", "content": "Summary so far: you counted. Say done."}])
print("harness done")
"""

# From inside the sandbox: the host's loopback listener and the model server are out of reach, the proxy is not.
PROBE = """
import json, socket, sys, urllib.request

def refused(port):
    try:
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
    except ConnectionRefusedError:
        return True
    return False

base = sys.argv[3]
with urllib.request.urlopen(base + "/models", timeout=10) as answer:
    models = json.load(answer)
interfaces = [line.split(":")[0].strip() for line in open("/proc/net/dev").read().splitlines()[2:]]
print(json.dumps({"host_listener_refused": refused(int(sys.argv[1])), "model_server_refused": refused(int(sys.argv[2])),
                  "models": [m["id"] for m in models["data"]], "interfaces": interfaces}))
"""

# What is left of the forwarder inside the sandbox.
LEFT = """
import json, os, socket
procs = []
for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
        procs.append(open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\\0", b" ").decode())
    except OSError:
        pass
try:
    socket.create_connection(("127.0.0.1", 4000), timeout=5).close()
    port = "open"
except ConnectionRefusedError:
    port = "refused"
print(json.dumps({"forwarders": [p for p in procs if "forwarder.py" in p], "port": port}))
"""


class Recorded:
    """The backend's own answers, kept as they came (a real PostJSON in front of the real pool)."""

    def __init__(self, post: PostJSON) -> None:
        self._post = post
        self.exchanges: list[tuple[dict[str, Any], dict[str, Any]]] = []

    async def __call__(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        answer = await self._post(path, body)
        self.exchanges.append((body, answer))
        return answer


@pytest.fixture(scope="module")
def tool_model() -> Iterator[str]:
    """The stand-in model, always answering TOOL_REPLY."""
    yield from running_standin([TOOL_REPLY])


@pytest.fixture
async def standin_calls(tool_model: str, tokenizer: Tokenizer) -> AsyncIterator[ModelCalls]:
    http = JsonHttp()
    try:
        yield ModelCalls(http_poster(http, tool_model), "standin", tokenizer, TRAINER)
    finally:
        await http.aclose()


def unix_client(proxy: ModelProxy) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(uds=str(proxy.socket_path)), base_url="http://proxy")


async def test_harness_in_the_sandbox_gets_two_contiguous_segments_with_the_backends_exact_tokens(
    model_server: LocalModelServer, tokenizer: Tokenizer
) -> None:
    pool_config = LLMPoolConfig(health_interval_s=0)
    async with LLMPool(pool_config, [model_server.base_url]) as pool:
        backend = Recorded(pool.poster("job-1:0"))
        calls = ModelCalls(backend, "smollm2", tokenizer, TRAINER)
        async with ModelProxy(calls) as proxy, open_sandbox("bwrap", proxy.sandbox_spec(SPEC)) as sandbox:
            await proxy.connect(sandbox, lifetime_s=SPEC.limits.wall_clock_s)
            await sandbox.write_file("harness.py", HARNESS.encode())
            result = await sandbox.exec(["python3", "harness.py"], timeout=120)
            assert (result.exit_code, result.output) == (0, "harness done\n")

    recorded = calls.calls
    assert [c.continues for c in recorded] == [None, 0, 1, None]  # three calls extend each other, then a compaction
    found = segments(recorded)
    assert [len(s) for s in found] == [3, 1]
    assert all(contiguity_violation(s) is None for s in found)
    turns = [turn for segment in found for turn in segment]
    for turn, (body, answer) in zip(turns, backend.exchanges, strict=True):
        choice = answer["choices"][0]
        assert turn["prompt_token_ids"] == body["prompt"]
        assert turn["generation_token_ids"] == choice["token_ids"]
        assert turn["generation_log_probs"] == choice["logprobs"]["token_logprobs"]
        # the trainer's sampling parameters, not the harness's: its temperature is recorded, its max_tokens caps
        assert (body["temperature"], body["top_p"], body["max_tokens"], body["seed"]) == (0.8, 0.95, 12, 7)
    assert recorded[0].harness_params == {"model": "harness-model", "temperature": 1.7, "top_p": 0.5}
    assert recorded[0].sampling.max_tokens == 12
    # the compacted history is rendered anew, not stitched onto the earlier tokens
    compacted = tokenizer.chat_template.render(recorded[3].messages, None, add_generation_prompt=True)
    assert found[1][0]["prompt_token_ids"] == tokenizer.encode(compacted)
    assert recorded[0].messages[1] == {"role": "user", "content": "Count to three."}
    assert {m["role"] for s in found for m in s} == {"assistant"} and all(set(TOKEN_FIELDS) <= set(t) for t in turns)


async def test_a_stream_carries_what_the_plain_answer_does_and_a_tool_round_trip_continues_the_tokens(
    standin_calls: ModelCalls,
) -> None:
    messages: list[dict[str, Any]] = [{"role": "user", "content": "List the files."}]
    async with ModelProxy(standin_calls) as proxy, unix_client(proxy) as http:
        client = openai.AsyncOpenAI(base_url="http://proxy/v1", api_key="unused", http_client=http)
        plain = await client.chat.completions.create(model="m", messages=messages, tools=TOOLS)  # type: ignore[arg-type]
        stream = await client.chat.completions.create(
            model="m", messages=messages, tools=TOOLS, stream=True, stream_options={"include_usage": True}  # type: ignore[arg-type]
        )
        content, calls, finish, usage = "", {}, None, None
        async for chunk in stream:
            usage = chunk.usage or usage
            for choice in chunk.choices:
                content += choice.delta.content or ""
                finish = choice.finish_reason or finish
                for call in choice.delta.tool_calls or ():
                    got = calls.setdefault(call.index, {"id": "", "name": "", "arguments": ""})
                    got["id"] += call.id or ""
                    got["name"] += call.function.name or ""
                    got["arguments"] += call.function.arguments or ""
        message = plain.choices[0].message
        assert (message.content, plain.choices[0].finish_reason) == ("Let me look.", "tool_calls")
        (tool_call,) = message.tool_calls or []
        assert (tool_call.function.name, json.loads(tool_call.function.arguments)) == ("bash", {"command": "ls -la"})
        assert (content, finish, usage) == (message.content, "tool_calls", plain.usage)
        (streamed_call,) = calls.values()  # each call's id is its own
        assert streamed_call["id"].startswith("call_") and streamed_call["id"] != tool_call.id
        assert (streamed_call["name"], streamed_call["arguments"]) == ("bash", tool_call.function.arguments)
        # the harness sends the reply back, as OpenAI's client gives it, with the tool's output: the same tokens go on
        result = {"role": "tool", "tool_call_id": tool_call.id, "content": "a.txt\nb.txt"}
        followed = [*messages, message.model_dump(exclude_none=True), result]
        await client.chat.completions.create(model="m", messages=followed, tools=TOOLS)  # type: ignore[arg-type]
    first, streamed, third = standin_calls.calls
    assert streamed.turn == first.turn and streamed.continues is None
    assert third.continues == 1 and contiguity_violation([c.assistant_turn() for c in (streamed, third)]) is None


async def test_the_sandbox_reaches_the_proxy_and_nothing_else(model_server: LocalModelServer, tokenizer: Tokenizer) -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    listener.setblocking(False)
    model_port = int(model_server.base_url.rsplit(":", 1)[1].split("/")[0])
    calls = ModelCalls(http_poster(JsonHttp(), model_server.base_url), "smollm2", tokenizer, TRAINER)  # never called
    async with ModelProxy(calls) as proxy, open_sandbox("bwrap", proxy.sandbox_spec(SPEC)) as sandbox:
        await proxy.connect(sandbox, lifetime_s=SPEC.limits.wall_clock_s)
        await sandbox.write_file("probe.py", PROBE.encode())
        argv = ["python3", "probe.py", str(listener.getsockname()[1]), str(model_port), proxy.base_url]
        result = await sandbox.exec(argv, timeout=30)
    with listener:
        assert result.exit_code == 0, result.output
        assert json.loads(result.output) == {
            "host_listener_refused": True, "model_server_refused": True, "models": ["smollm2"], "interfaces": ["lo"]
        }  # fmt: skip
        with pytest.raises(BlockingIOError):
            listener.accept()  # nothing ever reached it
    assert calls.calls == []


async def test_closing_the_proxy_leaves_no_socket_and_no_forwarder(standin_calls: ModelCalls) -> None:
    proxy = ModelProxy(standin_calls)
    await proxy.start()
    folder = proxy.socket_path.parent
    async with open_sandbox("bwrap", proxy.sandbox_spec(SPEC)) as sandbox:
        await proxy.connect(sandbox, lifetime_s=SPEC.limits.wall_clock_s)
        await sandbox.write_file("left.py", LEFT.encode())
        before = json.loads((await sandbox.exec(["python3", "left.py"], timeout=30)).output)
        await proxy.close()
        after = json.loads((await sandbox.exec(["python3", "left.py"], timeout=30)).output)
        await proxy.close()  # again: nothing left to do
    assert len(before["forwarders"]) == 1 and before["port"] == "open"
    assert after == {"forwarders": [], "port": "refused"}
    assert not folder.exists() and not folder.parent.exists()


async def test_a_request_the_proxy_cannot_read_is_a_400_naming_the_field(standin_calls: ModelCalls) -> None:
    async with ModelProxy(standin_calls) as proxy, unix_client(proxy) as http:
        cases = {
            b"{not json": "chat completions request: the body is not JSON",
            b'{"model": "m"}': "chat completions request: messages: Field required",
            b'{"messages": [{"role": "user", "content": "hi"}], "n": 2}': "chat completions request: n: Input should be 1",
            json.dumps({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}).encode():
                "messages.0.content.0: only text parts are supported, got 'image_url'",
        }  # fmt: skip
        for body, message in cases.items():
            answer = await http.post("/v1/chat/completions", content=body)
            assert answer.status_code == 400
            assert answer.json()["error"]["message"].startswith(message), answer.json()
    assert standin_calls.calls == []


async def test_a_forwarder_that_cannot_start_is_an_error_naming_why(standin_calls: ModelCalls) -> None:
    async with ModelProxy(standin_calls, ProxyConfig(python="no-such-python")) as proxy:
        async with open_sandbox("bwrap", proxy.sandbox_spec(SPEC)) as sandbox:
            with pytest.raises(ProxyError, match=r"ended \(exit 127\) before it listened on port 4000: no-such-python"):
                await proxy.connect(sandbox, lifetime_s=SPEC.limits.wall_clock_s)
        with pytest.raises(ValueError, match="sandbox spec: network must be false"):
            proxy.sandbox_spec(SPEC.model_copy(update={"network": True}))


async def test_a_call_continues_the_latest_call_it_extends_with_the_same_tools_whatever_came_between(
    standin_calls: ModelCalls,
) -> None:
    async def complete(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> ModelCall:
        return await standin_calls.complete(CallRequest(api="chat.completions", messages=messages, tools=tools))

    main = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "List the files."}]
    first = await complete(main, TOOLS)
    await complete([{"role": "user", "content": "Summarise a.txt."}], None)  # a sub-agent's conversation between
    retried = await complete(main, TOOLS)  # the same request again: the same reply, a later call
    (tool_call,) = first.reply["tool_calls"]
    resumed = [*main, retried.reply, {"role": "tool", "tool_call_id": tool_call["id"], "content": "a.txt"}]
    assert (await complete(resumed, TOOLS)).continues == retried.index
    assert (await complete(resumed, None)).continues is None  # no call with that conversation had no tools
    extended = standin_calls.calls[-2]
    more = [*resumed, extended.reply, {"role": "user", "content": "Go on."}]
    assert (await complete(more, TOOLS)).continues == extended.index
    assert (await complete([*resumed, extended.reply], TOOLS)).continues is None  # nothing added after the reply
    assert [c.continues for c in standin_calls.calls] == [None, None, None, 2, None, 3, None]
