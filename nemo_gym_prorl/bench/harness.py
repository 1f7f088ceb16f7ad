"""`prorl bench harness`: the time the model proxy adds to a harness's model call, against calling the backend
directly, in one run.

Both sides are the same stdlib client (urllib, a connection per call, as many harnesses make them) in a bubblewrap
sandbox, timing each call itself, against the same fast stand-in backend behind a real LLM pool:
- proxy: the sandbox without network, ``POST /v1/chat/completions`` through the forwarder, the proxy's socket, the
  proxy (template render, tokenize, record) and the pool to the backend's ``/v1/completions``;
- direct: a sandbox with the host's network posting the body the proxy sent to the backend's ``/v1/completions``.
Each call is a fresh two-message conversation (rendered anew each time). Two more sides time the proxy's two hops
with no work of its own: ``GET /v1/models`` through the sandbox's port (the harness's hop), and the pool's post of
the backend body, timed in the proxy's process (its hop to the backend); port + pool - direct is the floor under what
a proxy adds here. Rounds alternate the sides (shuffled, the same order from run to run); the first is warm-up.
Prints p50/p99 per side, the spread of the added p50 over rounds, the floor, the p50 ratio and what the proxy adds,
and last the goal line: at most 2 ms p50 added.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

from nemo_gym_prorl.agent.llm_pool import LLMPool, LLMPoolConfig
from nemo_gym_prorl.contracts.sampling import SamplingParams
from nemo_gym_prorl.contracts.sandbox import Sandbox, SandboxLimits, SandboxSpec
from nemo_gym_prorl.harness.calls import ModelCalls
from nemo_gym_prorl.harness.proxy import ModelProxy
from nemo_gym_prorl.models.launcher import ModelServerProcess
from nemo_gym_prorl.models.local_model import default_gguf
from nemo_gym_prorl.models.standin import standin_argv
from nemo_gym_prorl.models.tokenizer import Tokenizer
from nemo_gym_prorl.sandbox import open_sandbox

REPLY = "The files are a.txt and b.txt."
GOAL_MS = 2.0
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "List the files."}]
SPEC = SandboxSpec(limits=SandboxLimits(memory_mb=512, wall_clock_s=600))

# Times each of N posts of BODY to URL (gets, when BODY is -) itself, prints the times (ms) and the last answer's text.
CLIENT = """
import json, sys, time, urllib.request
url, body, n = sys.argv[1], None if sys.argv[2] == "-" else open(sys.argv[2], "rb").read(), int(sys.argv[3])
times, text = [], None
for _ in range(n):
    started = time.perf_counter()
    request = urllib.request.Request(url, body, {"Content-Type": "application/json", "Authorization": "Bearer x"})
    with urllib.request.urlopen(request, timeout=60) as answer:
        answer = json.load(answer)
    times.append((time.perf_counter() - started) * 1000)
    choice = answer["choices"][0] if "choices" in answer else {"text": answer["data"][0]["id"]}
    text = choice["message"]["content"] if "message" in choice else choice["text"]
print(json.dumps({"ms": times, "text": text}))
"""


@dataclass
class Timed:
    name: str
    rounds: list[list[float]] = field(default_factory=list, kw_only=True)

    @property
    def samples(self) -> list[float]:
        return [ms for round_ in self.rounds for ms in round_]


@dataclass
class Side(Timed):
    """A client in a sandbox, timing its own requests."""

    sandbox: Sandbox
    url: str
    body: dict[str, Any] | None  # None: GET
    expected: str = REPLY

    async def prepare(self) -> None:
        await self.sandbox.write_file("client.py", CLIENT.encode())
        if self.body is not None:
            await self.sandbox.write_file(f"{self.name}.json", json.dumps(self.body).encode())

    async def measure(self, calls: int) -> None:
        body = "-" if self.body is None else f"{self.name}.json"
        result = await self.sandbox.exec(["python3", "client.py", self.url, body, str(calls)], timeout=300)
        if result.exit_code != 0:
            raise RuntimeError(f"{self.name} client failed (exit {result.exit_code}): {result.output[-1000:]}")
        answer = json.loads(result.output)
        if answer["text"] != self.expected:
            raise RuntimeError(f"{self.name} answered {answer['text']!r}, expected {self.expected!r}")
        self.rounds.append(answer["ms"])


@dataclass
class PoolHop(Timed):
    """The proxy's own post to the backend, timed in its process."""

    post: Any
    path: str
    body: dict[str, Any]

    async def measure(self, calls: int) -> None:
        times = []
        for _ in range(calls):
            started = time.perf_counter()
            answer = await self.post(self.path, self.body)
            times.append((time.perf_counter() - started) * 1000)
            if answer["choices"][0]["text"] != REPLY:
                raise RuntimeError(f"the pool's post answered {answer['choices'][0]['text']!r}, expected {REPLY!r}")
        self.rounds.append(times)


class Recorded:
    """The pool's poster, keeping the last body it sent (the direct side posts the same)."""

    def __init__(self, post: Any) -> None:
        self._post = post
        self.last: tuple[str, dict[str, Any]] | None = None

    async def __call__(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        self.last = (path, body)
        return await self._post(path, body)


def p50_p99(samples: list[float]) -> tuple[float, float]:
    return statistics.median(samples), statistics.quantiles(samples, n=100, method="inclusive")[-1]


async def measure(rounds: int, calls: int) -> tuple[list[Side | PoolHop], int]:
    tokenizer = Tokenizer.from_gguf(default_gguf())
    async with contextlib.AsyncExitStack() as stack:
        backend = await stack.enter_async_context(ModelServerProcess(standin_argv([REPLY])))
        pool = await stack.enter_async_context(LLMPool(LLMPoolConfig(health_interval_s=0), [backend.base_url]))
        poster = Recorded(pool.poster("bench-harness"))
        model_calls = ModelCalls(poster, "standin", tokenizer, SamplingParams(temperature=1.0, max_tokens=32))
        proxy = await stack.enter_async_context(ModelProxy(model_calls))
        inside = await stack.enter_async_context(open_sandbox("bwrap", proxy.sandbox_spec(SPEC)))
        await proxy.connect(inside, lifetime_s=SPEC.limits.wall_clock_s)
        body = {"model": "standin", "messages": MESSAGES, "temperature": 0.2}
        proxied = Side("proxy", inside, f"{proxy.base_url}/chat/completions", body)
        hop = Side("port", inside, f"{proxy.base_url}/models", None, expected="standin")
        await proxied.prepare()
        await hop.prepare()
        await proxied.measure(1)  # the body the proxy sends, for the direct side
        assert poster.last is not None
        path, backend_body = poster.last
        outside = await stack.enter_async_context(open_sandbox("bwrap", SPEC.model_copy(update={"network": True})))
        direct = Side("direct", outside, backend.base_url.rstrip("/") + path, backend_body)
        await direct.prepare()
        pool_hop = PoolHop("pool", pool.poster("bench-harness"), path, backend_body)
        sides: list[Side | PoolHop] = [proxied, direct, hop, pool_hop]
        order = random.Random(0)
        for _ in range(rounds + 1):  # round 0: warm-up
            for side in order.sample(sides, len(sides)):
                await side.measure(calls)
        for side in sides:
            del side.rounds[: len(side.rounds) - rounds]
    return sides, len(model_calls.calls)


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="prorl bench harness", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=10, help="rounds, each side once a round (after one warm-up)")
    parser.add_argument("--calls", type=int, default=50, help="model calls per side and round")
    args = parser.parse_args(argv)
    (proxied, direct, hop, pool_hop), recorded = asyncio.run(measure(args.rounds, args.calls))
    expected = 1 + (args.rounds + 1) * args.calls
    if recorded != expected:
        raise RuntimeError(f"the proxy recorded {recorded} calls, expected {expected}")
    print(f"harness proxy: {args.rounds} rounds x {args.calls} calls a side, stand-in backend, {recorded} calls recorded")
    for side in (direct, proxied, hop, pool_hop):
        p50, p99 = p50_p99(side.samples)
        print(f"  {side.name:<7} p50 {p50:6.2f} ms  p99 {p99:6.2f} ms  ({len(side.samples)} calls)")
    print("  (port: GET /v1/models through the sandbox's port; pool: the proxy's post to the backend, in its process)")
    per_round = sorted(statistics.median(p) - statistics.median(d) for p, d in zip(proxied.rounds, direct.rounds))
    print(f"added p50 per round: {per_round[0]:+.2f} .. {per_round[-1]:+.2f} ms (median {statistics.median(per_round):+.2f})")
    (proxy_p50, proxy_p99), (direct_p50, direct_p99) = p50_p99(proxied.samples), p50_p99(direct.samples)
    floor = statistics.median(hop.samples) + statistics.median(pool_hop.samples) - direct_p50
    print(f"floor, the two hops with no work of the proxy's (port + pool - direct, p50): {floor:+.2f} ms")
    added = proxy_p50 - direct_p50
    print(f"proxy vs direct (p50): {proxy_p50 / direct_p50:.2f}x; added per call: p50 {added:+.2f} ms, p99 {proxy_p99 - direct_p99:+.2f} ms")
    print(f"goal <= {GOAL_MS:g} ms p50 added: {'met' if added <= GOAL_MS else 'not met'} ({added:.2f} ms)")
