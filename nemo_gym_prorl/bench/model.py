"""Model server tokens/s against bare llama_cpp, same model, same prompt, same threads, in one run.

The baseline is ``Llama.create_completion`` in-process (no HTTP, no log-probs). Ours is the embedded server over
HTTP, returning token ids and the log-prob of every sampled token. Runs alternate so both see the same machine.
The last line is the ratio (goal >= 0.9x).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time

import httpx
import llama_cpp

from nemo_gym_prorl.models.launcher import LocalModelConfig, LocalModelServer
from nemo_gym_prorl.models.local_model import default_gguf
from nemo_gym_prorl.models.tokenizer import Tokenizer

PROMPT = "Write a long, detailed story about a lighthouse keeper who finds a message in a bottle."


def _bare_tokens_per_s(llama: llama_cpp.Llama, prompt: list[int], max_tokens: int, seed: int) -> tuple[float, int]:
    started = time.perf_counter()
    out = llama.create_completion(prompt, max_tokens=max_tokens, temperature=1.0, top_p=1.0, top_k=0, min_p=0.0, seed=seed)
    elapsed = time.perf_counter() - started
    n = out["usage"]["completion_tokens"]
    return n / elapsed, n


async def _ours_tokens_per_s(http: httpx.AsyncClient, url: str, prompt: list[int], max_tokens: int, seed: int) -> tuple[float, int]:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 1.0, "seed": seed, "logprobs": 0, "return_token_ids": True}
    started = time.perf_counter()
    response = await http.post(url, json=body)
    elapsed = time.perf_counter() - started
    response.raise_for_status()
    n = response.json()["usage"]["completion_tokens"]
    return n / elapsed, n


async def _run(rounds: int, max_tokens: int, n_ctx: int, n_threads: int) -> None:
    gguf = default_gguf()
    tokenizer = Tokenizer.from_gguf(gguf)
    prompt = tokenizer.encode(tokenizer.chat_template.render([{"role": "user", "content": PROMPT}], add_generation_prompt=True))
    bare = llama_cpp.Llama(model_path=str(gguf), n_ctx=n_ctx, n_threads=n_threads, n_threads_batch=n_threads, verbose=False)
    config = LocalModelConfig(n_ctx=n_ctx, n_threads=n_threads)
    bare_rates: list[float] = []
    our_rates: list[float] = []
    async with LocalModelServer(config) as server, httpx.AsyncClient(timeout=600) as http:
        url = f"{server.base_url}/completions"
        await _ours_tokens_per_s(http, url, prompt, 8, 0)  # warm-up, both sides
        _bare_tokens_per_s(bare, prompt, 8, 0)
        for r in range(rounds):
            rate_b, n_b = _bare_tokens_per_s(bare, prompt, max_tokens, seed=r)
            rate_o, n_o = await _ours_tokens_per_s(http, url, prompt, max_tokens, seed=r)
            bare_rates.append(rate_b)
            our_rates.append(rate_o)
            print(f"round {r + 1}/{rounds}: bare llama_cpp {rate_b:6.1f} tok/s ({n_b} tok)   prorl server {rate_o:6.1f} tok/s ({n_o} tok)")
    bare_median, our_median = statistics.median(bare_rates), statistics.median(our_rates)
    print(f"model: {gguf.name}, n_threads={n_threads}, max_tokens={max_tokens}, rounds={rounds}")
    print(f"bare llama_cpp (in-process, no log-probs):       {bare_median:.1f} tok/s (median)")
    print(f"prorl model server (HTTP, token ids + log-probs): {our_median:.1f} tok/s (median)")
    print(f"ratio prorl/bare: {our_median / bare_median:.3f}x (goal >= 0.9x)")


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="prorl bench model")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--n-ctx", type=int, default=2048)
    parser.add_argument("--n-threads", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args(argv)
    asyncio.run(_run(args.rounds, args.max_tokens, args.n_ctx, args.n_threads))
