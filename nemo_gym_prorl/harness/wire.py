"""What every API the proxy speaks does alike: read the JSON body, hand the core its `CallRequest`, and turn the
core's refusals into that API's error reply; server-sent events for the streaming ones.

Each adapter (`chat_completions.py`, `responses.py`, `messages.py`) is an `Api`: its parser, answer, stream and
error shape;
the failures are named once here (`Failure`), so a deadline or an exhausted token budget reads the same way,
whichever API a harness speaks.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from enum import Enum
from typing import Any, Generic, Protocol, TypeVar

import orjson
from pydantic import BaseModel, ValidationError
from starlette.requests import Request
from starlette.responses import Response

from nemo_gym_prorl.agent.llm_pool import LLMUnavailable
from nemo_gym_prorl.agent.turns import ContextLengthExceeded, LLMRequestError
from nemo_gym_prorl.harness.calls import CallRefused, CallRequest, ModelCall, ModelCalls


class Failure(Enum):
    """Why a call got no reply; each API names these its own way."""

    BAD_REQUEST = "bad_request"  # the harness sent what the proxy cannot read (400)
    CONTEXT_LENGTH = "context_length"  # the prompt does not fit the context window (400)
    ROLLOUT_LIMIT = "rollout_limit"  # past the rollout's deadline or token budget (400: retrying cannot help)
    UPSTREAM = "upstream"  # the backend refused the request
    UNAVAILABLE = "unavailable"  # no backend answers (503)


class BadRequest(ValueError):
    """A request the proxy cannot answer as sent; its message names the field."""


ErrorReply = Callable[[Failure, int, str, "str | None"], Response]  # failure, HTTP status, message, code


def json_response(body: dict[str, Any], status: int = 200) -> Response:
    return Response(orjson.dumps(body), status_code=status, media_type="application/json")


def validated(model: type[BaseModel], body: Any, what: str) -> Any:
    """`body` as `model`; `BadRequest` naming the first field that is wrong."""
    try:
        return model.model_validate(body)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(part) for part in first["loc"]) or "body"
        raise BadRequest(f"{what}: {where}: {first['msg']}") from None


class Streamable(Protocol):
    stream: bool


Parsed = TypeVar("Parsed", bound=Streamable)


@dataclass(frozen=True)
class Api(Generic[Parsed]):
    """One API's adapter: how its body is read (`parse`), a call is answered (`render`, with the model's name the
    harness asked for) or streamed (`events`), and a failure is said (`error`)."""

    what: str  # names its requests in error messages: "chat completions request"
    parse: Callable[[Any], tuple[CallRequest, Parsed]]
    render: Callable[[ModelCall, Parsed, str], dict[str, Any]]
    events: Callable[[dict[str, Any], Parsed], Iterable[bytes]]
    error: ErrorReply

    async def endpoint(self, calls: ModelCalls, request: Request) -> Response:
        try:
            body = orjson.loads(await request.body())
        except orjson.JSONDecodeError as e:
            return self.error(Failure.BAD_REQUEST, 400, f"{self.what}: the body is not JSON ({e})", None)
        try:
            core, parsed = self.parse(body)
            call = await calls.complete(core)
        except BadRequest as e:
            return self.error(Failure.BAD_REQUEST, 400, str(e), None)
        except CallRefused as e:
            return self.error(Failure.ROLLOUT_LIMIT, 400, str(e), e.refusal.reason)
        except ContextLengthExceeded as e:
            return self.error(Failure.CONTEXT_LENGTH, 400, e.message, "context_length_exceeded")
        except LLMRequestError as e:
            return self.error(Failure.UPSTREAM, e.status if e.status < 500 else 502, e.message, None)
        except LLMUnavailable as e:
            return self.error(Failure.UNAVAILABLE, 503, str(e), None)
        answer = self.render(call, parsed, body.get("model") or calls.model)
        if not parsed.stream:
            return json_response(answer)
        # The call is finished: its events go out as one body (a StreamingResponse of them took a thread hop each).
        return Response(b"".join(self.events(answer, parsed)), media_type="text/event-stream")


def text_of(content: str | list[dict[str, Any]] | None, kinds: set[str], where: str) -> str:
    """A message's content as one text: a string as it is, a list of parts of the `kinds` joined."""
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for j, part in enumerate(content):
        if part.get("type") not in kinds or not isinstance(part.get("text"), str):
            raise BadRequest(f"{where}.{j}: only text parts are supported, got {part.get('type')!r}")
        texts.append(part["text"])
    return "".join(texts)


def event(data: dict[str, Any], name: str | None = None) -> bytes:
    """One server-sent event (``event:`` line only when named)."""
    head = f"event: {name}\n".encode() if name else b""
    return head + b"data: " + orjson.dumps(data) + b"\n\n"
