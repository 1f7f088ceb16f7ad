"""The LLM pool over real HTTP on loopback: least-in-flight routing, trajectory affinity, retries, health, pause.

Stand-in backends are small Starlette apps served by uvicorn in the test's event loop (so a test can hold their
requests on an ``asyncio.Event``); the killed backend is a subprocess; one test goes through our real model server,
one through the streaming stand-in (weight_update=cut).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import pytest
import uvicorn
from conftest import TEST_N_CTX
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from nemo_gym_prorl.agent.llm_pool import BackendState, LLMPool, LLMPoolConfig, LLMUnavailable, normalize_address
from nemo_gym_prorl.agent.turns import ContextLengthExceeded, LLMRequestError
from nemo_gym_prorl.models.launcher import LocalModelServer, ModelServerProcess
from nemo_gym_prorl.models.standin import standin_argv

WAIT = 30.0  # bound on anything a test awaits: generous, the machine is busy
Arrivals = asyncio.Queue[tuple[str, dict[str, Any]]]


def config(**overrides: Any) -> LLMPoolConfig:
    """Quick retries, no background probe (tests call check_health), long request timeouts unless a test wants one."""
    base: dict[str, Any] = {
        "request_timeout_s": WAIT,
        "connect_timeout_s": 5.0,
        "max_retries": 3,
        "backoff_base_s": 0.01,
        "backoff_max_s": 0.05,
        "health_interval_s": 0,
        "wait_for_backend_s": WAIT,
    }
    return LLMPoolConfig(**(base | overrides))


def listening_socket(port: int = 0) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    sock.listen(128)  # connections queue from here on, so the address is usable before uvicorn accepts
    sock.setblocking(False)
    return sock


class _InProcessServer(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:  # leave pytest's signal handlers alone
        yield


class StandIn:
    """An OpenAI-style backend with knobs; every completion request is put on the shared ``arrivals`` queue."""

    def __init__(self, name: str, arrivals: Arrivals) -> None:
        self.name = name
        self.arrivals = arrivals
        self.gate = asyncio.Event()  # completions wait on it; open unless a test closes it
        self.gate.set()
        self.hang = False  # completions never answer (until the server stops)
        self.fail_next = 0  # that many completions answer `fail_status`
        self.fail_status = 500
        self.fail_body: Any = {"error": {"message": "overloaded"}}  # JSON, or text sent as Starlette's own 500
        self.headers: list[dict[str, str]] = []  # each completion request's headers
        self.refusal: str | None = None  # completions answer 400 with this message
        self.completions = 0
        self.stamps: int | None = None  # the version this server stamps on its answers, as ours does
        self.models_down = False  # /v1/models (the health probe) answers 503
        self.port = 0
        self._stopping = asyncio.Event()
        self._server: _InProcessServer | None = None
        self._task: asyncio.Task[None] | None = None

    @property
    def address(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _app(self) -> Starlette:
        async def models(request: Request) -> Response:
            if self.models_down:
                return JSONResponse({"error": {"message": "starting"}}, 503)
            return JSONResponse({"object": "list", "data": [{"id": self.name}]})

        async def complete(request: Request) -> Response:
            body = await request.json()
            self.completions += 1
            self.headers.append(dict(request.headers))
            self.arrivals.put_nowait((self.name, body))
            if self.hang:
                await self._stopping.wait()
                return JSONResponse({"error": {"message": "stopping"}}, 503)
            if self.fail_next:
                self.fail_next -= 1
                if isinstance(self.fail_body, str):
                    return PlainTextResponse(self.fail_body, self.fail_status)
                return JSONResponse(self.fail_body, self.fail_status)
            if self.refusal is not None:
                return JSONResponse({"error": {"message": self.refusal, "code": 400}}, 400)
            await self.gate.wait()
            stamped = {"policy_version": self.stamps} if self.stamps is not None else {}
            message = {"role": "assistant", "content": "ok", **stamped}
            choice = {"text": "ok", "message": message, **stamped}
            return JSONResponse({"backend": self.name, "echo": body, "choices": [choice]})

        post = ["POST"]
        return Starlette(
            routes=[
                Route("/v1/models", models),
                Route("/v1/completions", complete, methods=post),
                Route("/v1/chat/completions", complete, methods=post),
            ]
        )

    async def start(self) -> None:
        """Serve on a fresh port, or on the same port again after ``stop()``."""
        sock = listening_socket(self.port)
        self.port = sock.getsockname()[1]
        self._stopping = asyncio.Event()
        self._server = _InProcessServer(
            uvicorn.Config(self._app(), lifespan="off", log_level="warning", timeout_graceful_shutdown=5)
        )
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]))

    async def stop(self) -> None:
        if self._task is None or self._server is None:
            return
        self._stopping.set()
        self.gate.set()
        self._server.should_exit = True
        await self._task
        self._task = None


@pytest.fixture
def arrivals() -> Arrivals:
    return asyncio.Queue()


@pytest.fixture
async def stand_in(arrivals: Arrivals) -> AsyncIterator[Callable[[str], Awaitable[StandIn]]]:
    started: list[StandIn] = []

    async def start(name: str) -> StandIn:
        backend = StandIn(name, arrivals)
        started.append(backend)
        await backend.start()
        return backend

    try:
        yield start
    finally:
        for backend in reversed(started):
            await backend.stop()


async def arrival(arrivals: Arrivals) -> tuple[str, dict[str, Any]]:
    return await asyncio.wait_for(arrivals.get(), WAIT)


def state(pool: LLMPool, backend: StandIn | str) -> BackendState:
    address = normalize_address(backend.address if isinstance(backend, StandIn) else backend)
    return next(b for b in pool.backends() if b.address == address)


async def one_turn() -> None:
    """One scheduling turn: tasks just created run up to their first real wait (no I/O happens before it)."""
    await asyncio.sleep(0)


async def eventually(predicate: Callable[[], bool]) -> None:
    """Bounded polling, only for what the background health task does on its own schedule."""
    async with asyncio.timeout(WAIT):
        while not predicate():
            await asyncio.sleep(0.05)


async def test_new_trajectories_go_to_least_in_flight_backend_and_stay_there(
    stand_in: Callable[[str], Awaitable[StandIn]], arrivals: Arrivals
) -> None:
    backends = {name: await stand_in(name) for name in "abc"}
    for backend in backends.values():
        backend.gate.clear()
    async with LLMPool(config(), [b.address for b in backends.values()]) as pool:
        tasks, home = {}, {}
        for t in ("t1", "t2", "t3"):
            tasks[t] = asyncio.create_task(pool.post(t, "/completions", {"prompt": t}))
            name, body = await arrival(arrivals)
            assert body["prompt"] == t
            home[t] = name
        assert sorted(home.values()) == ["a", "b", "c"]  # each new trajectory found an idle backend

        backends[home["t2"]].gate.set()
        assert (await tasks.pop("t2"))["backend"] == home["t2"]
        assert state(pool, backends[home["t2"]]).in_flight == 0

        # t1's next turn stays on t1's backend (prefix cache), although t2's backend is idle now
        tasks["t1-turn2"] = asyncio.create_task(pool.post("t1", "/completions", {"prompt": "t1-turn2"}))
        assert await arrival(arrivals) == (home["t1"], {"prompt": "t1-turn2"})
        assert state(pool, backends[home["t1"]]).in_flight == 2

        # a new trajectory goes to the backend with nothing in flight
        assert (await pool.post("t4", "/completions", {"prompt": "t4"}))["backend"] == home["t2"]
        await arrival(arrivals)

        for backend in backends.values():
            backend.gate.set()
        results = await asyncio.gather(*tasks.values())
        assert [r["backend"] for r in results] == [home["t1"], home["t3"], home["t1"]]
        assert pool.in_flight == 0 and all(b.in_flight == 0 for b in pool.backends())


async def test_idle_backends_share_new_trajectories_evenly(stand_in: Callable[[str], Awaitable[StandIn]]) -> None:
    backends = [await stand_in(name) for name in "abc"]
    async with LLMPool(config(), [b.address for b in backends]) as pool:
        for i in range(6):
            await pool.post(f"t{i}", "/completions", {"prompt": i})
        assert [b.completions for b in backends] == [2, 2, 2]
        assert [b.trajectories for b in pool.backends()] == [2, 2, 2]
        pool.release("t0")
        assert sum(b.trajectories for b in pool.backends()) == 5


async def test_in_flight_counters_return_to_zero_after_success_error_and_cancel(
    stand_in: Callable[[str], Awaitable[StandIn]], arrivals: Arrivals
) -> None:
    a = await stand_in("a")
    async with LLMPool(config(max_retries=1), [a.address]) as pool:
        await pool.post("t", "/completions", {"prompt": "ok"})
        assert state(pool, a).in_flight == 0

        a.refusal = "bad request"
        with pytest.raises(LLMRequestError):
            await pool.post("t", "/completions", {"prompt": "refused"})
        assert state(pool, a).in_flight == 0
        a.refusal = None

        a.fail_next, a.fail_status = 2, 503  # both attempts fail
        with pytest.raises(LLMUnavailable, match="HTTP 503"):
            await pool.post("t", "/completions", {"prompt": "failing"})
        assert state(pool, a).in_flight == 0

        a.gate.clear()
        for _ in range(a.completions):
            arrivals.get_nowait()
        task = asyncio.create_task(pool.post("t", "/completions", {"prompt": "cancelled"}))
        await arrival(arrivals)
        assert pool.in_flight == 1 and state(pool, a).in_flight == 1
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert pool.in_flight == 0 and state(pool, a).in_flight == 0
        assert state(pool, a).requests == 5


@pytest.mark.parametrize("status", [500, 503, 429])
async def test_transient_error_is_retried_on_another_backend(
    stand_in: Callable[[str], Awaitable[StandIn]], status: int
) -> None:
    a, b = await stand_in("a"), await stand_in("b")
    async with LLMPool(config(), [a.address]) as pool:
        assert (await pool.post("t", "/completions", {"turn": 1}))["backend"] == "a"
        pool.add(b.address)
        a.fail_next, a.fail_status = 100, status
        assert (await pool.post("t", "/completions", {"turn": 2}))["backend"] == "b"
        assert a.completions == 2 and b.completions == 1
        failing = state(pool, a)
        assert failing.failures == 1 and failing.healthy and str(status) in (failing.last_error or "")
        # the trajectory now lives on the backend that answered
        assert (await pool.post("t", "/completions", {"turn": 3}))["backend"] == "b"
        assert a.completions == 2


async def test_transient_errors_on_the_only_backend_are_retried_until_it_answers(
    stand_in: Callable[[str], Awaitable[StandIn]],
) -> None:
    a = await stand_in("a")
    a.fail_next = 2  # 500s, then an answer: a server error, not the request's
    async with LLMPool(config(max_retries=3), [a.address]) as pool:
        assert (await pool.post("t", "/completions", {}))["backend"] == "a"
        assert a.completions == 3
        assert state(pool, a).failures == 2 and state(pool, a).consecutive_failures == 0


async def test_context_length_400_is_raised_at_once_without_retry(
    stand_in: Callable[[str], Awaitable[StandIn]],
) -> None:
    a, b = await stand_in("a"), await stand_in("b")
    message = "This model's maximum context length is 2048 tokens. However, you requested 4096 tokens."
    a.refusal = b.refusal = message
    async with LLMPool(config(), [a.address, b.address]) as pool:
        with pytest.raises(ContextLengthExceeded) as refused:
            await pool.post("t", "/completions", {"prompt": [1] * 4000})
        assert refused.value.status == 400 and refused.value.message == message
        assert a.completions + b.completions == 1
        with pytest.raises(LLMRequestError) as missing:
            await pool.post("t", "/no-such-route", {})
        assert missing.value.status == 404 and not isinstance(missing.value, ContextLengthExceeded)
        assert all(s.healthy and s.failures == 0 and s.in_flight == 0 for s in pool.backends())


async def test_hung_backend_times_out_and_the_request_moves_on(
    stand_in: Callable[[str], Awaitable[StandIn]], arrivals: Arrivals
) -> None:
    hung, good = await stand_in("hung"), await stand_in("good")
    hung.hang = True
    async with LLMPool(config(request_timeout_s=2.0), [hung.address]) as pool:
        task = asyncio.create_task(pool.post("t", "/completions", {"prompt": "x"}))
        assert (await arrival(arrivals))[0] == "hung"
        pool.add(good.address)
        assert (await asyncio.wait_for(task, WAIT))["backend"] == "good"
        assert "timed out" in (state(pool, hung).last_error or "")
        assert pool.in_flight == 0


KILLABLE_SERVER = """
import asyncio, socket, uvicorn
from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.routing import Route

async def models(request):
    return JSONResponse({"data": [{"id": "killable"}]})

async def completions(request):
    await request.json()
    print("ARRIVED", flush=True)
    await asyncio.Event().wait()

sock = socket.socket()
sock.bind(("127.0.0.1", 0))
sock.listen(16)
print("PORT", sock.getsockname()[1], flush=True)
app = Starlette(routes=[Route("/v1/models", models), Route("/v1/completions", completions, methods=["POST"])])
uvicorn.Server(uvicorn.Config(app, lifespan="off", log_level="warning")).run(sockets=[sock])
"""


async def test_backend_killed_mid_request_is_retried_on_another(
    stand_in: Callable[[str], Awaitable[StandIn]],
) -> None:
    good = await stand_in("good")
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-c", KILLABLE_SERVER, stdout=asyncio.subprocess.PIPE
    )
    try:
        assert process.stdout is not None
        port_line = (await asyncio.wait_for(process.stdout.readline(), WAIT)).decode()
        killable = f"http://127.0.0.1:{port_line.split()[1]}"
        async with LLMPool(config(), [killable]) as pool:
            task = asyncio.create_task(pool.post("t", "/completions", {"prompt": "x"}))
            assert (await asyncio.wait_for(process.stdout.readline(), WAIT)).strip() == b"ARRIVED"
            pool.add(good.address)
            process.kill()  # SIGKILL while the request is at the server
            assert (await asyncio.wait_for(task, WAIT))["backend"] == "good"
            killed = state(pool, killable)
            assert killed.failures >= 1 and killed.in_flight == 0 and pool.in_flight == 0
    finally:
        if process.returncode is None:
            process.kill()
        await process.wait()


async def test_health_check_ejects_dead_backend_and_readmits_it(
    stand_in: Callable[[str], Awaitable[StandIn]],
) -> None:
    a, b = await stand_in("a"), await stand_in("b")
    async with LLMPool(config(failures_to_eject=2), [a.address]) as pool:
        assert (await pool.post("t", "/completions", {}))["backend"] == "a"
        pool.add(b.address)
        await a.stop()
        await pool.check_health()
        assert state(pool, a).healthy and state(pool, a).consecutive_failures == 1
        await pool.check_health()
        assert not state(pool, a).healthy and "ConnectError" in (state(pool, a).last_error or "")
        assert state(pool, b).healthy

        # t's backend is gone: its next turn moves, without a failed attempt first
        assert (await pool.post("t", "/completions", {}))["backend"] == "b"
        assert (await pool.post("t2", "/completions", {}))["backend"] == "b"
        assert state(pool, a).requests == 1

        await a.start()  # the same address comes back
        await pool.check_health()
        assert state(pool, a).healthy and state(pool, a).consecutive_failures == 0
        assert (await pool.post("t3", "/completions", {}))["backend"] == "a"


async def test_background_probe_ejects_a_dead_backend_and_a_waiting_request_resumes_on_readmission(
    stand_in: Callable[[str], Awaitable[StandIn]],
) -> None:
    a = await stand_in("a")
    async with LLMPool(config(health_interval_s=0.1, failures_to_eject=1), [a.address]) as pool:
        await a.stop()
        await eventually(lambda: not state(pool, a).healthy)
        task = asyncio.create_task(pool.post("t", "/completions", {}))
        await one_turn()
        assert pool.waiting == 1 and not task.done()
        await a.start()
        assert (await asyncio.wait_for(task, WAIT))["backend"] == "a"
        assert state(pool, a).healthy and a.completions == 1


async def test_request_failures_eject_a_backend_until_a_probe_readmits_it(
    stand_in: Callable[[str], Awaitable[StandIn]],
) -> None:
    a = await stand_in("a")
    a.fail_next, a.fail_status, a.models_down = 2, 503, True
    async with LLMPool(config(failures_to_eject=2, max_retries=5), [a.address]) as pool:
        task = asyncio.create_task(pool.post("t", "/completions", {}))
        await eventually(lambda: pool.waiting == 1)  # after its second failure, with nothing healthy left
        assert not state(pool, a).healthy and a.completions == 2  # the probes on demand fail too
        a.models_down = False
        await pool.check_health()  # /v1/models answers: re-admitted, and the waiting request goes on
        assert (await asyncio.wait_for(task, WAIT))["backend"] == "a"
        assert a.completions == 3 and state(pool, a).failures == 3  # two requests and the failed probe


async def test_request_waits_for_a_backend_to_be_added_and_gives_up_after_the_bound(
    stand_in: Callable[[str], Awaitable[StandIn]],
) -> None:
    async with LLMPool(config(wait_for_backend_s=0.2)) as pool:
        with pytest.raises(LLMUnavailable, match="no healthy model backend"):
            await pool.post("t", "/completions", {})
        assert pool.waiting == 0
    a = await stand_in("a")
    async with LLMPool(config()) as pool:
        task = asyncio.create_task(pool.post("t", "/completions", {}))
        await one_turn()
        assert pool.waiting == 1 and not task.done()
        pool.add(a.address)
        assert (await asyncio.wait_for(task, WAIT))["backend"] == "a"


async def test_pause_drains_in_flight_requests_and_holds_new_ones_until_resume(
    stand_in: Callable[[str], Awaitable[StandIn]], arrivals: Arrivals
) -> None:
    a = await stand_in("a")
    async with LLMPool(config(), [a.address]) as pool:
        await asyncio.wait_for(pool.pause(), WAIT)  # nothing in flight: returns at once
        pool.resume()

        a.gate.clear()
        first = asyncio.create_task(pool.post("t1", "/completions", {"prompt": "first"}))
        await arrival(arrivals)
        pausing = asyncio.create_task(pool.pause())
        await one_turn()
        assert pool.paused and not pausing.done()  # waits for `first`, never aborts it

        second = asyncio.create_task(pool.post("t2", "/completions", {"prompt": "second"}))
        await one_turn()
        assert pool.waiting == 1

        a.gate.set()
        await asyncio.wait_for(pausing, WAIT)
        assert first.done() and first.result()["backend"] == "a"
        assert pool.in_flight == 0 and not second.done() and arrivals.empty()  # `second` never reached a server

        pool.resume()
        assert (await asyncio.wait_for(second, WAIT))["echo"] == {"prompt": "second"}
        assert a.completions == 2


async def test_each_answer_carries_the_version_its_request_was_generated_by(
    stand_in: Callable[[str], Awaitable[StandIn]], arrivals: Arrivals
) -> None:
    a = await stand_in("a")
    async with LLMPool(config(), [a.address]) as pool:
        unknown = await asyncio.wait_for(pool.post("t", "/completions", {"prompt": "p"}), WAIT)
        assert "policy_version" not in unknown["choices"][0]  # no version was ever set: none is claimed
        await arrival(arrivals)

        pool.resume(policy_version=3)
        a.gate.clear()
        old = asyncio.create_task(pool.post("t", "/chat/completions", {"messages": []}))
        await arrival(arrivals)
        pausing = asyncio.create_task(pool.pause())  # the update starts while `old` is at the server
        await one_turn()
        a.gate.set()
        await asyncio.wait_for(pausing, WAIT)
        pool.resume(policy_version=4)
        new = await asyncio.wait_for(pool.post("t", "/chat/completions", {"messages": []}), WAIT)
        [choice] = old.result()["choices"]
        assert choice["policy_version"] == choice["message"]["policy_version"] == 3
        assert new["choices"][0]["policy_version"] == new["choices"][0]["message"]["policy_version"] == 4
        assert pool.policy_version == 4

        pool.resume()  # a resume without a version keeps the one it had
        a.stamps = 9  # a server that stamps its own version knows its weights: the pool leaves it
        assert (await asyncio.wait_for(pool.post("t", "/completions", {}), WAIT))["choices"][0]["policy_version"] == 9
        assert pool.policy_version == 4


async def test_backends_are_added_removed_and_cleared_at_run_time(
    stand_in: Callable[[str], Awaitable[StandIn]], arrivals: Arrivals
) -> None:
    a, b = await stand_in("a"), await stand_in("b")
    async with LLMPool(config(wait_for_backend_s=0.2)) as pool:
        base = pool.add(a.address)
        assert base == a.address + "/v1"
        assert pool.add(a.address + "/v1/") == base and pool.add(f"127.0.0.1:{a.port}") == base
        assert [s.address for s in pool.backends()] == [base]
        with pytest.raises(ValueError):
            pool.add("http://127.0.0.1:not-a-port")

        a.gate.clear()
        in_flight = asyncio.create_task(pool.post("t", "/completions", {"turn": 1}))
        await arrival(arrivals)
        pool.add(b.address)
        assert pool.remove(a.address) and not pool.remove(a.address)
        assert [s.address for s in pool.backends()] == [b.address + "/v1"]
        assert pool.in_flight == 1  # a removed backend's requests still count until they finish
        a.gate.set()
        assert (await in_flight)["backend"] == "a"
        assert pool.in_flight == 0
        assert (await pool.post("t", "/completions", {"turn": 2}))["backend"] == "b"

        pool.clear()
        assert pool.backends() == []
        with pytest.raises(LLMUnavailable):
            await pool.post("t", "/completions", {"turn": 3})


async def test_completions_through_the_pool_on_the_real_model_server(model_server: LocalModelServer) -> None:
    with socket.socket() as probe:  # a port nothing listens on: connection refused
        probe.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{probe.getsockname()[1]}"
    real = model_server.base_url.removesuffix("/v1")
    async with LLMPool(config(request_timeout_s=120, failures_to_eject=1), [dead, real]) as pool:
        body = {"prompt": [1, 9690, 198], "max_tokens": 4, "seed": 3, "logprobs": 0, "return_token_ids": True}
        answer = await pool.post("t", "/completions", body)
        choice = answer["choices"][0]
        assert 0 < len(choice["token_ids"]) == len(choice["logprobs"]["token_logprobs"]) <= 4
        assert answer["prompt_token_ids"] == [1, 9690, 198]
        assert not state(pool, dead).healthy and "ConnectError" in (state(pool, dead).last_error or "")

        with pytest.raises(ContextLengthExceeded):
            await pool.post("t", "/completions", {"prompt": [1] * 100, "max_tokens": TEST_N_CTX})
        await pool.check_health()
        assert state(pool, model_server.base_url).healthy and not state(pool, dead).healthy
        assert state(pool, model_server.base_url).requests == 2 and pool.in_flight == 0
        # the answered request counts, with the tokens it generated; the refused one does not
        assert pool.generated.answers == 1 and pool.generated.completion_tokens == len(choice["token_ids"])


async def test_waiting_requests_probe_ejected_backends_even_without_health_rounds(stand_in) -> None:
    """With periodic probing off, a backend ejected by failures must come back for the requests waiting on it."""
    backend = await stand_in("a")
    backend.fail_next, backend.fail_status = 1, 503
    async with LLMPool(config(failures_to_eject=1, max_retries=1), [backend.address]) as pool:
        body = await asyncio.wait_for(pool.post("t1", "/completions", {"prompt": [1]}), WAIT)
        assert body["backend"] == "a" and state(pool, backend).healthy and backend.completions == 2


async def test_a_backend_that_refuses_what_another_serves_is_passed_over_and_ejected(
    stand_in: Callable[[str], Awaitable[StandIn]],
) -> None:
    """A backend added with another model name (or base path, or key) answers 404 to everything, instantly: it
    would win the least-in-flight routing and fail most new trajectories."""
    good, wrong = await stand_in("good"), await stand_in("wrong")
    wrong.fail_next, wrong.fail_status = 100, 404
    async with LLMPool(config(failures_to_eject=2), [good.address, wrong.address]) as pool:
        answers = [(await pool.post(f"t{i}", "/completions", {}))["backend"] for i in range(6)]
        assert answers == ["good"] * 6
        assert not state(pool, wrong).healthy and "404" in (state(pool, wrong).last_error or "")
        assert state(pool, good).healthy and state(pool, good).failures == 0


async def test_waiting_requests_keep_probing_until_an_ejected_backend_is_back(stand_in) -> None:
    backend = await stand_in("a")
    # ejected by a request, and its first probes fail too
    backend.fail_next, backend.fail_status, backend.models_down = 1, 503, True
    async with LLMPool(config(failures_to_eject=1, max_retries=1), [backend.address]) as pool:
        waiting = asyncio.create_task(pool.post("t1", "/completions", {"prompt": [1]}))
        await eventually(lambda: (state(pool, backend).last_error or "").startswith("health probe"))
        backend.models_down = False  # the server is back after a probe found it down
        body = await asyncio.wait_for(waiting, WAIT)
        assert body["backend"] == "a" and state(pool, backend).healthy


async def test_a_500_every_backend_repeats_is_the_requests_and_ejects_none(
    stand_in: Callable[[str], Awaitable[StandIn]],
) -> None:
    """NeMo RL's server rejects off-policy sampling parameters with an assert: a bare "Internal Server Error" from
    every backend. The request fails with what they said; no backend is ejected or even charged a failure."""
    backends = [await stand_in(name) for name in "abc"]
    for backend in backends:
        backend.fail_next, backend.fail_body = 100, "Internal Server Error"
    async with LLMPool(config(failures_to_eject=1), [b.address for b in backends]) as pool:
        for t in ("t1", "t2", "t3"):
            with pytest.raises(LLMRequestError) as rejected:
                await pool.post(t, "/chat/completions", {"top_p": 0.5})
            assert rejected.value.status == 500 and "Internal Server Error" in rejected.value.message
            assert "2 backends" in rejected.value.message
        assert sum(b.completions for b in backends) == 6  # two backends each
        assert all(s.healthy and s.failures == 0 and s.in_flight == 0 for s in pool.backends())
        for backend in backends:
            backend.fail_next = 0
        assert (await pool.post("t4", "/chat/completions", {"top_p": 1.0}))["echo"] == {"top_p": 1.0}


async def test_a_500_the_only_backend_gives_every_retry_is_the_requests(
    stand_in: Callable[[str], Awaitable[StandIn]],
) -> None:
    a = await stand_in("a")
    a.fail_next, a.fail_body = 100, "Internal Server Error"
    async with LLMPool(config(failures_to_eject=1, max_retries=2), [a.address]) as pool:
        with pytest.raises(LLMRequestError, match="3 times"):
            await pool.post("t", "/chat/completions", {})
        assert a.completions == 3 and state(pool, a).healthy and state(pool, a).failures == 0


async def test_a_500_whose_body_names_an_assertion_or_an_overflow_is_raised_at_once(
    stand_in: Callable[[str], Awaitable[StandIn]],
) -> None:
    a, b = await stand_in("a"), await stand_in("b")
    async with LLMPool(config(failures_to_eject=1), [a.address, b.address]) as pool:
        for backend in (a, b):
            backend.fail_next, backend.fail_body = 1, "AssertionError('Top k sampling parameter must be unset')"
        with pytest.raises(LLMRequestError, match="Top k"):
            await pool.post("t", "/chat/completions", {"top_k": 5})
        overflow = "Prompt length (2100) fills or exceeds max_model_len (2048). No room for output tokens."
        for backend in (a, b):
            backend.fail_next, backend.fail_body = 1, {"error": {"message": overflow}}
        with pytest.raises(ContextLengthExceeded):
            await pool.post("t", "/chat/completions", {})
        a.refusal = b.refusal = overflow  # how NeMo RL's server answers it: a 400
        with pytest.raises(ContextLengthExceeded):
            await pool.post("t", "/chat/completions", {})
        assert a.completions + b.completions == 3
        assert all(s.healthy and s.failures == 0 for s in pool.backends())


async def test_each_backend_gets_its_own_model_name_and_key(stand_in: Callable[[str], Awaitable[StandIn]]) -> None:
    """NeMo RL's policy servers serve the policy under its name: requests carry it whatever model the caller set."""
    plain, policy = await stand_in("plain"), await stand_in("policy")
    async with LLMPool(config(), [plain.address]) as pool:
        pool.add(policy.address, model="policy-model", api_key="k3y")
        pool.remove(plain.address)
        assert (await pool.post("t", "/chat/completions", {"model": "service-default"}))["echo"] == {
            "model": "policy-model"
        }
        assert policy.headers[-1]["authorization"] == "Bearer k3y"
        assert state(pool, policy).model == "policy-model" and "k3y" not in str(pool.backends())
        pool.add(policy.address, model="renamed")  # registering again updates it: no key now
        assert (await pool.post("t", "/chat/completions", {"model": "x"}))["echo"]["model"] == "renamed"
        assert "authorization" not in policy.headers[-1]


async def test_in_cut_mode_a_cancelled_request_is_no_cut_and_a_cut_one_whose_re_issue_fails_counts_as_lost() -> None:
    """weight_update=cut against the streaming stand-in: a rollout cancelled mid-stream is cancelled (nothing counted
    cut or lost); a request cut by a pause waits for the resume, and when no backend is there to re-issue it, it
    fails and the pool counts it and the tokens it had generated as lost to the update."""

    async def streaming(pool: LLMPool) -> asyncio.Task[dict[str, Any]]:
        request = asyncio.create_task(pool.post("t", "/completions", {"model": "standin", "prompt": [1, 2, 3]}))
        async with asyncio.timeout(WAIT):  # its first tokens have arrived
            while not any(p.ids for p in pool._streams.values()):
                await asyncio.sleep(0.01)
        return request

    async with ModelServerProcess(standin_argv(["one two three four five six seven eight"], latency_s=3.0)) as model:
        async with LLMPool(config(weight_update="cut", wait_for_backend_s=0.2), [model.base_url]) as pool:
            pool.resume(policy_version=0)
            cancelled = await streaming(pool)
            cancelled.cancel()
            with pytest.raises(asyncio.CancelledError):
                await cancelled
            assert pool.in_flight == 0 and not pool._streams and pool.generated.cut == 0

            request = await streaming(pool)
            [partial] = pool._streams.values()
            await asyncio.wait_for(pool.pause(), WAIT)
            assert not request.done() and not partial.done  # cut, its tokens kept, waiting to be re-issued
            kept = len(partial.ids)
            pool.clear()
            pool.resume(policy_version=1)
            with pytest.raises(LLMUnavailable):
                await asyncio.wait_for(request, WAIT)
            generated = pool.generated
    assert (generated.cut, generated.lost_requests, generated.lost_tokens, generated.answers) == (1, 1, kept, 0)
