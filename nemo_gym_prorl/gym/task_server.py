"""Any of our task YAMLs as a NeMo Gym resources server: the environment behind seed_session, tool routes, verify.

A server folder (``resources_servers/prorl_math``, ``prorl_code``, ``prorl_stem``, ``prorl_swe``) is a thin config
of this class: its ``task`` names the YAML. One Gym session is one episode (a sandbox with the task staged), seeded
with the whole dataset row (an agent's legacy ``/run``) or a ``ResourcesSeedSessionRequest`` (an environment
server; see ``row_session_server``). The task's tools are routes (``/bash``, ``/python``, ``/str_replace_editor``,
``/finish``) that run in the session's sandbox. ``/verify`` takes the ``finish`` answer, else the final assistant
message, collects from the live sandbox (a file the answer names), closes it, and grades; a verify without a live
session grades the response alone.

Rows are taken as Gym sends them: Gym's own rows (``responses_create_params``, ``verifier_metadata``, ``options``
...) need no ``instance_id`` (the task's id column, else a hash of the row, names the instance), and a task without
a prompt template stages the row's own prompt.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fastapi import FastAPI, HTTPException, Request
from nemo_gym.base_resources_server import (
    BaseResourcesServerConfig,
    BaseVerifyResponse,
    ResourcesCloseSessionRequest,
    ResourcesCloseSessionResponse,
)
from nemo_gym.server_utils import SESSION_ID_KEY
from nemo_gym.verifier_fixture import VerifierFixture, exercise_verifier_fixture, load_verifier_fixture
from pydantic import BaseModel, ConfigDict, PrivateAttr

from nemo_gym_prorl.contracts.task import TaskInstance, load_task
from nemo_gym_prorl.envs import Environment, Episode, Evaluation, make_environment
from nemo_gym_prorl.gym.answers import AnswerSource, submitted_answer
from nemo_gym_prorl.gym.row_session_server import RowSessionServer, RowVerifyRequest
from nemo_gym_prorl.gym.sessions import EpisodeSessions, SessionClosedError, closing_on_shutdown
from nemo_gym_prorl.tool_calls import ToolCall

# What Gym adds to a row around the task's own columns.
_NOT_TASK_DATA = frozenset({"response", "agent_ref", "task_source", "skills_ref", "instance_id"})


class ProrlTaskConfig(BaseResourcesServerConfig):
    task: str  # a task YAML under tasks/ (or a path to one)
    sandbox_backend: str = "bwrap"


class ProrlTaskVerifyResponse(BaseVerifyResponse):
    model_config = ConfigDict(extra="allow")
    resolved: bool
    reason: str
    submitted_answer: str | None
    answer_source: AnswerSource
    grade_details: dict[str, Any]  # what the grader read, ran and compared


class BashRequest(BaseModel):
    command: str


class PythonRequest(BaseModel):
    code: str


class EditorRequest(BaseModel):
    model_config = ConfigDict(extra="allow")  # command, path, file_text, old_str, new_str, insert_line, view_range
    command: str
    path: str


class FinishRequest(BaseModel):
    answer: str | int | float


class ToolResponse(BaseModel):
    output: str


_ROUTES: dict[str, type[BaseModel]] = {
    "bash": BashRequest, "python": PythonRequest, "str_replace_editor": EditorRequest, "finish": FinishRequest,
}  # fmt: skip


def instance_from_gym_row(env: Environment, row: dict[str, Any]) -> TaskInstance:
    """The task instance a Gym row carries; its id from ``instance_id``, the task's id column, or the row's hash."""
    data = {k: v for k, v in row.items() if k not in _NOT_TASK_DATA and not k.startswith("_") and v is not None}
    id_key = env.task.dataset.id_key
    instance_id = row.get("instance_id") or (row.get(id_key) if id_key else None)
    if instance_id is None:
        instance_id = hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()[:16]
    return TaskInstance(instance_id=str(instance_id), data=data)


class ProrlTaskServer(RowSessionServer):
    config: ProrlTaskConfig
    _sessions: EpisodeSessions = PrivateAttr()

    def model_post_init(self, context: Any) -> None:
        super().model_post_init(context)
        env = make_environment(load_task(self.config.task), self.config.sandbox_backend)
        if unrouted := sorted(env.tools.keys() - _ROUTES.keys()):
            raise ValueError(f"task {self.config.task!r} uses tools {unrouted} that this server has no route for")
        self._sessions = EpisodeSessions(env)

    @property
    def env(self) -> Environment:
        return self._sessions.env

    def setup_webserver(self) -> FastAPI:
        app = super().setup_webserver()
        for name in self.env.tools:
            app.post(f"/{name}")(self._tool_route(name, _ROUTES[name]))
        app.router.lifespan_context = closing_on_shutdown(self._sessions, app.router.lifespan_context)
        return app

    def _tool_route(self, name: str, body_model: type[BaseModel]) -> Any:
        async def route(request: Request, body: body_model) -> ToolResponse:  # type: ignore[valid-type]
            episode = await self._sessions.get(request.session[SESSION_ID_KEY])
            if episode is None:
                raise HTTPException(409, "no live session: seed_session first (never seeded, or closed)")
            arguments = body.model_dump(exclude_none=True)  # type: ignore[attr-defined]
            if name == "finish":
                arguments["answer"] = str(arguments["answer"])
            output = await self.env.call_tool(episode, ToolCall(name=name, arguments=arguments))
            return ToolResponse(output=output.text)

        route.__name__ = name
        # FastAPI reads the body model from the annotations, which this module's future import leaves as strings.
        route.__annotations__ = {"request": Request, "body": body_model, "return": ToolResponse}
        return route

    async def seed_row(self, request: Request, row: dict[str, Any]) -> None:
        try:
            await self._sessions.seed(request.session[SESSION_ID_KEY], instance_from_gym_row(self.env, row))
        except SessionClosedError as e:
            raise HTTPException(409, str(e)) from None
        except ValueError as e:  # a row this task cannot use
            raise HTTPException(422, str(e)) from None

    async def close_resources_session(self, body: ResourcesCloseSessionRequest) -> ResourcesCloseSessionResponse:
        await self._sessions.close(body.resources_session_id)
        return ResourcesCloseSessionResponse(resources_session_id=body.resources_session_id)

    async def verify(self, request: Request, body: RowVerifyRequest) -> ProrlTaskVerifyResponse:
        session_id = request.session[SESSION_ID_KEY]
        try:
            episode = await self._sessions.get(session_id)
            return await self.grade_row(body, episode)
        finally:
            await self._sessions.close(session_id)  # grading ends the rollout

    async def grade_row(self, body: RowVerifyRequest, episode: Episode | None = None) -> ProrlTaskVerifyResponse:
        """Grade a verify request: with the session's live episode, or (None) from the response alone."""
        row = body.model_dump()
        episode = episode or Episode(instance=instance_from_gym_row(self.env, row), sandbox=None)
        source: AnswerSource = "finish"
        if episode.answer is None:
            episode.answer, source = submitted_answer(body.response)
        submission = await self.env.collect(episode)
        if episode.sandbox is not None:
            await self.env.close(episode)
        evaluation: Evaluation = await self.env.grade(episode.instance, submission)
        return ProrlTaskVerifyResponse.model_validate(
            row
            | {
                "reward": evaluation.reward,
                "resolved": evaluation.resolved,
                "reason": str(evaluation.details.get("reason", "")),
                "submitted_answer": episode.answer,
                "answer_source": source,
                "grade_details": json.loads(json.dumps(evaluation.details, default=str)),
            }
        )


def verifier_fixture(server_factory: Callable[[], ProrlTaskServer], cases_path: Path) -> VerifierFixture:
    """NeMo Gym's verifier fixture over a task server: each case graded from its response alone (no session)."""
    return VerifierFixture(
        server_factory=server_factory,
        request_model=RowVerifyRequest,
        cases_path=cases_path,
        invoke=lambda server, body: server.grade_row(body),  # type: ignore[attr-defined]
        reseed=lambda server, body: None,  # grading holds no state between requests
    )


async def check_verifier_fixture(fixture: VerifierFixture, repeats: int = 10) -> None:
    """Gym's checks (full reward, zero, malformed, determinism on a fresh server), then the determinism case
    `repeats` times more on one server: the same reward every time."""
    await exercise_verifier_fixture(fixture, reward_range=(0.0, 1.0), determinism="seeded")
    case = next(c for c in load_verifier_fixture(fixture.cases_path) if c.kind == "determinism")
    server, request = fixture.server_factory(), RowVerifyRequest.model_validate(case.request)
    rewards = {(await server.grade_row(request)).reward for _ in range(repeats)}  # type: ignore[attr-defined]
    if rewards != {case.expected_reward}:
        raise AssertionError(f"case {case.name!r}: rewards {sorted(rewards)} over {repeats} runs")
