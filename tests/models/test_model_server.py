"""The embedded model server against the real llama.cpp model: token fields, splicing, limits, concurrency."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import llama_cpp
import numpy as np
import pytest
from conftest import TEST_N_CTX

from nemo_gym_prorl.agent.llm_pool import LLMPool, LLMPoolConfig
from nemo_gym_prorl.contracts.trajectory import contiguity_violation
from nemo_gym_prorl.models.launcher import LocalModelServer
from nemo_gym_prorl.models.local_model import default_gguf
from nemo_gym_prorl.models.tokenizer import Tokenizer

TOKEN_REQUEST = {"logprobs": True, "return_tokens_as_token_ids": True, "temperature": 1.0, "max_tokens": 24}


async def chat(http: httpx.AsyncClient, messages: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    response = await http.post("/v1/chat/completions", json={"messages": messages, **TOKEN_REQUEST, **extra})
    assert response.status_code == 200, response.text
    return response.json()


async def test_chat_returns_nemo_rl_token_fields_on_the_message(model_http: httpx.AsyncClient) -> None:
    messages = [{"role": "user", "content": "Say hello."}]
    body = await chat(model_http, messages, seed=1)
    message = body["choices"][0]["message"]
    tokenized = (await model_http.post("/tokenize", json={"messages": messages})).json()["tokens"]
    assert message["prompt_token_ids"] == tokenized
    assert len(message["generation_token_ids"]) == len(message["generation_log_probs"]) > 0
    assert all(lp <= 0 for lp in message["generation_log_probs"])
    content = body["choices"][0]["logprobs"]["content"]
    assert [c["token"] for c in content] == [f"token_id:{t}" for t in message["generation_token_ids"]]
    assert body["usage"]["completion_tokens"] == len(message["generation_token_ids"])


async def test_return_token_ids_gives_vllm_fields(model_http: httpx.AsyncClient) -> None:
    response = await model_http.post(
        "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "Count to three."}], "max_tokens": 8, "return_token_ids": True},
    )
    body = response.json()
    assert body["prompt_token_ids"][:1] == [1]  # <|im_start|>
    assert len(body["choices"][0]["token_ids"]) == body["usage"]["completion_tokens"]
    assert "generation_token_ids" not in body["choices"][0]["message"]  # only with logprobs + token-id strings


async def test_three_turn_splice_keeps_exact_earlier_tokens(model_http: httpx.AsyncClient) -> None:
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Name a color."}]
    turns = []
    for i, follow_up in enumerate(["Another one.", "And a third."]):
        message = (await chat(model_http, messages, seed=10 + i))["choices"][0]["message"]
        turns.append(message)
        # A client may re-render the text differently; the ids it echoes back must win.
        messages += [{**message, "content": message["content"] + " (edited)"}, {"role": "user", "content": follow_up}]
    turns.append((await chat(model_http, messages, seed=12))["choices"][0]["message"])
    assert contiguity_violation(turns) is None
    second_prefix = turns[0]["prompt_token_ids"] + turns[0]["generation_token_ids"]
    assert turns[1]["prompt_token_ids"][: len(second_prefix)] == second_prefix


async def test_prompt_past_context_window_is_400_naming_context_length(model_http: httpx.AsyncClient) -> None:
    long = [{"role": "user", "content": "word " * (TEST_N_CTX + 100)}]
    response = await model_http.post("/v1/chat/completions", json={"messages": long, "max_tokens": 8})
    assert response.status_code == 400
    assert "context length" in response.json()["error"]["message"]
    # prompt that fits but prompt + max_tokens does not: refused the same way, as vLLM does
    response = await model_http.post("/v1/completions", json={"prompt": [1] * 100, "max_tokens": TEST_N_CTX})
    assert response.status_code == 400 and "context length" in response.text


async def test_concurrent_requests_each_get_their_own_answer(model_http: httpx.AsyncClient) -> None:
    prompts = [f"Write a word that starts with {letter}." for letter in "abcd"]
    sequential = [await chat(model_http, [{"role": "user", "content": p}], seed=7) for p in prompts]
    concurrent = await asyncio.gather(*(chat(model_http, [{"role": "user", "content": p}], seed=7) for p in prompts))
    for alone, together in zip(sequential, concurrent):
        assert alone["choices"][0]["message"]["generation_token_ids"] == together["choices"][0]["message"]["generation_token_ids"]


async def test_sampling_parameters_are_honoured(model_http: httpx.AsyncClient) -> None:
    messages = [{"role": "user", "content": "Tell me a story."}]
    first = await chat(model_http, messages, seed=3, max_tokens=12)
    again = await chat(model_http, messages, seed=3, max_tokens=12)
    other = await chat(model_http, messages, seed=4, max_tokens=12)
    ids = lambda body: body["choices"][0]["message"]["generation_token_ids"]  # noqa: E731
    assert ids(first) == ids(again) != ids(other)
    assert len(ids(first)) == 12 and first["choices"][0]["finish_reason"] == "length"
    greedy = [await chat(model_http, messages, temperature=0.0, seed=s, max_tokens=12) for s in (1, 2)]
    assert ids(greedy[0]) == ids(greedy[1])
    stopped = (await model_http.post("/v1/completions", json={"prompt": "1, 2, 3, 4,", "max_tokens": 30, "temperature": 0, "stop": ["7"]})).json()
    assert stopped["choices"][0]["finish_reason"] == "stop" and "7" not in stopped["choices"][0]["text"]


async def test_completions_accept_token_id_prompts(model_http: httpx.AsyncClient, tokenizer: Tokenizer) -> None:
    prompt = tokenizer.encode(tokenizer.chat_template.render([{"role": "user", "content": "Hi"}], add_generation_prompt=True))
    body = (
        await model_http.post(
            "/v1/completions",
            json={"prompt": prompt, "max_tokens": 10, "logprobs": 0, "return_token_ids": True, "seed": 5},
        )
    ).json()
    choice = body["choices"][0]
    assert choice["prompt_token_ids"] == prompt == body["prompt_token_ids"]
    assert len(choice["token_ids"]) == len(choice["logprobs"]["token_logprobs"])
    assert choice["text"] == tokenizer.decode(choice["token_ids"])


async def test_a_streamed_completion_is_the_unstreamed_one_token_by_token(
    model_http: httpx.AsyncClient, tokenizer: Tokenizer
) -> None:
    prompt = tokenizer.encode(tokenizer.chat_template.render([{"role": "user", "content": "Hi"}], add_generation_prompt=True))
    request = {"prompt": prompt, "max_tokens": 12, "logprobs": 0, "return_token_ids": True, "seed": 7}
    whole = (await model_http.post("/v1/completions", json=request)).json()["choices"][0]
    chunks = []
    async with model_http.stream("POST", "/v1/completions", json=request | {"stream": True}) as streamed:
        assert streamed.headers["content-type"].startswith("text/event-stream")
        async for line in streamed.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line.removeprefix("data: ")))
    choices = [c for chunk in chunks for c in chunk["choices"]]
    assert [t for c in choices for t in c.get("token_ids", [])] == whole["token_ids"]
    assert [lp for c in choices for lp in c.get("logprobs", {}).get("token_logprobs", [])] == pytest.approx(
        whole["logprobs"]["token_logprobs"], abs=1e-5
    )
    assert "".join(c["text"] for c in choices) == whole["text"]
    assert choices[-1]["finish_reason"] == whole["finish_reason"]
    assert chunks[-1]["usage"]["completion_tokens"] == len(whole["token_ids"])
    refused = await model_http.post("/v1/completions", json=request | {"stream": True, "stop": ["\n"]})
    assert refused.status_code == 400 and "stop with stream" in refused.json()["error"]["message"]


async def test_a_weight_update_cuts_a_local_model_request_and_its_re_issue_ends_it_token_faithfully(
    model_server: LocalModelServer, tokenizer: Tokenizer
) -> None:
    """weight_update=cut against the embedded server itself: the request streams, the pause cuts it after the tokens
    it got, and after the resume it is re-issued as prompt + those tokens; greedy, it ends as the uncut one does."""
    chat = [{"role": "user", "content": "Count from 1 to 40, one number a line."}]
    prompt = tokenizer.encode(tokenizer.chat_template.render(chat, add_generation_prompt=True))
    body = {"prompt": prompt, "max_tokens": 40, "temperature": 0, "logprobs": 0, "return_token_ids": True}
    async with LLMPool(LLMPoolConfig(weight_update="cut"), [model_server.base_url]) as pool:
        pool.resume(policy_version=0)
        uncut = (await pool.post("a", "/completions", body))["choices"][0]
        request = asyncio.create_task(pool.post("b", "/completions", body))
        async with asyncio.timeout(60):  # some of its tokens have arrived
            while not any(pool.streamed):
                await asyncio.sleep(0.01)
        await asyncio.wait_for(pool.pause(), 60)
        assert not request.done() and pool.generated.cut == 1 and pool.streamed == []  # cut, waiting for the resume
        pool.resume(policy_version=1)
        cut = (await asyncio.wait_for(request, 120))["choices"][0]
    assert cut["token_ids"] == uncut["token_ids"] and len(cut["logprobs"]["token_logprobs"]) == len(cut["token_ids"])
    assert cut["text"] == uncut["text"] and cut["finish_reason"] == uncut["finish_reason"]
    (before, kept), (after, rest) = cut["version_spans"]  # the tokens before the cut, and those the re-issue made
    assert (before, after) == (0, 1) and kept >= 1 and kept + rest == len(cut["token_ids"])


async def test_tools_are_rendered_into_the_prompt(model_http: httpx.AsyncClient) -> None:
    tool = {"type": "function", "function": {"name": "bash", "description": "run a command", "parameters": {"type": "object", "properties": {}}}}
    tokens = (await model_http.post("/tokenize", json={"messages": [{"role": "user", "content": "ls"}], "tools": [tool]})).json()["tokens"]
    text = (await model_http.post("/detokenize", json={"tokens": tokens})).json()["prompt"]
    assert '"name": "bash"' in text and "<tool_call>" in text


async def test_bad_requests_get_400_naming_the_field(model_http: httpx.AsyncClient) -> None:
    response = await model_http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "temperature": -1})
    assert response.status_code == 400 and "temperature" in response.json()["error"]["message"]
    response = await model_http.post("/v1/completions", json={"prompt": [10**9], "max_tokens": 2})
    assert response.status_code == 400 and "vocabulary" in response.json()["error"]["message"]
    assert (await model_http.get("/health")).status_code == 200
    models = (await model_http.get("/v1/models")).json()
    assert models["data"][0]["max_model_len"] == TEST_N_CTX


def test_log_probs_equal_the_models_own_log_softmax(tokenizer: Tokenizer) -> None:
    """Our per-token log-probs (last-position logits only) match llama.cpp's own ``logits_all`` computation,
    decoded the way sampling decodes (the prompt, then one token at a time: batched decodes of a quantized model
    differ in the last digits, and what counts is the distribution each token was sampled from)."""
    from nemo_gym_prorl.contracts.sampling import SamplingParams
    from nemo_gym_prorl.models.engine import LlamaEngine

    engine = LlamaEngine(default_gguf(), n_ctx=512)
    prompt = tokenizer.encode(tokenizer.chat_template.render([{"role": "user", "content": "Hello!"}], add_generation_prompt=True))
    gen = engine.generate(prompt, SamplingParams(max_tokens=10, temperature=1.0, seed=0))
    reference = llama_cpp.Llama(model_path=str(default_gguf()), n_ctx=512, logits_all=True, verbose=False)
    reference.eval(prompt)
    for token in gen.token_ids[:-1]:
        reference.eval([token])
    logits = np.asarray(reference.scores[: len(prompt) + len(gen.token_ids)], dtype=np.float64)
    expected = []
    for i, token in enumerate(gen.token_ids):
        row = logits[len(prompt) - 1 + i]
        expected.append(row[token] - row.max() - np.log(np.exp(row - row.max()).sum()))
    assert gen.log_probs == pytest.approx(expected, abs=2e-3)
