"""JsonHttp, the service's client for model and Gym calls, against a real HTTP server on loopback."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator

import orjson
import pytest
from aiohttp import web

from nemo_gym_prorl.json_http import HttpConnectError, HttpStatusError, HttpTimeout, JsonHttp, set_cookies


@pytest.fixture
async def server() -> AsyncIterator[str]:
    async def echo(request: web.Request) -> web.Response:
        response = web.json_response(
            {"body": orjson.loads(await request.read()), "cookie": request.headers.get("cookie")}
        )
        response.set_cookie("session", "abc123", path="/", httponly=True, samesite="lax")
        response.headers.add("Set-Cookie", 'quoted="a b"; Max-Age=60')
        return response

    async def refuse(_: web.Request) -> web.Response:
        return web.json_response({"error": {"message": "max_tokens must be positive"}}, status=400)

    released = asyncio.Event()

    async def hang(_: web.Request) -> web.Response:
        await released.wait()
        return web.json_response({})

    app = web.Application()
    app.router.add_post("/echo", echo)
    app.router.add_post("/refuse", refuse)
    app.router.add_get("/hang", hang)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    yield f"http://127.0.0.1:{port}"
    released.set()
    await runner.cleanup()


async def test_posts_json_and_hands_back_body_and_cookies(server: str) -> None:
    http = JsonHttp(timeout_s=10)
    try:
        response = await http.post(f"{server}/echo", {"a": [1, 2], 3: "int key"}, headers={"cookie": "session=old"})
        assert response.status == 200
        assert response.json() == {"body": {"a": [1, 2], "3": "int key"}, "cookie": "session=old"}
        assert response.cookies == {"session": "abc123", "quoted": '"a b"'}  # as sent, to send back as is
    finally:
        await http.aclose()


def test_set_cookie_headers_read_as_rfc6265_says() -> None:
    headers = ["a=1; Path=/", " b = x=y ; HttpOnly", "no-equals-sign", "=nameless", "c=", "a=2"]
    assert set_cookies(headers) == {"a": "2", "b": "x=y", "c": ""}


async def test_an_error_answer_names_the_servers_message(server: str) -> None:
    http = JsonHttp(timeout_s=10)
    try:
        response = await http.post(f"{server}/refuse", {})
        assert (response.status, response.error_message()) == (400, "max_tokens must be positive")
        with pytest.raises(HttpStatusError, match="HTTP 400: max_tokens must be positive"):
            response.raise_for_status()
    finally:
        await http.aclose()


async def test_transport_failures_are_typed(server: str) -> None:
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        closed_port = s.getsockname()[1]
    http = JsonHttp(timeout_s=0.3, connect_timeout_s=5)
    try:
        with pytest.raises(HttpConnectError, match=str(closed_port)):
            await http.post(f"http://127.0.0.1:{closed_port}/x", {})
        with pytest.raises(HttpTimeout, match="/hang"):
            await http.get(f"{server}/hang")
    finally:
        await http.aclose()


async def test_a_closed_client_refuses_requests_instead_of_opening_a_new_pool(server: str) -> None:
    http = JsonHttp()
    assert not http.is_closed
    await http.aclose()
    assert http.is_closed
    with pytest.raises(RuntimeError, match="closed"):
        await http.post(f"{server}/echo", {})
