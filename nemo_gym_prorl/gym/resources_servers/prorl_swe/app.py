"""ProRL SWE as a NeMo Gym resources server: our SweEnvironment behind seed_session, tool routes and verify.

One Gym session is one episode: a sandbox with the repository staged on its base. Rows are SWE-bench rows (Gym's
own swebench rows included: their ``responses_create_params`` ride along). `/bash`, `/python`,
`/str_replace_editor` and `/finish` run in the session's sandbox; `/verify` takes the patch from the live sandbox,
closes it, and grades the patch in a fresh one (swebench's grading). A session that is no longer live is graded
as an empty patch. `/close_session` and server shutdown close whatever is left.
"""

from typing import Any, Literal

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
from nemo_gym_prorl.envs import make_environment
from nemo_gym_prorl.envs.task import load_task
from nemo_gym_prorl.gym.rows import instance_from_row
from nemo_gym_prorl.gym.sessions import EpisodeSessions, SessionClosedError, closing_on_shutdown
from nemo_gym_prorl.tool_calls import ToolCall


class ProrlSweConfig(BaseResourcesServerConfig):
    task: str = "swe/offline"  # a swe task YAML under tasks/ (or a path to one)
    sandbox_backend: str = "bwrap"


class ProrlSweRunRequest(BaseRunRequest):
    model_config = ConfigDict(extra="allow")  # the SWE-bench row: instance_id, repo, base_commit, ...


class ProrlSweVerifyRequest(ProrlSweRunRequest, BaseVerifyRequest):
    pass


class ProrlSweVerifyResponse(BaseVerifyResponse):
    model_config = ConfigDict(extra="allow")
    resolved: bool
    reason: str  # resolved | N test(s) fail: ... | the patch does not apply | empty patch ... | a timeout
    model_patch: str
    grade_details: dict[str, Any]  # patch_applied, fail_to_pass, pass_to_pass, failing_tests, notes


class BashRequest(BaseModel):
    command: str


class PythonRequest(BaseModel):
    code: str


class EditorRequest(BaseModel):
    model_config = ConfigDict(extra="allow")  # view_range, file_text, old_str, new_str, insert_line
    command: Literal["view", "create", "str_replace", "insert", "undo_edit"]
    path: str


class FinishRequest(BaseModel):
    answer: str = ""


class ToolResponse(BaseModel):
    output: str


TOOL_ROUTES = frozenset({"bash", "python", "str_replace_editor", "finish"})


class ProrlSweServer(SimpleResourcesServer):
    ray_enabled = False
    config: ProrlSweConfig
    _sessions: EpisodeSessions = PrivateAttr()

    def model_post_init(self, context: Any) -> None:
        super().model_post_init(context)
        task = load_task(self.config.task)
        if task.type != "swe":
            raise ValueError(f"task {self.config.task!r} is of type {task.type!r}; this server serves swe tasks")
        env = make_environment(task, self.config.sandbox_backend)
        if unrouted := sorted(env.tools.keys() - TOOL_ROUTES):
            raise ValueError(f"task {self.config.task!r} uses tools {unrouted} that this server has no route for")
        self._sessions = EpisodeSessions(env)

    def setup_webserver(self) -> FastAPI:
        app = super().setup_webserver()
        for name in sorted(TOOL_ROUTES):
            app.post(f"/{name}")(getattr(self, name))
        app.router.lifespan_context = closing_on_shutdown(self._sessions, app.router.lifespan_context)
        return app

    async def seed_session(
        self, request: Request, body: ResourcesSeedSessionRequest | ProrlSweRunRequest
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
        except ValueError as e:  # a row this task cannot use (the message names the row and the field)
            raise HTTPException(422, str(e)) from None
        except FileNotFoundError as e:  # the instance's image
            raise HTTPException(424, str(e)) from None

    async def close_resources_session(self, body: ResourcesCloseSessionRequest) -> ResourcesCloseSessionResponse:
        await self._sessions.close(body.resources_session_id)
        return ResourcesCloseSessionResponse(resources_session_id=body.resources_session_id)

    async def bash(self, request: Request, body: BashRequest) -> ToolResponse:
        return await self._call_tool(request, "bash", body.model_dump())

    async def python(self, request: Request, body: PythonRequest) -> ToolResponse:
        return await self._call_tool(request, "python", body.model_dump())

    async def str_replace_editor(self, request: Request, body: EditorRequest) -> ToolResponse:
        return await self._call_tool(request, "str_replace_editor", body.model_dump(exclude_none=True))

    async def finish(self, request: Request, body: FinishRequest) -> ToolResponse:
        return await self._call_tool(request, "finish", body.model_dump())

    async def _call_tool(self, request: Request, name: str, arguments: dict[str, Any]) -> ToolResponse:
        episode = await self._sessions.get(request.session[SESSION_ID_KEY])
        if episode is None:
            raise HTTPException(409, "no live session: seed_session first (this one was never seeded or is closed)")
        output = await self._sessions.env.call_tool(episode, ToolCall(name=name, arguments=arguments))
        return ToolResponse(output=output.text)

    async def verify(self, request: Request, body: ProrlSweVerifyRequest) -> ProrlSweVerifyResponse:
        row, session_id, env = body.model_dump(), request.session[SESSION_ID_KEY], self._sessions.env
        episode = await self._sessions.get(session_id)
        try:
            submission = await env.collect(episode) if episode is not None else {"patch": ""}
        finally:
            await self._sessions.close(session_id)  # the run's sandbox goes before grading starts another
        evaluation = await env.grade(instance_from_row(row), submission)
        return ProrlSweVerifyResponse.model_validate(
            row
            | {
                "reward": evaluation.reward,
                "resolved": evaluation.resolved,
                "reason": evaluation.details.get("reason", ""),
                "model_patch": submission["patch"],
                "grade_details": evaluation.details,
            }
        )


if __name__ == "__main__":
    ProrlSweServer.run_webserver()
