"""The multi-turn agent loop: model → tool calls → sandbox → results back, up to a turn limit.

How a turn is generated (token-in/token-out or chat completions with token fields) is the `TurnGenerator`'s
business; the loop records on each assistant message exactly what the model saw and produced, and checks NeMo RL's
contiguity rule as it goes: a turn whose prompt does not extend every earlier token is flagged and masked
(``contiguity_error``, ``mask: true``), never silently kept.

A reply without a tool call is a format error the model is told about, unless the environment ends episodes on
such a reply (``Environment.plain_reply_ends_episode``, as NeMo Gym's agents do): then it is the episode's answer.
"""

from __future__ import annotations

from typing import Any, ClassVar

from nemo_gym_prorl.agent.turns import ContextLengthExceeded, Turn, TurnGenerator
from nemo_gym_prorl.contracts.task import TaskInstance
from nemo_gym_prorl.contracts.trajectory import TOKEN_FIELDS, Trajectory
from nemo_gym_prorl.envs.base import Environment, Episode
from nemo_gym_prorl.telemetry import tracing
from nemo_gym_prorl.tool_calls import ParsedReply, ToolCallFormat, parse_openai_tool_calls


def _parse(tool_format: ToolCallFormat, turn: Turn) -> ParsedReply:
    """Chat servers parse tool calls themselves when given tools; otherwise the text is parsed here."""
    if turn.server_message is not None and tool_format.name != "codeact":
        return parse_openai_tool_calls(turn.server_message)
    return tool_format.parse(turn.text)


def _assistant_message(turn: Turn, parsed: ParsedReply, previous: Turn | None) -> dict[str, Any]:
    message: dict[str, Any] = {
        "role": "assistant",
        "content": turn.text,
        "prompt_token_ids": turn.prompt_token_ids,
        "generation_token_ids": turn.generation_token_ids,
        "generation_log_probs": turn.generation_log_probs,
        "finish_reason": turn.finish_reason,
    }
    if turn.policy_version is not None:
        message["policy_version"] = turn.policy_version
    if turn.version_spans:
        message["version_spans"] = turn.version_spans
    if parsed.tool_calls:
        message["tool_calls"] = [call.to_openai() for call in parsed.tool_calls]
    if previous is not None:
        seen = previous.prompt_token_ids + previous.generation_token_ids
        if turn.prompt_token_ids[: len(seen)] != seen:
            message["contiguity_error"] = "the server's prompt does not extend the previous turn's tokens"
            message["mask"] = True
    return message


class AgentLoop:
    # The episode is the environment's alone: a GRPO group's samples may share one init, forked into each.
    can_share_init: ClassVar[bool] = True

    def __init__(self, generator: TurnGenerator, tool_format: ToolCallFormat, max_turns: int) -> None:
        self.generator = generator
        self.tool_format = tool_format
        self.max_turns = max_turns

    async def init(self, env: Environment, instance: TaskInstance) -> Episode:
        """The pipeline's init stage: the environment's, as the task stages it (a harness adds its proxy)."""
        return await env.init(instance)

    async def close(self) -> None:
        """What the loop holds beyond the episode, released with its sandbox: nothing."""

    def start(self, env: Environment, episode: Episode, trajectory: Trajectory) -> None:
        """Set `trajectory` up with the first prompt; `run` fills it in as it goes, so what happened survives a
        timeout or a cancel. The episode's messages are the trajectory's (the environment reads them)."""
        # CodeAct agents act through code blocks the prompt describes, not through function schemas.
        tools = [] if self.tool_format.name == "codeact" else env.tool_schemas(episode.instance)
        episode.messages = [dict(m) for m in env.first_prompt(episode.instance)]  # the samples of a group share it
        trajectory.messages, trajectory.tools, trajectory.finish = episode.messages, tools, "max_turns"
        trajectory.num_tool_calls = trajectory.num_format_errors = 0

    async def first_turn_only(self, trajectory: Trajectory, reason: str) -> None:
        """The model's first turn on the started prompt alone (no sandbox, no tool run), masked: for a rollout
        that ended before that turn. NeMo RL needs a generated token in every result; a masked one trains on none,
        and it is the policy's own generation on the prompt every sample of the group starts from."""
        async with tracing.span("model", turn=0) as span:
            turn = await self.generator.generate(trajectory.messages, trajectory.tools or None, None)
            span.set(prompt_tokens=len(turn.prompt_token_ids), generated_tokens=len(turn.generation_token_ids))
        assistant = {"role": "assistant", "content": turn.text, **turn.model_dump(include=set(TOKEN_FIELDS))}
        assistant.update(finish_reason=turn.finish_reason, mask=True, first_turn_only=reason)
        trajectory.messages.append(assistant)

    async def run(self, env: Environment, episode: Episode, trajectory: Trajectory) -> None:
        """The turns after `start`, on `trajectory`."""
        messages, tools = trajectory.messages, trajectory.tools
        previous: Turn | None = None
        sandbox = {}
        if episode.sandbox is not None:
            sandbox = {"sandbox_id": tracing.sandbox_id(episode.sandbox), "sandbox_backend": env.sandbox_backend}
            tracing.annotate(**sandbox)  # on the run stage's span
        for turn_index in range(self.max_turns):
            try:
                async with tracing.span("model", turn=turn_index) as span:
                    turn = await self.generator.generate(messages, tools or None, previous)
                    span.set(prompt_tokens=len(turn.prompt_token_ids), generated_tokens=len(turn.generation_token_ids),
                             finish_reason=turn.finish_reason)
            except ContextLengthExceeded:
                trajectory.finish = "context_length"
                return
            parsed = _parse(self.tool_format, turn)
            if env.plain_reply_ends_episode and parsed.no_call:  # a malformed call stays a format error
                parsed = parsed.model_copy(update={"error": None, "no_call": False, "final_answer": parsed.content})
            assistant = _assistant_message(turn, parsed, previous)
            error = parsed.error
            if turn.finish_reason == "length":
                error = "reply cut at the max_tokens limit" + (f"; {error}" if error else "")
            if error:
                assistant["format_error"] = error
                trajectory.num_format_errors += 1
            messages.append(assistant)
            previous = turn

            if parsed.final_answer is not None and turn.finish_reason != "length":
                episode.answer = parsed.final_answer
                trajectory.finish = "answer"
                return
            for call in parsed.tool_calls:
                async with tracing.span("tool", turn=turn_index, tool=call.name, **sandbox) as span:
                    result = await env.call_tool(episode, call)
                    span.set(finished=result.finished)
                trajectory.num_tool_calls += 1
                messages.append(self.tool_format.tool_result_message(call, result.text))
                if result.finished:
                    trajectory.finish = "finish"
                    return
            if not parsed.tool_calls:
                messages.append(self.tool_format.format_error_message(error or "no tool call"))
