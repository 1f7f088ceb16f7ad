"""A deterministic, instant stand-in model server: the same OpenAI-compatible surface as the real one, with
scripted replies, for benchmarks and fault tests where the model's speed or randomness must not matter.

The reply to a request is ``script[k]``, k = the number of its own replies already in the conversation (the last
entry repeats); a task's worked example, an assistant turn it did not write, does not count. Token ids come from the
real model's tokenizer, so rollouts through it are token-faithful and contiguous exactly as with a real server.
``latency_s`` simulates generation time (``latency_tail``: times a Pareto draw of that shape, capped at 20x, seeded by the
request's seed and turn: most turns quick, a few many times longer) and ``max_concurrency`` bounds how many requests
are "on the GPU" at once. ``/v1/completions`` streams with ``stream: true`` (one token a chunk, the latency spread over
them; a closed connection aborts it) and continues a reply a prompt already ends inside, as a cut request re-issued.

"Instant" means the server's own CPU is as small as it can be, since benchmarks share it between the sides they
compare: rollouts of one benchmark repeat the same prompts and tool outputs, so rendered templates and
tokenizations are memoised (a string in, the same tokens out: the cache changes no answer). Run it as
``python -m nemo_gym_prorl.models.standin --port 0 --script REPLY...``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import random
import socket
import sys
from collections.abc import Iterable
from typing import Any

import orjson
import uvicorn
from fastapi import FastAPI, Request, Response
from fastapi.responses import StreamingResponse

from nemo_gym_prorl.models.local_model import default_gguf
from nemo_gym_prorl.models.server import READY_LINE
from nemo_gym_prorl.models.tokenizer import StreamDecoder, Tokenizer
from nemo_gym_prorl.tool_calls import parse_hermes


_TAIL_CAP = 20.0


def create_standin_app(
    tokenizer: Tokenizer,
    script: list[str],
    latency_s: float = 0.0,
    max_concurrency: int | None = None,
    hold: bool = False,
    latency_tail: float | None = None,
) -> FastAPI:
    if not script:
        raise ValueError("the stand-in model needs at least one scripted reply")
    replies = [tokenizer.encode(text) + [tokenizer.eos_token_id] for text in script]
    reply_texts = [tokenizer.decode(ids) for ids in replies]
    template = tokenizer.chat_template
    assistant_start = tokenizer.encode(template.render([], add_generation_prompt=True))

    @functools.lru_cache(maxsize=4096)
    def encode(text: str) -> tuple[int, ...]:
        return tuple(tokenizer.encode(text))

    @functools.lru_cache(maxsize=4096)
    def chat_prompt(key: bytes) -> tuple[int, ...]:
        """The prompt of a chat request without token fields to splice: its messages and tools, rendered."""
        messages, tools = orjson.loads(key)
        return encode(template.render(messages, tools, add_generation_prompt=True))

    @functools.lru_cache(maxsize=4096)
    def continuation(key: bytes) -> tuple[int, ...]:
        """The tokens between an assistant turn (the last of `history`) and the next generation prompt."""
        history, new_messages, tools = orjson.loads(key)
        return encode(template.continuation_text(history, new_messages, tools, template.eos_token))
    gate = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    app = FastAPI(title="nemo-gym-prorl stand-in model")
    app.state.requests = 0
    app.state.waiting = 0
    app.state.aborted = 0  # streams whose client left before the last token
    released = asyncio.Event()
    if not hold:
        released.set()

    def turns_in(prompt: list[int]) -> tuple[int, int]:
        """Replies of the script already in a token prompt (the assistant turns at its end whose tokens are one of
        them: a worked example comes before every generated turn), and how many tokens of the turn being generated
        it already holds (a cut request re-issued with its partial tokens)."""
        first, width = assistant_start[0], len(assistant_start)
        starts = [i + width for i, t in enumerate(prompt) if t == first and prompt[i : i + width] == assistant_start]
        k = trailing(any(prompt[i : i + len(reply)] == reply for reply in replies) for i in starts[:-1])
        done = prompt[starts[-1] :] if starts else []
        reply = replies[min(k, len(replies) - 1)]
        return k, len(done) if reply[: len(done)] == done and len(done) < len(reply) else 0

    texts = set(script) | set(reply_texts)

    def trailing(written: Iterable[bool]) -> int:
        """How many of the last turns in a row the script wrote."""
        run = 0
        for mine in written:
            run = run + 1 if mine else 0
        return run

    def written_here(message: dict[str, Any]) -> bool:
        """An assistant message that one of the script's replies became (with its token fields, its parsed tool
        calls, or its text), not a worked example's."""
        content = message.get("content")
        tokens_or_calls = "generation_token_ids" in message or bool(message.get("tool_calls"))
        return tokens_or_calls or not isinstance(content, str) or content in texts

    def delay(seed: Any, k: int) -> float:
        if latency_tail is None:
            return latency_s
        return latency_s * min(_TAIL_CAP, random.Random(f"{seed}:{k}").paretovariate(latency_tail))

    async def admitted(k: int) -> int:
        """The index of the reply to give, once --hold has released it."""
        app.state.requests += 1
        if not released.is_set():
            app.state.waiting += 1
            try:
                await released.wait()
            finally:
                app.state.waiting -= 1
        return min(k, len(replies) - 1)

    async def generate(k: int, seed: Any = None) -> int:
        """The index of the reply to give, once the simulated generation is over."""
        wait_s = delay(seed, k)
        await admitted(k)
        if gate is None:
            if wait_s:
                await asyncio.sleep(wait_s)
        else:
            async with gate:
                if wait_s:
                    await asyncio.sleep(wait_s)
        return min(k, len(replies) - 1)

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/control/stats")
    async def stats() -> dict[str, int]:
        return {"requests": app.state.requests, "waiting": app.state.waiting, "aborted": app.state.aborted}

    @app.post("/control/release")
    async def release() -> dict[str, int]:
        """With --hold, requests wait until this is called (a benchmark's way to keep rollouts live)."""
        released.set()
        return {"released": app.state.waiting}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": "standin", "object": "model", "owned_by": "nemo-gym-prorl"}]}

    def usage_of(prompt: list[int], ids: list[int]) -> dict[str, int]:
        return {"prompt_tokens": len(prompt), "completion_tokens": len(ids), "total_tokens": len(prompt) + len(ids)}

    def json_response(body: dict[str, Any]) -> Response:
        return Response(orjson.dumps(body), media_type="application/json")

    async def stream(prompt: list[int], k: int, done: int, seed: Any) -> StreamingResponse:
        """One chunk per token, the turn's latency spread over its reply's tokens; cancelled when the client goes."""
        reply = replies[await admitted(k)]
        step_s = delay(seed, k) / len(reply)

        async def chunks() -> Any:
            sent, decoder = done, StreamDecoder(tokenizer, reply[:done])
            try:
                async with gate or contextlib.nullcontext():
                    for i in range(done, len(reply)):
                        if step_s:
                            await asyncio.sleep(step_s)
                        finish = "stop" if i == len(reply) - 1 else None
                        piece = decoder.push(reply[i]) + (decoder.flush() if finish else "")
                        lp = {"token_logprobs": [-0.1]}
                        choice = {"index": 0, "text": piece, "token_ids": [reply[i]], "logprobs": lp, "finish_reason": finish}
                        yield b"data: " + orjson.dumps({"object": "text_completion", "choices": [choice]}) + b"\n\n"
                        sent = i + 1
                usage = {"usage": usage_of(prompt, reply[done:])}
                yield b"data: " + orjson.dumps({"choices": [], **usage}) + b"\n\ndata: [DONE]\n\n"
            finally:
                if sent < len(reply):
                    app.state.aborted += 1

        return StreamingResponse(chunks(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = orjson.loads(await request.body())
        prompt = body["prompt"]
        k, done = turns_in(prompt)
        if body.get("stream"):
            return await stream(prompt, k, done, body.get("seed"))
        k = await generate(k, body.get("seed"))
        ids = replies[k][done:]
        choice = {
            "index": 0,
            "text": tokenizer.decode(replies[k])[len(tokenizer.decode(replies[k][:done])) :] if done else reply_texts[k],
            "token_ids": ids,
            "prompt_token_ids": prompt,
            "logprobs": {"token_logprobs": [-0.1] * len(ids)},
            "finish_reason": "stop",
        }
        return json_response({"id": "cmpl-standin", "object": "text_completion", "created": 0, "model": body.get("model") or "standin", "choices": [choice], "prompt_token_ids": prompt, "usage": usage_of(prompt, ids)})

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        body = orjson.loads(await request.body())
        messages = body["messages"]
        earlier = [m for m in messages if m.get("role") == "assistant"]
        k = await generate(trailing(written_here(m) for m in earlier), body.get("seed"))
        ids, text = replies[k], reply_texts[k]
        tools = body.get("tools")
        if earlier and "generation_token_ids" in earlier[-1]:
            last = max(i for i, m in enumerate(messages) if m.get("role") == "assistant")
            tail = continuation(orjson.dumps([messages[: last + 1], messages[last + 1 :], tools]))
            prompt = earlier[-1]["prompt_token_ids"] + earlier[-1]["generation_token_ids"] + list(tail)
        else:
            prompt = list(chat_prompt(orjson.dumps([messages, tools])))
        message: dict[str, Any] = {
            "role": "assistant",
            "content": text,
            "prompt_token_ids": prompt,
            "generation_token_ids": ids,
            "generation_log_probs": [-0.1] * len(ids),
        }
        finish_reason = "stop"
        if tools:  # as the real server: Hermes <tool_call> blocks become OpenAI tool_calls
            parsed = parse_hermes(text)
            if parsed.tool_calls:
                message["content"] = parsed.content or None
                message["tool_calls"] = [call.to_openai() for call in parsed.tool_calls]
                finish_reason = "tool_calls"
        choice = {"index": 0, "message": message, "finish_reason": finish_reason}
        return json_response({"id": "chatcmpl-standin", "object": "chat.completion", "created": 0, "model": body.get("model") or "standin", "choices": [choice], "usage": usage_of(prompt, ids)})

    return app


def standin_argv(
    script: list[str],
    latency_s: float = 0.0,
    max_concurrency: int | None = None,
    hold: bool = False,
    latency_tail: float | None = None,
) -> list[str]:
    """The command that starts this server (for `ModelServerProcess`)."""
    argv = [sys.executable, "-m", "nemo_gym_prorl.models.standin", "--latency-s", str(latency_s)]
    if latency_tail is not None:
        argv += ["--latency-tail", str(latency_tail)]
    if max_concurrency:
        argv += ["--max-concurrency", str(max_concurrency)]
    if hold:
        argv.append("--hold")
    return [*argv, "--script", *script]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="deterministic instant stand-in model server")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--latency-s", type=float, default=0.0)
    parser.add_argument("--latency-tail", type=float, default=None, help="Pareto shape of each request's latency")
    parser.add_argument("--max-concurrency", type=int, default=None)
    parser.add_argument("--hold", action="store_true", help="hold every request until POST /control/release")
    parser.add_argument("--script", nargs="+", required=True)
    args = parser.parse_args(argv)
    app = create_standin_app(
        Tokenizer.from_gguf(default_gguf()), args.script, args.latency_s, args.max_concurrency, args.hold,
        args.latency_tail,
    )
    sock = socket.create_server((args.host, args.port), backlog=4096)
    print(f"{READY_LINE} {sock.getsockname()[1]}", flush=True)
    uvicorn.Server(uvicorn.Config(app, log_level="warning", backlog=4096)).run(sockets=[sock])


if __name__ == "__main__":
    main()
