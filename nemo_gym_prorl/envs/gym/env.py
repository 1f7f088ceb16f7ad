"""An environment served by any NeMo Gym resources server over HTTP, so the orchestrator drives Gym's servers too.

The task's dataset holds Gym rows (``responses_create_params`` with the input messages and the tools, plus the
server's own fields). An episode is a Gym session: ``/seed_session`` with the row (cookies carry the session, as
Gym's agents do), each tool call a ``POST /<tool name>``, and grading ``/verify`` with the conversation as Gym
Responses-API output. The resources server owns its sandboxes; this side holds none. Sessions seeded this way
(Gym's legacy agent path, which every resources server accepts) have no close call: a cancelled episode's
server-side state is the server's to expire. As in Gym's simple_agent, an assistant reply without a tool call ends
the episode; ``/verify`` grades it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from nemo_gym.openai_utils import NeMoGymResponseCreateParamsNonStreaming
from nemo_gym.responses_converter import ResponsesConverter
from pydantic import ValidationError

from nemo_gym_prorl.contracts.responses import gym_output_items
from nemo_gym_prorl.contracts.task import TaskConfig, TaskConfigError, TaskInstance
from nemo_gym_prorl.envs.base import Environment, Episode, Evaluation, SpecHook, Submission
from nemo_gym_prorl.json_http import JsonHttp
from nemo_gym_prorl.tool_calls import ToolCall
from nemo_gym_prorl.tools import ToolOutput


def chat_tools(responses_tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Responses-API function tools (flat) as chat-completions tools (nested under ``function``)."""
    out = []
    for tool in responses_tools:
        if tool.get("type") == "function":
            function = {k: tool[k] for k in ("name", "description", "parameters") if k in tool}
            out.append({"type": "function", "function": function})
    return out


def _cookie_header(cookies: dict[str, str]) -> dict[str, str]:
    """An episode's session cookies as a request header: one session per episode on one shared client."""
    return {"cookie": "; ".join(f"{name}={value}" for name, value in cookies.items())} if cookies else {}


# Gym's own Responses → chat conversion, as its vllm_model applies it to every request: function_call /
# function_call_output items become assistant tool calls and tool messages, reasoning items <think> text.
_RESPONSES_TO_CHAT = ResponsesConverter(return_token_id_information=False)


def _chat_message(message: dict[str, Any]) -> dict[str, Any]:
    """A converted message as our templates take it: text parts joined into one string (other parts, an image
    say, stay a list for a chat server to read), the developer role as system."""
    content = message.get("content")
    if isinstance(content, list) and all(part.get("type") == "text" for part in content):
        message = message | {"content": "".join(part.get("text", "") for part in content)}
    if message["role"] == "developer":
        message = message | {"role": "system"}
    return message


def row_create_params(row: Mapping[str, Any]) -> dict[str, Any]:
    """A Gym row's ``responses_create_params`` (its first prompt and tools); a clear error when it has none."""
    params = row.get("responses_create_params")
    if not isinstance(params, dict):
        raise ValueError("a Gym row needs responses_create_params with the input messages")
    return params


def row_prompt_messages(row: Mapping[str, Any]) -> list[dict[str, Any]]:
    """A Gym row's first prompt as chat messages, converted as Gym's vllm_model converts a request's input."""
    try:
        request = NeMoGymResponseCreateParamsNonStreaming.model_validate(row_create_params(row))
        chat = _RESPONSES_TO_CHAT.responses_to_chat_completion_create_params(request)
    except (ValidationError, NotImplementedError) as e:
        raise ValueError(f"responses_create_params: {e}") from e
    messages = [_chat_message(m) for m in chat.model_dump(exclude_none=True)["messages"]]
    if not messages:
        raise ValueError("responses_create_params.input must be a string or a non-empty list of items")
    return messages


GYM_SERVER_KEEPALIVE_S = 30.0  # how long Gym's servers keep an idle connection (uvicorn's timeout_keep_alive there)


class GymResourcesEnvironment(Environment):
    plain_reply_ends_episode = True
    keeps_submission = False

    @property
    def can_fork(self) -> bool:
        return False  # the episode is the Gym server's session, not a sandbox of ours

    def __init__(self, task: TaskConfig, sandbox_backend: str = "bwrap") -> None:
        if not task.resources_server_url:
            raise TaskConfigError(f"{task.origin}: field 'resources_server_url': a gym task needs its server's URL")
        super().__init__(task, sandbox_backend)
        self.url = task.resources_server_url.rstrip("/")
        self.http = JsonHttp(timeout_s=task.tool_timeout_s + 30, keepalive_s=GYM_SERVER_KEEPALIVE_S / 2)

    def prompt_messages(self, instance: TaskInstance) -> list[dict[str, Any]]:
        return row_prompt_messages(instance.data)

    def tool_schemas(self, instance: TaskInstance | None = None) -> list[dict[str, Any]]:
        return chat_tools(row_create_params(instance.data).get("tools") or []) if instance is not None else []

    async def init(self, instance: TaskInstance, spec_hook: SpecHook | None = None) -> Episode:
        # the server owns the sandbox: nothing here to hook (a harness runner refuses an episode without one)
        response = await self.http.post(f"{self.url}/seed_session", instance.data)
        response.raise_for_status()
        return Episode(instance=instance, sandbox=None, session=response.cookies)

    async def call_tool(self, episode: Episode, call: ToolCall) -> ToolOutput:
        response = await self.http.post(
            f"{self.url}/{call.name}", call.arguments, headers=_cookie_header(episode.session)
        )
        if response.status == 404:
            return ToolOutput(text=f"unknown tool {call.name!r}")
        if response.status == 422:
            return ToolOutput(text=f"{call.name}: invalid arguments: {response.text[:500]}")
        response.raise_for_status()
        episode.session.update(response.cookies)  # a server may move its session on
        return ToolOutput(text=response.text)

    async def collect(self, episode: Episode) -> Submission:
        return {"output": gym_output_items(episode.messages), "cookies": episode.session}

    async def grade(self, instance: TaskInstance, submission: Submission) -> Evaluation:
        params = row_create_params(instance.data)
        body = instance.data | {
            "response": {
                "id": "resp_prorl",
                "object": "response",
                "created_at": 0,
                "model": "policy",
                "output": submission["output"],
                "parallel_tool_calls": True,
                "tool_choice": "auto",
                "tools": params.get("tools") or [],
            }
        }
        response = await self.http.post(f"{self.url}/verify", body, headers=_cookie_header(submission["cookies"]))
        response.raise_for_status()
        verdict = response.json()
        reward = float(verdict["reward"])
        details = {k: v for k, v in verdict.items() if k not in body and k != "reward"}
        return Evaluation(reward=reward, resolved=reward >= 1.0, details=json.loads(json.dumps(details, default=str)))

    async def close(self, episode: Episode) -> None:
        """Nothing to release here: a Gym session seeded with a row (as Gym's own agents seed it) ends at verify."""

    async def aclose(self) -> None:
        await self.http.aclose()
