"""Token generation on llama.cpp with the log-prob of every sampled token.

llama-cpp-python only returns log-probs with ``logits_all=True``, which computes the logits of every prompt
position and costs ~3.5x in speed. We instead read the logits of the last position after each decode (the only
ones llama.cpp computes by default) and sample in numpy, so the log-prob of each sampled token is exact and free.

One engine owns one llama.cpp context and is not thread-safe; `EnginePool` hands engines to requests, preferring
the idle engine whose KV cache already holds the longest prefix of the prompt (multi-turn rollouts re-send the
whole conversation every turn). The pool can swap in engines over new weights (a trainer's policy after a step)
without any generation seeing two weight sets, and stamps each generation with the version of the weights that
made it.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import llama_cpp
import numpy as np

from nemo_gym_prorl.contracts.sampling import SamplingParams
from nemo_gym_prorl.models.llama_log import route_llama_logs
from nemo_gym_prorl.models.tokenizer import Tokenizer

LogprobsMode = Literal["raw_logprobs", "processed_logprobs"]
KvCacheType = Literal["f16", "f32"]
_KV_CACHE_TYPES: dict[str, int] = {"f16": llama_cpp.GGML_TYPE_F16, "f32": llama_cpp.GGML_TYPE_F32}

# Tokens whose logit is this far below the best have probability < e^-30 relative to it: never kept by top-p.
_NEGLIGIBLE_LOGIT_GAP = 30.0


class ContextLengthError(ValueError):
    """The prompt plus the requested completion do not fit the context window."""


@dataclass
class Generation:
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    text: str = ""
    finish_reason: Literal["stop", "length", "abort"] = "length"
    policy_version: int | None = None  # the pool's version of the weights that generated it


TokenSink = Callable[[int, float], None]
"""Sees a generation's tokens one by one: (token id, log-prob)."""


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits - logits.max()
    return shifted - np.log(np.exp(shifted).sum())


def _truncation_mask(scaled: np.ndarray, top_p: float, top_k: int) -> np.ndarray | None:
    """Indices that survive top-k/top-p, best first; None when nothing is truncated."""
    if top_p >= 1.0 and top_k <= 0:
        return None
    candidates = np.flatnonzero(scaled > scaled.max() - _NEGLIGIBLE_LOGIT_GAP)
    order = candidates[np.argsort(-scaled[candidates], kind="stable")]
    if top_k > 0:
        order = order[:top_k]
    if top_p < 1.0:
        probs = np.exp(scaled[order] - scaled[order[0]])
        cumulative = np.cumsum(probs) / probs.sum()
        order = order[: int(np.searchsorted(cumulative, top_p)) + 1]
    return order


class LlamaEngine:
    def __init__(
        self,
        model_path: str | Path,
        n_ctx: int = 8192,
        n_threads: int | None = None,
        n_batch: int = 512,
        logprobs_mode: LogprobsMode = "raw_logprobs",
        kv_cache_type: KvCacheType = "f16",
    ) -> None:
        """`kv_cache_type` f32 keeps attention in fp32 throughout (an f16 cache rounds every key and value, and
        the query with them): what an unquantized policy needs for log-probs that match its trainer's."""
        route_llama_logs()
        kv_type = _KV_CACHE_TYPES[kv_cache_type]
        self.llama = llama_cpp.Llama(
            model_path=str(model_path),
            n_ctx=n_ctx,
            n_threads=n_threads,
            n_threads_batch=n_threads,
            n_batch=n_batch,
            logits_all=False,
            flash_attn=False,
            type_k=kv_type,
            type_v=kv_type,
            verbose=False,
        )
        self.model_path = Path(model_path)
        self.tokenizer = Tokenizer(self.llama)
        self.n_ctx = n_ctx
        self.logprobs_mode = logprobs_mode
        self._n_vocab = self.llama.n_vocab()

    def close(self) -> None:
        """Free the llama.cpp context and model now (not when the garbage collector gets to them)."""
        self.llama.close()

    def cached_prefix_len(self, prompt: list[int]) -> int:
        cached = self.llama.input_ids[: self.llama.n_tokens]
        n = min(len(cached), len(prompt))
        if n == 0:
            return 0
        mismatch = np.flatnonzero(cached[:n] != np.asarray(prompt[:n], dtype=cached.dtype))
        return int(mismatch[0]) if mismatch.size else n

    def check_fits(self, prompt: list[int], max_tokens: int | None) -> int:
        """The completion budget for `prompt`; ContextLengthError (vLLM's wording) when it does not fit."""
        budget = self.n_ctx - len(prompt)
        wanted = max_tokens if max_tokens is not None else max(budget, 1)
        if len(prompt) + wanted > self.n_ctx:
            raise ContextLengthError(
                f"This model's maximum context length is {self.n_ctx} tokens. However, you requested "
                f"{len(prompt) + wanted} tokens ({len(prompt)} in the messages, {wanted} in the completion). "
                "Please reduce the length of the messages or completion."
            )
        return wanted

    def _decode_last(self, tokens: list[int]) -> np.ndarray:
        self.llama.eval(tokens)
        return np.ctypeslib.as_array(self.llama._ctx.get_logits(), shape=(self._n_vocab,)).copy()

    def generate(
        self, prompt: list[int], params: SamplingParams, abort: threading.Event | None = None,
        on_token: TokenSink | None = None,
    ) -> Generation:  # fmt: skip
        """`on_token` sees each sampled token and its log-prob as it comes (a stream), from this thread."""
        if not prompt:
            raise ValueError("prompt is empty")
        if min(prompt) < 0 or max(prompt) >= self._n_vocab:
            raise ValueError(f"prompt holds token ids outside the vocabulary [0, {self._n_vocab})")
        max_tokens = self.check_fits(prompt, params.max_tokens)
        rng = np.random.default_rng(params.seed)
        reuse = min(self.cached_prefix_len(prompt), len(prompt) - 1)  # the last prompt token must run for logits
        self.llama.n_tokens = reuse
        logits = self._decode_last(prompt[reuse:])
        out = Generation(prompt_token_ids=list(prompt))
        text = b""
        while True:
            token, logprob, top = self._sample(logits, params, rng)
            out.token_ids.append(token)
            out.log_probs.append(logprob)
            out.top_logprobs.append(top)
            if on_token is not None:
                on_token(token, logprob)
            if self.tokenizer.is_end_of_generation(token):
                out.finish_reason = "stop"
                break
            if params.stop:
                text += self.llama._model.token_to_piece(token).rstrip(b"\0")
                if self._truncate_at_stop(out, text, params.stop):
                    return out
            if len(out.token_ids) >= max_tokens:
                out.finish_reason = "length"
                break
            if abort is not None and abort.is_set():
                out.finish_reason = "abort"
                break
            logits = self._decode_last([token])
        out.text = self.tokenizer.decode(out.token_ids)
        return out

    @staticmethod
    def _truncate_at_stop(out: Generation, text: bytes, stops: list[str]) -> bool:
        decoded = text.decode("utf-8", errors="ignore")
        hits = [i for i in (decoded.find(s) for s in stops) if i >= 0]
        if not hits:
            return False
        out.text = decoded[: min(hits)]
        out.finish_reason = "stop"
        return True

    def _sample(
        self, logits: np.ndarray, params: SamplingParams, rng: np.random.Generator
    ) -> tuple[int, float, list[tuple[int, float]]]:
        greedy = params.temperature == 0
        scaled = logits if greedy else logits / params.temperature
        kept = _truncation_mask(scaled, params.top_p, params.top_k)
        if greedy:
            token = int(np.argmax(logits))
        else:
            pool = kept if kept is not None else np.arange(self._n_vocab)
            weights = np.exp(scaled[pool] - scaled[pool].max())
            cdf = np.cumsum(weights)
            token = int(pool[min(int(np.searchsorted(cdf, rng.random() * cdf[-1])), len(pool) - 1)])
        if self.logprobs_mode == "raw_logprobs" or greedy:
            logprobs = _log_softmax(logits)
        elif kept is None:
            logprobs = _log_softmax(scaled)
        else:
            logprobs = np.full_like(scaled, -np.inf)
            logprobs[kept] = _log_softmax(scaled[kept])
        top: list[tuple[int, float]] = []
        if params.top_logprobs:
            best = np.argpartition(-logprobs, params.top_logprobs)[: params.top_logprobs]
            best = best[np.argsort(-logprobs[best])]
            top = [(int(i), float(logprobs[i])) for i in best]
        return token, float(logprobs[token]), top


class PolicyLoadError(ValueError):
    """New weights that cannot serve: not a readable GGUF, or another vocabulary."""


class EnginePool:
    """Hands each request an idle engine, best KV-cache prefix first; generation runs in a worker thread.

    The pool's tokenizer is its own (the vocabulary of the first engines' GGUF), so it outlives any engine swap.
    `policy_version` is stamped on every generation; `swap` replaces the engines and the version together."""

    def __init__(self, engines: list[LlamaEngine], policy_version: int | None = None) -> None:
        if not engines:
            raise ValueError("an engine pool needs at least one engine")
        self.engines = engines
        self.policy_version = policy_version
        self.tokenizer = Tokenizer.from_gguf(engines[0].model_path)
        self._idle = list(engines)
        self._available = asyncio.Condition()
        self._swapping = False
        self._swap_lock = asyncio.Lock()

    @property
    def n_ctx(self) -> int:
        return self.engines[0].n_ctx

    @property
    def model_path(self) -> Path:
        return self.engines[0].model_path

    async def generate(
        self, prompt: list[int], params: SamplingParams, on_token: TokenSink | None = None
    ) -> Generation:
        """The generation; `on_token` (called in the engine's thread) sees each token as it is sampled. Cancelled,
        the engine stops after its current token."""
        self.engines[0].check_fits(prompt, params.max_tokens)
        async with self._available:
            await self._available.wait_for(lambda: not self._swapping and bool(self._idle))
            engine = max(self._idle, key=lambda e: e.cached_prefix_len(prompt))
            self._idle.remove(engine)
            version = self.policy_version  # the engine's weights stay until it is back: no swap before that
        abort = threading.Event()
        loop = asyncio.get_running_loop()
        future = loop.run_in_executor(None, engine.generate, prompt, params, abort, on_token)
        # The engine goes back only when its thread is really done, even if the request was cancelled.
        future.add_done_callback(lambda _: loop.create_task(self._release(engine)))
        try:
            gen = await asyncio.shield(future)
        except asyncio.CancelledError:
            abort.set()
            raise
        gen.policy_version = version
        return gen

    async def _release(self, engine: LlamaEngine) -> None:
        async with self._available:
            self._idle.append(engine)
            self._available.notify_all()  # a swap waits for all engines, requests for one

    async def swap(self, load: Callable[[], list[LlamaEngine]], policy_version: int | None) -> None:
        """Serve from the engines `load` makes (in a worker thread) as `policy_version`. From the call on, new
        generations wait; the ones running finish on the old engines, which are freed once all are idle. If `load`
        fails, or makes engines of another vocabulary, the old engines go on serving and the error is raised."""
        async with self._swap_lock:
            async with self._available:
                self._swapping = True
            new: list[LlamaEngine] = []
            try:
                new = await asyncio.to_thread(load)
                self._check_compatible(new)
                async with self._available:
                    await self._available.wait_for(lambda: len(self._idle) == len(self.engines))
                    old, self.engines, self._idle, new = self.engines, new, list(new), []
                    self.policy_version = policy_version
            finally:
                async with self._available:
                    self._swapping = False
                    self._available.notify_all()
                if new:  # not swapped in (failed, or cancelled while waiting)
                    await asyncio.to_thread(_close_all, new)
            await asyncio.to_thread(_close_all, old)

    def _check_compatible(self, engines: list[LlamaEngine]) -> None:
        if not engines:
            raise PolicyLoadError("no engines were loaded")
        theirs, ours = engines[0].tokenizer, self.tokenizer
        if (theirs.vocab_size, theirs.bos_token_id, theirs.eos_token_id) != (
            ours.vocab_size, ours.bos_token_id, ours.eos_token_id,
        ) or theirs.chat_template.source != ours.chat_template.source:  # fmt: skip
            raise PolicyLoadError(
                f"{engines[0].model_path} has another vocabulary or chat template than the served model "
                f"({self.model_path}): new weights must keep the tokenizer"
            )


def _close_all(engines: list[LlamaEngine]) -> None:
    for engine in engines:
        engine.close()
