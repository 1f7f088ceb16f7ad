"""The viewer's web app: one page (plain HTML, JS and CSS shipped in the package, nothing fetched from elsewhere)
and the JSON it reads. The same app serves `prorl view FILE` and a running service's ``/ui``.

With a token, every request needs it, as the service's API does: ``Authorization: Bearer <token>``, or the cookie
a browser gets by opening any page once with ``?token=<token>`` (a browser cannot send the header on its own).
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Annotated, Any
from urllib.parse import urlencode

from fastapi import FastAPI, HTTPException, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, RedirectResponse, Response
from fastapi.staticfiles import StaticFiles

from nemo_gym_prorl.viewer.detail import TokenTexts, detail
from nemo_gym_prorl.viewer.index import GroupPage, GroupQuery, ListQuery, facets, groups, page
from nemo_gym_prorl.viewer.records import Summary
from nemo_gym_prorl.viewer.sources import RolloutSource

STATIC = Path(__file__).parent / "static"
TOKEN_COOKIE = "prorl_token"


def _refused(message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "field": None, "code": 401}}, status_code=401)


def _authorized(request: Request, token: str) -> bool:
    expected = token.encode()
    header = request.headers.get("authorization", "")
    cookie = request.cookies.get(TOKEN_COOKIE, "")
    return secrets.compare_digest(header.encode(), b"Bearer " + expected) or secrets.compare_digest(
        cookie.encode(), expected
    )


_UNFILTERED = ListQuery().model_dump(exclude={"offset", "limit"})


def _in_file_order(query: ListQuery, rows_read: int) -> bool:
    """A page of rows in file order, unfiltered, within the first `rows_read`."""
    return query.model_dump(exclude={"offset", "limit"}) == _UNFILTERED and query.offset + query.limit <= rows_read


def create_viewer_app(
    source: RolloutSource,
    texts: TokenTexts | None = None,
    live: Callable[[], dict[str, Any]] | None = None,
    token: str | None = None,
) -> FastAPI:
    """`live`: a running service's counters (``/api/live``, the live page); `token`: what every request needs."""
    app = FastAPI(title="prorl rollout viewer", docs_url=None, redoc_url=None, openapi_url=None)
    texts = texts or TokenTexts()

    @app.middleware("http")
    async def _token_gate(request: Request, call_next: Any) -> Response:
        if token is None:
            return await call_next(request)
        given = request.query_params.get("token")
        if given is not None:
            if not secrets.compare_digest(given.encode(), token.encode()):
                return _refused("wrong token")
            kept = [(k, v) for k, v in request.query_params.multi_items() if k != "token"]
            target = request.url.replace(query=urlencode(kept))
            redirect = RedirectResponse(str(target), status_code=303)
            cookie_path = request.scope.get("root_path") or "/"
            redirect.set_cookie(TOKEN_COOKIE, token, httponly=True, samesite="strict", path=cookie_path)
            return redirect
        if not _authorized(request, token):
            return _refused("missing or wrong bearer token (a browser: open the page once with ?token=...)")
        return await call_next(request)

    async def all_rows(query: ListQuery | None = None) -> Sequence[Summary]:
        """Every row; any query but a page of the file's order already read waits until the whole file is."""
        if not source.complete.is_set() and not (query is not None and _in_file_order(query, len(source.summaries()))):
            await asyncio.to_thread(source.complete.wait)
        return source.summaries()

    def progress() -> dict[str, Any]:
        return {"indexed": len(source.summaries()), "expected": source.expected,
                "complete": source.complete.is_set(), "error": source.error}

    @app.get("/", include_in_schema=False)
    async def index() -> FileResponse:
        return FileResponse(STATIC / "index.html", headers={"Cache-Control": "no-cache"})

    @app.get("/api/info")
    async def info() -> dict[str, Any]:
        return {"kind": source.kind, "title": source.title, "live": live is not None, "tokenizer": texts.known,
                **progress()}

    @app.get("/api/facets")
    async def get_facets() -> dict[str, Any]:
        rows = source.summaries()
        return {**facets(rows).model_dump(), **progress()}

    @app.get("/api/trajectories")
    async def trajectories(query: Annotated[ListQuery, Query()]) -> dict[str, Any]:
        result = page(await all_rows(query), query)
        if not source.complete.is_set():  # the first page before the whole file is read: the total is estimated
            result.total = max(result.total, source.expected or 0)
        return {**result.model_dump(), **progress()}

    @app.get("/api/groups")
    async def get_groups(query: Annotated[GroupQuery, Query()]) -> GroupPage:
        return groups(await all_rows(), query)

    @app.get("/api/trajectories/{index}")
    async def trajectory(index: int) -> dict[str, Any]:
        rows = source.summaries()
        row = source.row(index)  # one line parsed, or one stored result read: on the loop, where the store is used
        if row is None or index >= len(rows):
            raise HTTPException(404, f"no trajectory {index}")
        return await asyncio.to_thread(detail, rows[index], row, texts)

    @app.get("/api/live")
    async def live_counters() -> dict[str, Any]:
        if live is None:
            raise HTTPException(404, "live counters exist only under a running service (/ui)")
        return {"time": time.time(), **live()}

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0]
        field = ".".join(str(p) for p in first["loc"] if p != "query")
        return JSONResponse({"error": {"message": f"{field}: {first['msg']}", "field": field, "code": 422}}, 422)

    @app.exception_handler(HTTPException)
    async def _http(_: Request, exc: HTTPException) -> JSONResponse:
        return JSONResponse({"error": {"message": str(exc.detail), "code": exc.status_code}}, exc.status_code)

    app.mount("/static", StaticFiles(directory=STATIC), name="static")
    return app

