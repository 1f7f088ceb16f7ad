"""The part every one of our NeMo Gym resources servers shares: a session seeded with a dataset row, either way Gym
seeds one.

An agent's legacy ``/run`` posts the whole row to ``/seed_session`` and its session cookie names the session; an
environment server posts a ``ResourcesSeedSessionRequest``, whose ``resources_session_id`` becomes the cookie's
session id (so later tool calls and ``/verify`` find it) and whose ``task_data`` is the row. A subclass says what
seeding a row does (`seed_row`) and grades in ``verify``.
"""

from __future__ import annotations

from abc import abstractmethod
from typing import Any

from fastapi import Request
from nemo_gym.base_resources_server import (
    BaseRunRequest,
    BaseSeedSessionResponse,
    BaseVerifyRequest,
    ResourcesSeedSessionRequest,
    ResourcesSeedSessionResponse,
    SimpleResourcesServer,
)
from nemo_gym.server_utils import SESSION_ID_KEY
from pydantic import ConfigDict


class RowRunRequest(BaseRunRequest):
    model_config = ConfigDict(extra="allow")  # the dataset row's own columns


class RowVerifyRequest(RowRunRequest, BaseVerifyRequest):
    pass


class RowSessionServer(SimpleResourcesServer):
    ray_enabled = False

    async def seed_session(
        self, request: Request, body: ResourcesSeedSessionRequest | RowRunRequest
    ) -> ResourcesSeedSessionResponse | BaseSeedSessionResponse:
        if isinstance(body, ResourcesSeedSessionRequest):
            request.session[SESSION_ID_KEY] = body.resources_session_id
            await self.seed_row(request, body.task_data)
            return ResourcesSeedSessionResponse(resources_session_id=body.resources_session_id)
        await self.seed_row(request, body.model_dump())
        return BaseSeedSessionResponse()

    @abstractmethod
    async def seed_row(self, request: Request, row: dict[str, Any]) -> None:
        """Start the session ``request.session[SESSION_ID_KEY]`` for this dataset row."""
