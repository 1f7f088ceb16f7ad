"""JSON over HTTP on aiohttp's connection pool: the client of the service's hot paths, model requests (the LLM pool)
and Gym resources-server calls.

Why not httpx, which the rest of the package uses: at 256 concurrent rollouts its client layer (URL parsing, the
request and header models, cookie extraction) took ~30% of the service's CPU even over an aiohttp transport, and
httpcore's own pool was worse, quadratic in connections (py-spy, `prorl bench throughput`). Here a request is one
aiohttp call with an orjson body, and the answer is read whole, or, with `post_events`, as server-sent events (a
generation a weight update may cut keeps what it streamed). Cookies are the caller's (a Gym session per episode on one shared client), so the client keeps none.

An idle connection is kept for `keepalive_s`, which must stay under the server's own keep-alive: past it the server
closes the connection, and a request already sent on it fails. Kept too briefly, connections are reopened at every
wave of a batch's requests (rollouts of one batch move in step), which costs both sides: at 1024 rollouts in flight
a 2 s keep-alive cost the resources server ~20% more CPU per rollout than Gym's agent cost it. The aiohttp session
is made on first use, on the running loop: building a client opens nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson

_JSON_HEADERS = {"Content-Type": "application/json"}


class HttpTransportError(Exception):
    """The request got no HTTP answer: the connection failed or broke, or the server took too long."""


class HttpConnectError(HttpTransportError):
    """Nothing accepted the connection: the request never reached a server."""


class HttpTimeout(HttpTransportError):
    pass


@dataclass(frozen=True, slots=True)
class JsonResponse:
    status: int
    content: bytes
    cookies: dict[str, str]  # what the answer's Set-Cookie headers set

    def json(self) -> Any:
        """The body as JSON; raises ValueError when it is not."""
        return orjson.loads(self.content)

    @property
    def text(self) -> str:
        return self.content.decode(errors="replace")

    def error_message(self) -> str:
        """What an error answer says: the OpenAI-style ``error.message`` when there is one, else the body."""
        try:
            return str(self.json()["error"]["message"])
        except (ValueError, KeyError, TypeError):
            return self.text

    def raise_for_status(self) -> None:
        if self.status >= 400:
            raise HttpStatusError(self.status, self.error_message())


def set_cookies(headers: Iterable[str]) -> dict[str, str]:
    """Name → value of Set-Cookie headers, read the way RFC 6265 §5.2 tells a user agent to: the pair before the
    first ``;``, split at its first ``=``, the value kept as sent (quotes too) so it goes back as the server wrote
    it. The attributes (path, expiry, ...) are not read: a caller sends an episode's cookies back to the server that
    set them. (aiohttp's ``response.cookies`` builds a ``SimpleCookie`` per answer, a few % of the service's CPU.)"""
    cookies = {}
    for header in headers:
        name, has_value, value = header.split(";", 1)[0].partition("=")
        if has_value and (name := name.strip()):
            cookies[name] = value.strip()
    return cookies


class HttpStatusError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message[:500]}")
        self.status = status
        self.message = message


class JsonHttp:
    """``await JsonHttp(timeout_s=60).post(url, body)`` → ``JsonResponse``; close with ``aclose()``.

    `timeout_s` bounds each wait for the server (connecting and each read), not the whole exchange: a generation
    streams nothing until it is done, so a read timeout is what tells a hung server from a slow one."""

    def __init__(
        self,
        *,
        max_connections: int | None = None,
        timeout_s: float | None = None,
        connect_timeout_s: float | None = None,
        keepalive_s: float = 2.0,
    ) -> None:
        self._limit = max_connections or 0  # 0: unbounded
        self._timeout_s = timeout_s
        self._connect_timeout_s = connect_timeout_s
        self._keepalive_s = keepalive_s
        self._session: aiohttp.ClientSession | None = None
        self._closed = False

    @property
    def is_closed(self) -> bool:
        return self._closed

    def _client(self) -> aiohttp.ClientSession:
        if self._closed:
            raise RuntimeError("this JsonHttp client is closed")
        if self._session is None:
            connector = aiohttp.TCPConnector(limit=self._limit, limit_per_host=0, keepalive_timeout=self._keepalive_s)
            self._session = aiohttp.ClientSession(
                connector=connector,
                cookie_jar=aiohttp.DummyCookieJar(),
                timeout=aiohttp.ClientTimeout(total=None),
                skip_auto_headers=("User-Agent",),
            )
        return self._session

    async def post(
        self, url: str, body: Any, *, headers: Mapping[str, str] | None = None, timeout_s: float | None = None
    ) -> JsonResponse:
        data = orjson.dumps(body, option=orjson.OPT_NON_STR_KEYS)
        return await self._request("POST", url, data, {**_JSON_HEADERS, **(headers or {})}, timeout_s)

    async def get(self, url: str, *, timeout_s: float | None = None) -> JsonResponse:
        return await self._request("GET", url, None, None, timeout_s)

    async def post_events(
        self, url: str, body: Any, on_event: Callable[[Any], None], *, headers: Mapping[str, str] | None = None
    ) -> JsonResponse:
        """POST and hand each server-sent ``data:`` JSON to `on_event` as it arrives (an empty 200 comes back); an
        answer that is not an event stream (an error, a server that does not stream) is returned whole. Cancelling
        the call closes the connection, which is how a streaming server is told to abort."""
        data = orjson.dumps(body, option=orjson.OPT_NON_STR_KEYS)
        return await self._request("POST", url, data, {**_JSON_HEADERS, **(headers or {})}, None, on_event)

    async def _request(
        self, method: str, url: str, data: bytes | None, headers: Mapping[str, str] | None, timeout_s: float | None,
        on_event: Callable[[Any], None] | None = None,
    ) -> JsonResponse:  # fmt: skip
        read_s = timeout_s or self._timeout_s
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=self._connect_timeout_s or read_s, sock_read=read_s)
        try:
            async with self._client().request(
                method, url, data=data, headers=headers, timeout=timeout, allow_redirects=False
            ) as response:
                if on_event is not None and response.content_type == "text/event-stream":
                    async for line in response.content:
                        if line.startswith(b"data:") and (payload := line[5:].strip()) != b"[DONE]":
                            on_event(orjson.loads(payload))
                    return JsonResponse(response.status, b"", {})
                content = await response.read()
                return JsonResponse(response.status, content, set_cookies(response.headers.getall("Set-Cookie", ())))
        except aiohttp.ClientConnectorError as e:
            raise HttpConnectError(f"{method} {url}: {e}") from e
        except (TimeoutError, aiohttp.ServerTimeoutError) as e:
            raise HttpTimeout(f"{method} {url}: timed out{f' ({e})' if str(e) else ''}") from e
        except aiohttp.ClientError as e:
            raise HttpTransportError(f"{method} {url}: {type(e).__name__}: {e}") from e

    async def aclose(self) -> None:
        self._closed = True
        if self._session is not None:
            await self._session.close()
            self._session = None
