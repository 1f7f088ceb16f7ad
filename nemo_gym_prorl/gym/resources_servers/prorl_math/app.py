"""ProRL math as a NeMo Gym resources server: our MathEnvironment behind seed_session, tool routes and verify.

One Gym session is one episode — a bubblewrap sandbox with the problem staged. An agent's legacy `/run` seeds
with the whole dataset row and the session cookie names the session; an environment server seeds with a
`ResourcesSeedSessionRequest`, whose `resources_session_id` becomes the cookie's session id. `/bash`, `/python`
and `/finish` run in that session's sandbox; `/verify` grades (the `finish` answer, else the final assistant
message) and closes the sandbox; `/close_session` and server shutdown close whatever is left.
"""

from typing import Any

from fastapi import FastAPI, HTTPException, Request
from pydantic import BaseModel, ConfigDict, PrivateAttr

from nemo_gym.base_resources_server import (
    BaseResourcesServerConfig,
    BaseRunRequest,
    BaseSeedSessionResponse,
    BaseVerifyRequest,
    BaseVerifyResponse,
    ResourcesCloseSessionRequest,
    ResourcesCloseSessionResponse,
    ResourcesSeedSessionRequest,
    ResourcesSeedSessionResponse,
    SimpleResourcesServer,
)
from nemo_gym.server_utils import SESSION_ID_KEY
from nemo_gym_prorl.envs import Episode, make_environment
from nemo_gym_prorl.envs.task import load_task
from nemo_gym_prorl.gym.answers import AnswerSource, submitted_answer
from nemo_gym_prorl.gym.rows import instance_from_row
from nemo_gym_prorl.gym.sessions import EpisodeSessions, SessionClosedError, closing_on_shutdown
from nemo_gym_prorl.tool_calls import ToolCall


class ProrlMathConfig(BaseResourcesServerConfig):
    task: str = "math/arithmetic"  # a task YAML under tasks/ (or a path to one)
    sandbox_backend: str = "bwrap"


class ProrlMathRunRequest(BaseRunRequest):
    model_config = ConfigDict(extra="allow")  # the dataset row: instance_id, question, answer, ...


class ProrlMathVerifyRequest(ProrlMathRunRequest, BaseVerifyRequest):
    pass


class ProrlMathVerifyResponse(BaseVerifyResponse):
    model_config = ConfigDict(extra="allow")
    resolved: bool
    reason: str  # correct | wrong answer | unparseable answer | no answer submitted
    submitted_answer: str | None
    answer_source: AnswerSource
    grade_details: dict[str, Any]  # what the grader parsed and compared


class BashRequest(BaseModel):
    command: str


class PythonRequest(BaseModel):
    code: str


class FinishRequest(BaseModel):
    answer: str | int | float


class ToolResponse(BaseModel):
    output: str


TOOL_ROUTES = frozenset({"bash", "python", "finish"})


class ProrlMathServer(SimpleResourcesServer):
    ray_enabled = False
    config: ProrlMathConfig
    _sessions: EpisodeSessions = PrivateAttr()

    def model_post_init(self, context: Any) -> None:
        super().model_post_init(context)
        env = make_environment(load_task(self.config.task), self.config.sandbox_backend)
        if unrouted := sorted(env.tools.keys() - TOOL_ROUTES):
            raise ValueError(f"task {self.config.task!r} uses tools {unrouted} that this server has no route for")
        self._sessions = EpisodeSessions(env)

    def setup_webserver(self) -> FastAPI:
        app = super().setup_webserver()
        app.post("/bash")(self.bash)
        app.post("/python")(self.python)
        app.post("/finish")(self.finish)
        app.router.lifespan_context = closing_on_shutdown(self._sessions, app.router.lifespan_context)
        return app

    async def seed_session(
        self, request: Request, body: ResourcesSeedSessionRequest | ProrlMathRunRequest
    ) -> ResourcesSeedSessionResponse | BaseSeedSessionResponse:
        if isinstance(body, ResourcesSeedSessionRequest):
            request.session[SESSION_ID_KEY] = body.resources_session_id
            await self._seed(body.resources_session_id, body.task_data)
            return ResourcesSeedSessionResponse(resources_session_id=body.resources_session_id)
        await self._seed(request.session[SESSION_ID_KEY], body.model_dump())
        return BaseSeedSessionResponse()

    async def _seed(self, session_id: str, row: dict[str, Any]) -> None:
        try:
            await self._sessions.seed(session_id, instance_from_row(row))
        except SessionClosedError as e:
            raise HTTPException(409, str(e)) from None
        except ValueError as e:  # a row this task cannot use
            raise HTTPException(422, str(e)) from None

    async def close_resources_session(self, body: ResourcesCloseSessionRequest) -> ResourcesCloseSessionResponse:
        await self._sessions.close(body.resources_session_id)
        return ResourcesCloseSessionResponse(resources_session_id=body.resources_session_id)

    async def bash(self, request: Request, body: BashRequest) -> ToolResponse:
        return await self._call_tool(request, "bash", body.model_dump())

    async def python(self, request: Request, body: PythonRequest) -> ToolResponse:
        return await self._call_tool(request, "python", body.model_dump())

    async def finish(self, request: Request, body: FinishRequest) -> ToolResponse:
        return await self._call_tool(request, "finish", {"answer": str(body.answer)})

    async def _call_tool(self, request: Request, name: str, arguments: dict[str, Any]) -> ToolResponse:
        episode = await self._sessions.get(request.session[SESSION_ID_KEY])
        if episode is None:
            raise HTTPException(409, "no live session: seed_session first (this one was never seeded or is closed)")
        output = await self._sessions.env.call_tool(episode, ToolCall(name=name, arguments=arguments))
        return ToolResponse(output=output.text)

    async def verify(self, request: Request, body: ProrlMathVerifyRequest) -> ProrlMathVerifyResponse:
        row, session_id, env = body.model_dump(), request.session[SESSION_ID_KEY], self._sessions.env
        # A session that is not live (re-verification) is graded from the response alone.
        episode = await self._sessions.get(session_id) or Episode(instance=instance_from_row(row), sandbox=None)
        try:
            source: AnswerSource = "finish"
            if episode.answer is None:
                episode.answer, source = submitted_answer(body.response)
            submission = await env.collect(episode)
        finally:
            await self._sessions.close(session_id)  # grading ends the rollout: its sandbox goes first
        evaluation = await env.grade(episode.instance, submission)
        return ProrlMathVerifyResponse.model_validate(
            row
            | {
                "reward": evaluation.reward,
                "resolved": evaluation.resolved,
                "reason": evaluation.details.get("reason", ""),
                "submitted_answer": episode.answer,
                "answer_source": source,
                "grade_details": evaluation.details,
            }
        )

if __name__ == "__main__":
    ProrlMathServer.run_webserver()
