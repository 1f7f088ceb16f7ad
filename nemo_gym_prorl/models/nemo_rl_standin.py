"""A stand-in for NeMo RL's vLLM HTTP server (``vllm_worker_async.py``, ``expose_http_server: true``) in front of a
real OpenAI-compatible model server that speaks NeMo RL's token fields (our local llama.cpp server).

Only ``/v1/chat/completions`` and ``/tokenize``; the served model name checked; NeMo RL's sampling asserts as bare
HTTP 500s; earlier turns' token ids spliced back; a prompt that fills ``max_model_len`` refused.

    python -m nemo_gym_prorl.models.nemo_rl_standin --upstream http://127.0.0.1:8000/v1 --served-model-name policy \\
        --temperature 1.0 --top-p 1.0 --max-model-len 2048

Design notes (what a client of NeMo RL's server meets): docs/nemo-rl.md#modelsnemo_rl_standinpy
"""

from __future__ import annotations

import argparse
import socket
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import orjson
import uvicorn
from fastapi import FastAPI, Request, Response
from pydantic import BaseModel

from nemo_gym_prorl.models.local_model import default_gguf
from nemo_gym_prorl.models.openai_api import ChatCompletionRequest
from nemo_gym_prorl.models.server import READY_LINE, chat_prompt_ids
from nemo_gym_prorl.models.tokenizer import Tokenizer


class PolicySampling(BaseModel):
    """NeMo RL's ``policy.generation`` sampling: requests must match the train pair or the validation pair."""

    temperature: float = 1.0
    top_p: float = 1.0
    val_temperature: float = 1.0
    val_top_p: float = 1.0


def _json(body: dict[str, Any], status: int = 200) -> Response:
    return Response(orjson.dumps(body), status_code=status, media_type="application/json")


def _error(message: str, kind: str, status: int) -> Response:
    return _json({"error": {"message": message, "type": kind, "param": None, "code": status}}, status)


def create_nemo_rl_standin_app(
    upstream: str, tokenizer: Tokenizer, served_model_name: str, sampling: PolicySampling, max_model_len: int
) -> FastAPI:
    """`upstream`: the ``/v1`` base of the model server behind it. ``app.state.requests`` counts requests by route
    and ``app.state.models`` by the model they named (for tests; no route serves them)."""
    upstream = upstream.rstrip("/")
    root = upstream.removesuffix("/v1")

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with httpx.AsyncClient(timeout=600, trust_env=False) as client:
            app.state.client = client
            yield

    app = FastAPI(title="NeMo RL vLLM HTTP server stand-in", lifespan=lifespan)
    app.state.requests = Counter()
    app.state.models = Counter()

    async def forward(url: str, body: dict[str, Any]) -> Response:
        answer = await app.state.client.post(url, json=body)
        return Response(answer.content, status_code=answer.status_code, media_type="application/json")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        body = orjson.loads(await request.body())
        app.state.requests["/v1/chat/completions"] += 1
        app.state.models[body.get("model")] += 1
        if body.get("model") != served_model_name:
            return _error(f"The model `{body.get('model')}` does not exist.", "NotFoundError", 404)
        # NeMo RL checks these with asserts in the route: an AssertionError, which Starlette answers with a 500.
        top_k = body.get("top_k")
        assert top_k in (None, -1), f"Top k sampling parameter must be unset, empty, or -1. Got `{top_k}`"
        assert body.get("top_p") is not None, "top_p must be set explicitly on NeMo-RL requests"
        pair = (body.get("temperature", 1.0), body["top_p"])
        assert pair in ((sampling.temperature, sampling.top_p), (sampling.val_temperature, sampling.val_top_p)), (
            f"request sampling (temperature={pair[0]}, top_p={pair[1]}) matches neither the train nor the validation "
            "sampling params"
        )
        if body.get("logprobs") and body.get("return_tokens_as_token_ids") and body.get("top_logprobs") is None:
            message = "`top_logprobs` must be set when requesting token information from the NeMo-RL chat endpoint."
            return _error(message, "BadRequestError", 400)
        prompt = chat_prompt_ids(tokenizer, ChatCompletionRequest.model_validate(body))
        room = max_model_len - len(prompt)
        if room <= 0:
            message = (
                f"Prompt length ({len(prompt)}) fills or exceeds max_model_len ({max_model_len}). "
                "No room for output tokens."
            )
            return _error(message, "BadRequestError", 400)
        key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
        if body.get(key) is not None:
            body[key] = min(body[key], room)
        return await forward(f"{upstream}/chat/completions", body)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        app.state.requests["/tokenize"] += 1
        return await forward(f"{root}/tokenize", orjson.loads(await request.body()))

    return app


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="NeMo RL's vLLM HTTP server, stood in for in front of a real one")
    parser.add_argument("--upstream", required=True, help="the /v1 base of a model server with NeMo RL's token fields")
    parser.add_argument("--served-model-name", default="policy")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--max-model-len", type=int, default=8192)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args(argv)
    sampling = PolicySampling(
        temperature=args.temperature, top_p=args.top_p, val_temperature=args.temperature, val_top_p=args.top_p
    )
    app = create_nemo_rl_standin_app(
        args.upstream, Tokenizer.from_gguf(default_gguf()), args.served_model_name, sampling, args.max_model_len
    )
    sock = socket.create_server((args.host, args.port))
    print(f"{READY_LINE} {sock.getsockname()[1]}", flush=True)
    uvicorn.Server(uvicorn.Config(app, log_level="warning")).run(sockets=[sock])


if __name__ == "__main__":
    main()
