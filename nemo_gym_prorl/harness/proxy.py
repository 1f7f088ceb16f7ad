"""A rollout's model proxy: an HTTP server on a Unix socket of its own, reachable from inside a sandbox without
network.

The socket's fresh directory is bound into the sandbox (`sandbox_spec`); `connect` runs the forwarder
(`forwarder.py`) inside, which listens on the sandbox's own loopback and hands the listening socket over, so a
harness's ``OPENAI_BASE_URL=http://127.0.0.1:PORT/v1`` connects to this proxy directly while the sandbox's own
network namespace (bubblewrap unshares it unless the spec asks for network) reaches nothing else. On the host the
directory has a random name under one others may pass through but not list: its path is the way in.

The server is uvicorn in the caller's event loop, the caller's signal handlers left alone (many rollouts' proxies
start and stop out of order; uvicorn's handlers would be restored out of order with them). `close()` closes the
sandbox's port and stops the forwarder (reaped inside the sandbox), then the server, then removes the socket. The
rollout's limits (`ProxyConfig.deadline_s`, `token_budget`, `max_calls`) hold from `start()`. Usage: docs/harness.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import secrets
import shutil
import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Self

import uvicorn
from pydantic import BaseModel, ConfigDict, Field
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from nemo_gym_prorl.contracts.sandbox import BindMount, Sandbox, SandboxSpec
from nemo_gym_prorl.harness import chat_completions, messages, responses
from nemo_gym_prorl.harness.calls import ModelCalls

FORWARDER = Path(__file__).with_name("forwarder.py")
SOCKET_NAME = "model.sock"
HANDOVER_NAME = "handover.sock"  # where the forwarder hands over its listener, during `connect` only


class ProxyConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    port: int = Field(4000, gt=0, lt=65536, description="the forwarder's port on the sandbox's own loopback")
    mount_point: str = Field("/.prorl-model", description="where the socket's directory appears in the sandbox")
    python: str = Field("python3", description="the sandbox's interpreter that runs the forwarder")
    api_key: str = Field("prorl-proxy", description="OPENAI_API_KEY for the harness (which may insist on one)")
    forwarder_start_s: float = Field(30.0, gt=0, description="how long connect waits for the forwarder's listener")
    shutdown_grace_s: float = Field(1.0, ge=0, description="how long close lets a call in flight finish")
    deadline_s: float | None = Field(None, gt=0, description="no model call answered after this (the task's time limit)")
    token_budget: int | None = Field(None, ge=1, description="tokens the rollout's calls may generate in all")
    max_calls: int | None = Field(None, ge=1, description="model calls answered before every later one is refused")


class ProxyError(RuntimeError):
    """The proxy could not be reached from the sandbox (its forwarder did not start)."""


class _Coalesced:
    """A connection whose writes of one event-loop step go out as one send: uvicorn writes a response's head and its
    body apart, and each send is a pass through the loopback and may wake the harness once more."""

    def __init__(self, transport: asyncio.Transport) -> None:
        self._transport = transport
        self._pending: list[bytes] = []

    def write(self, data: bytes) -> None:
        if not self._pending:
            asyncio.get_running_loop().call_soon(self._flush)
        self._pending.append(data)

    def _flush(self) -> None:
        if self._pending:
            data = b"".join(self._pending)
            self._pending.clear()
            if not self._transport.is_closing():
                self._transport.write(data)

    def close(self) -> None:
        self._flush()
        self._transport.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class _CoalescedHttp(HttpToolsProtocol):
    def connection_made(self, transport: asyncio.BaseTransport) -> None:  # type: ignore[override]
        super().connection_made(_Coalesced(transport))  # type: ignore[arg-type]


class _InLoopServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self.listening = asyncio.Event()

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        self.listening.set()

    async def add_listener(self, sock: socket.socket) -> asyncio.Server:
        """Serve `sock` too, from now on: its connections are counted, and shut down, with the server's own."""
        config = self.config

        def protocol(_loop: asyncio.AbstractEventLoop | None = None) -> asyncio.Protocol:
            return config.http_protocol_class(  # type: ignore[call-arg]
                config=config, server_state=self.server_state, app_state=self.lifespan.state, _loop=_loop
            )

        server = await asyncio.get_running_loop().create_server(protocol, sock=sock, backlog=config.backlog)
        self.servers.append(server)
        return server


class ModelProxy:
    """One rollout's proxy in front of `calls` (which records every call the harness makes)."""

    def __init__(self, calls: ModelCalls, config: ProxyConfig | None = None) -> None:
        self.calls = calls
        self.config = config or ProxyConfig()
        self._folder: Path | None = None  # the socket's directory, under a temp dir of its own
        self._server: _InLoopServer | None = None
        self._serving: asyncio.Task[None] | None = None
        self._forwarder: asyncio.Task[Any] | None = None
        self._handover: socket.socket | None = None  # held open: the forwarder waits on it
        self._port: asyncio.Server | None = None  # the sandbox's loopback listener, served here

    @property
    def socket_path(self) -> Path:
        """The socket on the host (started proxies only)."""
        if self._folder is None:
            raise ProxyError("the model proxy is not started")
        return self._folder / SOCKET_NAME

    @property
    def base_url(self) -> str:
        """The harness's base URL inside the sandbox."""
        return f"http://127.0.0.1:{self.config.port}/v1"

    def env(self) -> dict[str, str]:
        """What points an OpenAI-client or Anthropic-client harness at this proxy."""
        key, root = self.config.api_key, f"http://127.0.0.1:{self.config.port}"
        return {"OPENAI_BASE_URL": self.base_url, "OPENAI_API_KEY": key, "ANTHROPIC_BASE_URL": root, "ANTHROPIC_API_KEY": key}

    def sandbox_spec(self, spec: SandboxSpec) -> SandboxSpec:
        """`spec` with the socket's directory bound in and `env()` in the sandbox's environment."""
        if spec.network:
            raise ValueError(
                "sandbox spec: network must be false for a harness behind the model proxy (the proxy is its only "
                "way out, and each sandbox's forwarder needs a loopback of its own)"
            )
        bind = BindMount(source=str(self.socket_path.parent), target=self.config.mount_point)
        return spec.model_copy(update={"binds": [*spec.binds, bind], "env": {**spec.env, **self.env()}})

    async def start(self) -> None:
        if self._folder is not None:
            raise ProxyError("the model proxy is already started")
        self.calls.set_limits(self.config.deadline_s, self.config.token_budget, self.config.max_calls)
        root = Path(tempfile.mkdtemp(prefix="prorl-proxy-"))
        self._folder = folder = root / secrets.token_hex(16)
        try:
            root.chmod(0o711)  # others may pass through, never list: the folder's name is the way in
            folder.mkdir()
            folder.chmod(0o711)
            shutil.copyfile(FORWARDER, folder / FORWARDER.name)
            (folder / FORWARDER.name).chmod(0o644)
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.bind(str(folder / SOCKET_NAME))
            (folder / SOCKET_NAME).chmod(0o666)  # the sandbox's host uid connects: the directory guards it
            sock.listen(128)
            config = uvicorn.Config(
                self._app(), http=_CoalescedHttp, log_config=None, log_level="warning", access_log=False,
                lifespan="off", timeout_graceful_shutdown=self.config.shutdown_grace_s,
            )  # fmt: skip
            self._server = server = _InLoopServer(config)
            self._serving = serving = asyncio.create_task(server.serve(sockets=[sock]))
            listening = asyncio.ensure_future(server.listening.wait())
            await asyncio.wait({listening, serving}, return_when=asyncio.FIRST_COMPLETED)
            listening.cancel()
            if not server.listening.is_set():
                raise ProxyError(f"the model proxy's server did not start: {serving.exception()!r}")
        except BaseException:
            await self.close()
            raise

    async def connect(self, sandbox: Sandbox, lifetime_s: float) -> None:
        """Start the forwarder in `sandbox` (started from `sandbox_spec`) and return once its listener is served
        here. The port stays open at most `lifetime_s` (the rollout's deadline), and until `close()`."""
        if self._forwarder is not None:
            raise ProxyError("the model proxy is already connected to a sandbox")
        mount, path = self.config.mount_point, self.socket_path.with_name(HANDOVER_NAME)
        argv = [self.config.python, f"{mount}/{FORWARDER.name}", f"{mount}/{HANDOVER_NAME}", str(self.config.port)]
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as handover:
            handover.bind(str(path))
            path.chmod(0o666)
            handover.listen(1)
            handover.setblocking(False)
            self._forwarder = forwarder = asyncio.create_task(sandbox.exec(argv, timeout=lifetime_s))
            received = asyncio.create_task(self._receive_listener(handover))
            try:
                await asyncio.wait(
                    {received, forwarder}, timeout=self.config.forwarder_start_s, return_when=asyncio.FIRST_COMPLETED
                )
            finally:
                path.unlink(missing_ok=True)
                received.cancel()
                (got,) = await asyncio.gather(received, return_exceptions=True)
        if isinstance(got, asyncio.Server):
            self._port = got
            forwarder.add_done_callback(lambda _: got.close())  # the forwarder's lifetime is the port's
            return
        ended = forwarder.done()
        await self._stop_forwarder()
        if isinstance(got, Exception):
            raise got if isinstance(got, ProxyError) else ProxyError(f"the model forwarder's hand-over failed: {got}")
        if ended:
            result = forwarder.result()
            raise ProxyError(
                f"the model forwarder in the sandbox ended (exit {result.exit_code}) before it listened on port "
                f"{self.config.port}: {result.output.strip()[-500:]}"
            )
        raise ProxyError(f"the model forwarder in the sandbox did not listen within {self.config.forwarder_start_s:g}s")

    async def _receive_listener(self, handover: socket.socket) -> asyncio.Server:
        """The listening socket the forwarder sends (SCM_RIGHTS), served from now on."""
        loop = asyncio.get_running_loop()
        connection, _ = await loop.sock_accept(handover)
        try:
            readable = loop.create_future()
            loop.add_reader(connection.fileno(), lambda: readable.done() or readable.set_result(None))
            try:
                await readable
            finally:
                loop.remove_reader(connection.fileno())
            _, fds, _, _ = socket.recv_fds(connection, 1, 1)
        except BaseException:
            connection.close()
            raise
        self._handover = connection
        if not fds:
            raise ProxyError("the model forwarder in the sandbox handed over no socket")
        listener = socket.socket(fileno=fds[0])
        if (listener.family, listener.type) != (socket.AF_INET, socket.SOCK_STREAM) or not listener.getsockopt(
            socket.SOL_SOCKET, socket.SO_ACCEPTCONN
        ):
            listener.close()
            raise ProxyError("the model forwarder in the sandbox handed over a socket that is not a TCP listener")
        assert self._server is not None
        return await self._server.add_listener(listener)

    async def close(self) -> None:
        """Idempotent: the forwarder, the server and the socket's directory are gone when it returns."""
        await self._stop_forwarder()
        if self._server is not None and self._serving is not None:
            self._server.should_exit = True
            await asyncio.gather(self._serving, return_exceptions=True)
            self._server = self._serving = None
        if self._folder is not None:
            shutil.rmtree(self._folder.parent, ignore_errors=True)
            self._folder = None

    async def _stop_forwarder(self) -> None:
        """Closes the sandbox's port; cancelling the exec kills the forwarder's process group and reaps it (the
        sandbox's join helper)."""
        for closing in (self._port, self._handover):
            if closing is not None:
                closing.close()
        self._port = self._handover = None
        forwarder, self._forwarder = self._forwarder, None
        if forwarder is not None:
            forwarder.cancel()
            await asyncio.gather(forwarder, return_exceptions=True)

    def _app(self) -> Starlette:
        apis = {"/v1/chat/completions": chat_completions, "/v1/responses": responses, "/v1/messages": messages}
        return Starlette(
            routes=[
                *(Route(path, functools.partial(api.endpoint, self.calls), methods=["POST"]) for path, api in apis.items()),
                Route("/v1/models", self._models),
            ]
        )

    async def _models(self, request: Request) -> Response:
        model = {"id": self.calls.model, "object": "model", "owned_by": "nemo-gym-prorl"}
        return JSONResponse({"object": "list", "data": [model]})

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
