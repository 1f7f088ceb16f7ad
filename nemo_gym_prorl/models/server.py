"""The embedded OpenAI-compatible model server (llama.cpp), token-faithful the way vLLM and NeMo RL's server are.

Token information, by what the request asks for:
- ``logprobs`` + ``return_tokens_as_token_ids`` (chat): ``prompt_token_ids``, ``generation_token_ids`` and
  ``generation_log_probs`` on ``choices[0].message`` (NeMo RL's server), and ``token_id:N`` token strings.
- ``return_token_ids``: top-level ``prompt_token_ids`` and ``choices[0].token_ids`` (vLLM).
- Earlier assistant messages that carry their ``prompt_token_ids`` + ``generation_token_ids`` are spliced back as
  the exact prefix of the new prompt (NeMo RL's ``required_prefix_token_ids``): a conversation's tokens never drift.

``/v1/completions`` streams with ``stream: true``: one token a chunk, its id and log-prob (the LLM pool's weight
update cuts and re-issues such requests); a client that leaves stops the generation. Policy versions: a server
started with ``--policy-version N`` stamps every generation with the version of the weights that made it (on the
completions choice, the chat message and the top level). ``POST /policy/load {"gguf": path, "version": N}`` swaps
weights: running generations finish on the old ones, later requests wait for the new. ``GET /policy`` says which.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel

from nemo_gym_prorl.contracts.sampling import SamplingParams
from nemo_gym_prorl.models.engine import ContextLengthError, EnginePool, Generation, LlamaEngine, PolicyLoadError
from nemo_gym_prorl.models.local_model import default_gguf
from nemo_gym_prorl.models.openai_api import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    error_body,
)
from nemo_gym_prorl.models.tokenizer import StreamDecoder, Tokenizer
from nemo_gym_prorl.tool_calls import parse_hermes

READY_LINE = "PRORL_MODEL_SERVER_READY"
STOP_GRACE_S = 1.0


def chat_prompt_ids(tokenizer: Tokenizer, request: ChatCompletionRequest) -> list[int]:
    """The prompt for a chat request, splicing in the exact ids of the last assistant turn that carries them."""
    template = tokenizer.chat_template
    messages = request.messages
    for k in range(len(messages) - 1, -1, -1):
        message = messages[k]
        if message.get("role") == "assistant" and message.get("generation_token_ids") is not None:
            if message.get("prompt_token_ids") is None:
                raise ValueError(f"messages[{k}] has generation_token_ids but no prompt_token_ids")
            generated = list(message["generation_token_ids"])
            prefix = list(message["prompt_token_ids"]) + generated
            end = tokenizer.generation_end(generated)
            rest = template.continuation_text(messages[: k + 1], messages[k + 1 :], request.tools, end)
            return prefix + tokenizer.encode(rest)
    return tokenizer.encode(template.render(messages, request.tools, add_generation_prompt=True))


def _token_label(tokenizer: Tokenizer, token_id: int, as_ids: bool) -> str:
    return f"token_id:{token_id}" if as_ids else tokenizer.piece(token_id)


def _chat_logprobs(tokenizer: Tokenizer, gen: Generation, as_ids: bool) -> dict[str, Any]:
    content = []
    for token_id, logprob, top in zip(gen.token_ids, gen.log_probs, gen.top_logprobs):
        label = _token_label(tokenizer, token_id, as_ids)
        content.append(
            {
                "token": label,
                "logprob": logprob,
                "bytes": list(tokenizer.piece(token_id).encode()),
                "top_logprobs": [
                    {"token": _token_label(tokenizer, t, as_ids), "logprob": lp, "bytes": list(tokenizer.piece(t).encode())}
                    for t, lp in top
                ],
            }
        )
    return {"content": content}


def _usage(gen: Generation) -> dict[str, int]:
    return {
        "prompt_tokens": len(gen.prompt_token_ids),
        "completion_tokens": len(gen.token_ids),
        "total_tokens": len(gen.prompt_token_ids) + len(gen.token_ids),
    }


class PolicyLoadRequest(BaseModel):
    gguf: str
    version: int


EngineLoader = Callable[[Path], list[LlamaEngine]]


def _stamp(target: dict[str, Any], gen: Generation) -> None:
    if gen.policy_version is not None:
        target["policy_version"] = gen.policy_version


def _readable_gguf(path: Path) -> None:
    """A one-line PolicyLoadError unless `path` is a readable file that starts like a GGUF."""
    try:
        with path.open("rb") as file:
            magic = file.read(4)
    except OSError as e:
        raise PolicyLoadError(f"cannot read {path}: {e.strerror or e}") from None
    if magic != b"GGUF":
        raise PolicyLoadError(f"{path} is not a GGUF file")


def create_app(pool: EnginePool, served_model_name: str, load_engines: EngineLoader | None = None) -> FastAPI:
    """`load_engines(path)`: engines over another GGUF, made as the pool's were (for ``/policy/load``)."""
    tokenizer = pool.tokenizer
    app = FastAPI(title="nemo-gym-prorl local model server")

    @app.exception_handler(RequestValidationError)
    async def _invalid_request(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0]
        field = ".".join(str(p) for p in first["loc"] if p != "body")
        return JSONResponse(error_body(f"invalid field {field!r}: {first['msg']}", 400, field), status_code=400)

    @app.exception_handler(ContextLengthError)
    async def _too_long(_: Request, exc: ContextLengthError) -> JSONResponse:
        return JSONResponse(error_body(str(exc), 400, "messages"), status_code=400)

    @app.exception_handler(ValueError)
    async def _bad_value(_: Request, exc: ValueError) -> JSONResponse:
        return JSONResponse(error_body(str(exc), 400), status_code=400)

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/policy")
    async def policy() -> dict[str, Any]:
        return {"version": pool.policy_version, "gguf": str(pool.model_path)}

    @app.post("/policy/load")
    async def load_policy(request: PolicyLoadRequest) -> dict[str, Any]:
        if load_engines is None:
            raise PolicyLoadError("this server cannot load new weights")
        path = Path(request.gguf)
        _readable_gguf(path)
        started = time.perf_counter()

        def load() -> list[LlamaEngine]:
            try:
                return load_engines(path)
            except PolicyLoadError:
                raise
            except Exception as e:  # llama.cpp's ValueError, a RuntimeError, MemoryError...: one line, a 400
                why = str(e).splitlines()[0] if str(e) else type(e).__name__
                raise PolicyLoadError(f"cannot load {path}: {why}") from None

        await pool.swap(load, request.version)
        return {"version": request.version, "gguf": str(path), "load_s": round(time.perf_counter() - started, 3)}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {
                    "id": served_model_name,
                    "object": "model",
                    "created": 0,
                    "owned_by": "nemo-gym-prorl",
                    "max_model_len": pool.n_ctx,
                }
            ],
        }

    @app.post("/v1/chat/completions")
    async def chat_completions(request: ChatCompletionRequest) -> dict[str, Any]:
        top = (request.top_logprobs or 0) if request.logprobs else 0
        gen = await pool.generate(chat_prompt_ids(tokenizer, request), request.sampling_params(top))
        message: dict[str, Any] = {"role": "assistant", "content": gen.text}
        finish_reason = gen.finish_reason
        if request.tools and request.tool_choice != "none":
            parsed = parse_hermes(gen.text)
            if parsed.tool_calls:
                message["content"] = parsed.content or None
                message["tool_calls"] = [call.to_openai() for call in parsed.tool_calls]
                finish_reason = "tool_calls" if finish_reason == "stop" else finish_reason
        choice: dict[str, Any] = {"index": 0, "message": message, "finish_reason": finish_reason, "logprobs": None}
        if request.logprobs:
            choice["logprobs"] = _chat_logprobs(tokenizer, gen, request.return_tokens_as_token_ids)
            if request.return_tokens_as_token_ids:
                message["prompt_token_ids"] = gen.prompt_token_ids
                message["generation_token_ids"] = gen.token_ids
                message["generation_log_probs"] = gen.log_probs
        _stamp(message, gen)
        body: dict[str, Any] = {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": served_model_name,
            "choices": [choice],
            "usage": _usage(gen),
        }
        _stamp(body, gen)
        if request.return_token_ids:
            body["prompt_token_ids"] = gen.prompt_token_ids
            choice["token_ids"] = gen.token_ids
        return body

    @app.post("/v1/completions", response_model=None)
    async def completions(request: CompletionRequest) -> dict[str, Any] | StreamingResponse:
        prompt = request.prompt if isinstance(request.prompt, list) else tokenizer.encode(request.prompt, add_bos=True)
        top = request.logprobs or 0
        if request.stream:
            events = _streamed(pool, list(prompt), request.sampling_params(0))
            return StreamingResponse(events, media_type="text/event-stream")
        gen = await pool.generate(list(prompt), request.sampling_params(top))
        choice: dict[str, Any] = {"index": 0, "text": gen.text, "finish_reason": gen.finish_reason, "logprobs": None}
        _stamp(choice, gen)
        if request.logprobs is not None:
            as_ids = request.return_tokens_as_token_ids
            choice["logprobs"] = {
                "tokens": [_token_label(tokenizer, t, as_ids) for t in gen.token_ids],
                "token_logprobs": gen.log_probs,
                "top_logprobs": [{_token_label(tokenizer, t, as_ids): lp for t, lp in top} for top in gen.top_logprobs],
                "text_offset": [],
            }
        body: dict[str, Any] = {
            "id": f"cmpl-{uuid.uuid4().hex}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": served_model_name,
            "choices": [choice],
            "usage": _usage(gen),
        }
        _stamp(body, gen)
        if request.return_token_ids:
            choice["prompt_token_ids"] = gen.prompt_token_ids
            choice["token_ids"] = gen.token_ids
            body["prompt_token_ids"] = gen.prompt_token_ids
        return body

    @app.post("/tokenize")
    async def tokenize(request: TokenizeRequest) -> dict[str, Any]:
        if request.messages is not None:
            text = tokenizer.chat_template.render(request.messages, request.tools, request.add_generation_prompt)
            tokens = tokenizer.encode(text, add_bos=bool(request.add_special_tokens))
        else:
            add = request.add_special_tokens if request.add_special_tokens is not None else True
            tokens = tokenizer.encode(request.prompt or "", add_bos=add)
        return {"count": len(tokens), "max_model_len": pool.n_ctx, "tokens": tokens, "token_strs": None}

    @app.post("/detokenize")
    async def detokenize(request: DetokenizeRequest) -> dict[str, str]:
        return {"prompt": tokenizer.decode(request.tokens)}

    return app


async def _streamed(pool: EnginePool, prompt: list[int], params: SamplingParams) -> AsyncIterator[bytes]:
    """A completion as server-sent events, one token a chunk (its id, its log-prob, its text), then the finish
    reason and the usage; a client that leaves stops the generation after its current token (the pool's weight
    update cuts requests this way, and re-issues them as prompt + the tokens it got)."""
    loop, tokens = asyncio.get_running_loop(), asyncio.Queue[tuple[int, float] | None]()
    generation = asyncio.ensure_future(
        pool.generate(prompt, params, lambda t, lp: loop.call_soon_threadsafe(tokens.put_nowait, (t, lp)))
    )
    generation.add_done_callback(lambda _: tokens.put_nowait(None))  # after every token the thread put
    decoder = StreamDecoder(pool.tokenizer)
    try:
        while (item := await tokens.get()) is not None:
            token, log_prob = item
            choice = {"index": 0, "text": decoder.push(token), "token_ids": [token],
                      "logprobs": {"token_logprobs": [log_prob]}, "finish_reason": None}  # fmt: skip
            if pool.policy_version is not None:  # no swap while this generation holds its engine
                choice["policy_version"] = pool.policy_version
            yield _event({"object": "text_completion", "choices": [choice]})
        gen = generation.result()
        last = {"index": 0, "text": decoder.flush(), "finish_reason": gen.finish_reason}
        yield _event({"object": "text_completion", "choices": [last]})
        yield _event({"choices": [], "usage": _usage(gen)}) + b"data: [DONE]\n\n"
    finally:
        generation.cancel()


def _event(body: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(body).encode() + b"\n\n"


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="OpenAI-compatible llama.cpp server with exact token ids")
    parser.add_argument("--gguf", type=Path, default=None, help="model file; default: SmolLM2-135M-Instruct")
    parser.add_argument("--served-model-name", default="smollm2-135m-instruct")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port")
    parser.add_argument("--n-ctx", type=int, default=8192)
    parser.add_argument("--n-threads", type=int, default=os.cpu_count(), help="default: all cores")
    parser.add_argument("--n-engines", type=int, default=1, help="llama.cpp contexts serving requests in parallel")
    parser.add_argument("--logprobs-mode", choices=["raw_logprobs", "processed_logprobs"], default="raw_logprobs")
    parser.add_argument(
        "--kv-cache-type", choices=["f16", "f32"], default="f16",
        help="f32: attention in fp32 throughout (log-probs that match an unquantized policy's trainer)",
    )  # fmt: skip
    parser.add_argument("--policy-version", type=int, default=None, help="stamped on every generation")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    """Serve until killed; prints ``PRORL_MODEL_SERVER_READY <port>`` once requests are accepted."""
    args = _parse_args(argv)
    gguf = args.gguf or default_gguf()

    def load_engines(path: Path) -> list[LlamaEngine]:
        engines: list[LlamaEngine] = []
        try:
            for _ in range(args.n_engines):
                engines.append(
                    LlamaEngine(
                        path, n_ctx=args.n_ctx, n_threads=args.n_threads, logprobs_mode=args.logprobs_mode,
                        kv_cache_type=args.kv_cache_type,
                    )
                )  # fmt: skip
        except BaseException:
            for engine in engines:
                engine.close()
            raise
        return engines

    sock = socket.create_server((args.host, args.port))
    port = sock.getsockname()[1]

    @asynccontextmanager
    async def announce(_: FastAPI):
        print(f"{READY_LINE} {port}", flush=True)
        yield

    app = create_app(EnginePool(load_engines(gguf), args.policy_version), args.served_model_name, load_engines)
    app.router.lifespan_context = announce
    # Stopped (SIGTERM, or the parent's death signal), a generation in flight is cut within a second instead of run to
    # its end: uvicorn cancels the request, and the engine stops at its next token.
    config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=STOP_GRACE_S)
    uvicorn.Server(config).run(sockets=[sock])


if __name__ == "__main__":
    main()
