"""An httpx transport on aiohttp's connection pool: httpx's API (and error types) for our callers, without
httpcore's pool, whose bookkeeping walks every pooled connection on every request — quadratic in connections, and
~77% of the service's CPU at 1,024 concurrent rollouts (py-spy, `prorl bench throughput`).

Idle connections are dropped after 2 s, before uvicorn's 5 s keep-alive closes them under us. Bodies are read
whole: the service's model and Gym calls are JSON request/response, never streams."""

from __future__ import annotations

import asyncio

import aiohttp
import httpx


class AiohttpTransport(httpx.AsyncBaseTransport):
    """``httpx.AsyncClient(transport=AiohttpTransport(1024))``."""

    def __init__(self, max_connections: int | None = None) -> None:
        self._limit = max_connections or 0  # 0: unbounded
        self._session: aiohttp.ClientSession | None = None

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None:  # created on the running loop, on first use
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=self._limit, limit_per_host=0, keepalive_timeout=2.0),  # < uvicorn's 5 s
                cookie_jar=aiohttp.DummyCookieJar(),  # httpx keeps the cookies
                auto_decompress=False,  # httpx decodes by content-encoding
                timeout=aiohttp.ClientTimeout(total=None),
            )
        return self._session

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        timeouts = request.extensions.get("timeout", {})
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=timeouts.get("connect"), sock_read=timeouts.get("read"))
        headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in request.headers.raw]
        try:
            async with self._client().request(
                request.method, str(request.url), headers=headers, data=await request.aread() or None,
                timeout=timeout, allow_redirects=False, skip_auto_headers=("Accept-Encoding", "User-Agent", "Content-Type"),
            ) as response:
                content = await response.read()
                return httpx.Response(response.status, headers=response.raw_headers, content=content, request=request)
        except aiohttp.ClientConnectorError as e:
            raise httpx.ConnectError(str(e), request=request) from e
        except (asyncio.TimeoutError, aiohttp.ServerTimeoutError) as e:
            raise httpx.ReadTimeout(str(e) or "timed out", request=request) from e
        except aiohttp.ClientError as e:
            raise httpx.ReadError(str(e), request=request) from e

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
