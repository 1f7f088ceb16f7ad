"""Live episodes of a resources server, by Gym session id: seeded once, closed once, never recreated.

Gym ties the calls of one rollout together with a session id (the session cookie; an environment server names
it `resources_session_id`). Each session holds one episode of our environment — a started sandbox — from its seed
until it is closed (after verify, or by close_session), and every episode still open is closed when the server
shuts down.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any

from nemo_gym_prorl.contracts.task import TaskInstance
from nemo_gym_prorl.envs import Environment, Episode


class SessionClosedError(RuntimeError):
    """A seed for a session that was already closed: a closed session is never recreated."""


class EpisodeSessions:
    def __init__(self, env: Environment) -> None:
        self.env = env
        self._episodes: dict[str, asyncio.Future[Episode]] = {}
        self._closed: set[str] = set()

    def __len__(self) -> int:
        return len(self._episodes)

    async def seed(self, session_id: str, instance: TaskInstance) -> Episode:
        """Start the session's episode; seeding a live session again returns the same episode."""
        if session_id in self._closed:
            raise SessionClosedError(f"session {session_id!r} is closed; seed a new one")
        pending = self._episodes.get(session_id)
        if pending is None:
            pending = self._episodes[session_id] = asyncio.ensure_future(self.env.init(instance))
        try:
            episode = await asyncio.shield(pending)
        except Exception:
            if self._episodes.get(session_id) is pending:
                del self._episodes[session_id]  # a failed start can be seeded again
            raise
        if session_id in self._closed:  # closed while it started; close() has closed the episode
            raise SessionClosedError(f"session {session_id!r} was closed while it started")
        return episode

    async def get(self, session_id: str) -> Episode | None:
        """The live episode of a session, None when it was never seeded or is closed."""
        pending = self._episodes.get(session_id)
        if pending is None:
            return None
        try:
            return await asyncio.shield(pending)
        except Exception:
            return None  # its start failed; the seed that started it reported why

    async def close(self, session_id: str) -> None:
        """Close the session's episode and remember the session as closed. Idempotent."""
        self._closed.add(session_id)
        pending = self._episodes.pop(session_id, None)
        if pending is None:
            return
        try:
            episode = await asyncio.shield(pending)
        except Exception:
            return  # it never started, so there is nothing to close
        await self.env.close(episode)

    async def close_all(self) -> None:
        await asyncio.gather(*(self.close(session_id) for session_id in list(self._episodes)))


def closing_on_shutdown(
    sessions: EpisodeSessions, lifespan: Callable[[Any], AbstractAsyncContextManager[Any]]
) -> Callable[[Any], AbstractAsyncContextManager[Any]]:
    """An app lifespan that runs `lifespan` and then closes every episode still open."""

    @asynccontextmanager
    async def lifespan_then_close(app: Any) -> AsyncIterator[Any]:
        try:
            async with lifespan(app) as state:
                yield state
        finally:
            await sessions.close_all()

    return lifespan_then_close
