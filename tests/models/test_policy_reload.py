"""Policy versions and live weight reloads on the real embedded model server: every generation says which weights
made it, `POST /policy/load` swaps weights without a generation ever spanning two of them, and a bad file leaves
the old weights serving."""

from __future__ import annotations

import asyncio
import itertools
import shutil
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import gguf
import httpx
import pytest

from nemo_gym_prorl.agent.loop import AgentLoop
from nemo_gym_prorl.agent.turns import http_poster, turn_generator
from nemo_gym_prorl.contracts.sampling import SamplingParams
from nemo_gym_prorl.contracts.task import TaskInstance, load_task
from nemo_gym_prorl.envs import make_environment
from nemo_gym_prorl.json_http import JsonHttp
from nemo_gym_prorl.models.launcher import LocalModelConfig, LocalModelServer
from nemo_gym_prorl.models.local_model import default_gguf
from nemo_gym_prorl.models.tokenizer import Tokenizer
from nemo_gym_prorl.service.pipeline import PipelineConfig, Rollout, run_rollouts
from nemo_gym_prorl.tool_calls import tool_call_format

FIRST_VERSION = 1
STORY = {"prompt": "Once upon a time, in a small village by the sea, there lived", "temperature": 1.0}


@pytest.fixture(scope="module")
def other_weights(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default model with its final norm scaled: same vocabulary, other outputs."""
    path = tmp_path_factory.mktemp("weights") / "sharper.gguf"
    shutil.copyfile(default_gguf(), path)
    reader = gguf.GGUFReader(path, "r+")
    (norm,) = [t for t in reader.tensors if t.name == "output_norm.weight"]
    norm.data[:] *= 1.5
    norm.data.flush()
    del reader, norm
    return path


@pytest.fixture(scope="module")
def policy_server() -> Iterator[LocalModelServer]:
    loop = asyncio.new_event_loop()
    server = LocalModelServer(LocalModelConfig(n_ctx=1024, policy_version=FIRST_VERSION))
    loop.run_until_complete(server.__aenter__())
    try:
        yield server
    finally:
        loop.run_until_complete(server.stop())
        loop.close()


_versions = itertools.count(FIRST_VERSION + 1)


@pytest.fixture
async def http(policy_server: LocalModelServer) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=policy_server.base_url.removesuffix("/v1"), timeout=120) as client:
        yield client


async def load(http: httpx.AsyncClient, path: Path) -> dict[str, Any]:
    version = next(_versions)
    response = await http.post("/policy/load", json={"gguf": str(path), "version": version})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["version"] == version and body["gguf"] == str(path) and body["load_s"] >= 0
    return body


async def complete(http: httpx.AsyncClient, **request: Any) -> dict[str, Any]:
    response = await http.post("/v1/completions", json={"logprobs": 0, "return_token_ids": True, **request})
    assert response.status_code == 200, response.text
    return response.json()


def version_of(body: dict[str, Any]) -> int:
    assert body["choices"][0]["policy_version"] == body["policy_version"]
    return body["policy_version"]


async def test_every_generation_carries_the_policy_version(
    http: httpx.AsyncClient, model_http: httpx.AsyncClient
) -> None:
    version = (await http.get("/policy")).json()["version"]
    assert isinstance(version, int)
    completion = await complete(http, prompt="Hello", max_tokens=4, seed=0)
    assert version_of(completion) == version
    chat = await http.post(
        "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "logprobs": True,
              "return_tokens_as_token_ids": True},
    )  # fmt: skip
    body = chat.json()
    assert body["policy_version"] == body["choices"][0]["message"]["policy_version"] == version
    # a server started without a version answers as it always did: no key at all
    plain = (await model_http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2})).json()
    assert "policy_version" not in plain and "policy_version" not in plain["choices"][0]
    plain_chat = (
        await model_http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
    ).json()
    assert "policy_version" not in plain_chat and "policy_version" not in plain_chat["choices"][0]["message"]
    assert (await model_http.get("/policy")).json() == {"version": None, "gguf": str(default_gguf())}


async def test_a_load_changes_the_outputs_and_the_version(http: httpx.AsyncClient, other_weights: Path) -> None:
    request = {**STORY, "max_tokens": 12, "seed": 5}
    first = await load(http, default_gguf())
    before = await complete(http, **request)
    second = await load(http, other_weights)
    after = await complete(http, **request)
    assert (version_of(before), version_of(after)) == (first["version"], second["version"])
    assert after["choices"][0]["token_ids"] != before["choices"][0]["token_ids"]
    assert (await http.get("/policy")).json() == {"version": second["version"], "gguf": str(other_weights)}
    # back to the first weights: the same tokens and log-probs as before, nothing left of the other weights
    third = await load(http, default_gguf())
    again = await complete(http, **request)
    assert version_of(again) == third["version"]
    assert again["choices"][0]["token_ids"] == before["choices"][0]["token_ids"]
    assert again["choices"][0]["logprobs"]["token_logprobs"] == before["choices"][0]["logprobs"]["token_logprobs"]


async def test_a_generation_in_flight_finishes_on_the_old_weights_and_later_requests_wait_for_the_new(
    http: httpx.AsyncClient, other_weights: Path
) -> None:
    long = {**STORY, "max_tokens": 120, "seed": 11}
    short = {"prompt": "The capital of France is", "max_tokens": 6, "seed": 2}
    old = await load(http, default_gguf())
    reference = await complete(http, **long)  # the whole generation on the old weights, alone
    assert reference["choices"][0]["finish_reason"] == "length"

    in_flight = asyncio.create_task(complete(http, **long))
    await asyncio.sleep(0.15)  # it is generating now: 120 tokens take over a second here
    load_sent = time.perf_counter()
    loading = asyncio.create_task(load(http, other_weights))
    await asyncio.sleep(0.05)
    waiting = asyncio.create_task(complete(http, **short))  # arrives while the load waits for the running one

    finished = await in_flight
    in_flight_done = time.perf_counter()
    new = await loading
    waited = await waiting
    assert in_flight_done > load_sent  # it really was running when the load came
    assert version_of(finished) == old["version"]
    assert finished["choices"][0]["token_ids"] == reference["choices"][0]["token_ids"]  # no token of the new weights
    assert finished["choices"][0]["logprobs"]["token_logprobs"] == reference["choices"][0]["logprobs"]["token_logprobs"]
    assert version_of(waited) == new["version"]
    on_new = await complete(http, **short)
    assert waited["choices"][0]["token_ids"] == on_new["choices"][0]["token_ids"]


async def test_a_bad_path_is_a_400_and_the_old_weights_keep_serving(http: httpx.AsyncClient, tmp_path: Path) -> None:
    current = await load(http, default_gguf())
    request = {**STORY, "max_tokens": 8, "seed": 3}
    before = await complete(http, **request)
    not_gguf = tmp_path / "notes.txt"
    not_gguf.write_text("not a model\n")
    truncated = tmp_path / "truncated.gguf"
    with default_gguf().open("rb") as source:
        truncated.write_bytes(source.read(1 << 20))  # a GGUF header whose tensors are missing
    for path, words in [
        (tmp_path / "missing.gguf", "No such file"),
        (not_gguf, "not a GGUF file"),
        (truncated, "cannot load"),
        (tmp_path, "Is a directory"),
    ]:
        response = await http.post("/policy/load", json={"gguf": str(path), "version": 999})
        assert response.status_code == 400, response.text
        message = response.json()["error"]["message"]
        assert words in message and str(path) in message and "\n" not in message
    assert (await http.get("/policy")).json() == {"version": current["version"], "gguf": str(default_gguf())}
    after = await complete(http, **request)
    assert version_of(after) == current["version"]
    assert after["choices"][0]["token_ids"] == before["choices"][0]["token_ids"]


@pytest.mark.parametrize("mode", ["tokens", "chat"])
async def test_the_agent_loop_records_the_policy_version_on_each_assistant_message(
    http: httpx.AsyncClient, policy_server: LocalModelServer, tokenizer: Tokenizer, mode: str
) -> None:
    version = (await load(http, default_gguf()))["version"]
    task = load_task("math/arithmetic")
    instance = TaskInstance(instance_id="t1", data={"id": "t1", "question": "Calculate 6 * 7.", "answer": "42"})
    client = JsonHttp(timeout_s=120)
    try:
        sampling = SamplingParams(max_tokens=24, seed=1)
        generator = turn_generator(mode, http_poster(client, policy_server.base_url), "local", sampling, tokenizer)
        loop = AgentLoop(generator, tool_call_format("hermes"), max_turns=2)
        rollout = Rollout(env=make_environment(task, "bwrap"), agent=loop, instance=instance)
        (trajectory,) = await run_rollouts([rollout], PipelineConfig())
    finally:
        await client.aclose()
    turns = trajectory.assistant_turns()
    assert trajectory.critical_error is None and len(turns) == 2
    assert [turn["policy_version"] for turn in turns] == [version, version]
