"""A rollout's model calls: the one core every API the proxy speaks is an adapter over.

An adapter turns its wire request into a `CallRequest` (chat messages in OpenAI's form, OpenAI function tools) and
the `ModelCall` back into its wire answer. The core generates token-in/token-out through the rollout's `PostJSON`
(the service passes ``pool.poster(trajectory_id)``: one backend per rollout, pause/resume honoured by the pool):
it renders the model's chat template itself and, when a request's messages extend an earlier call's conversation
and the reply it got, reuses that call's exact prompt and generated ids as the prefix (`TokenInTokenOut`), so a
harness that only appends never has its history re-tokenized. Every call is recorded: exact prompt ids, generated
ids, log-probs, the sampling parameters used, and what the harness asked for.

Sampling: the trainer's `SamplingParams` are the ones used. The harness's own temperature, top_p, seed, stop, model
name and the like are recorded on the call (`harness_params`) and not applied; its max_tokens (or
max_completion_tokens) only caps the trainer's, since a shorter reply changes no token's probability.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, Field

from nemo_gym_prorl.agent.turns import PostJSON, TokenInTokenOut, Turn
from nemo_gym_prorl.contracts.sampling import SamplingParams
from nemo_gym_prorl.contracts.trajectory import TOKEN_FIELDS
from nemo_gym_prorl.models.tokenizer import Tokenizer
from nemo_gym_prorl.tool_calls import tool_call_format


class CallRequest(BaseModel):
    """What a harness asked, in the core's terms (each adapter's job to produce)."""

    api: str = Field(description="the API it came in through: chat.completions (later responses, messages)")
    messages: list[dict[str, Any]] = Field(description="chat messages, OpenAI's form, content as text")
    tools: list[dict[str, Any]] | None = Field(None, description="OpenAI function tools")
    max_tokens: int | None = Field(None, ge=1, description="the harness's cap on the reply")
    harness_params: dict[str, Any] = Field(default_factory=dict, description="the rest it sent, recorded only")


class ModelCall(BaseModel):
    """One answered call: what the harness sent, the exact tokens, and the reply it got."""

    index: int
    api: str
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    turn: Turn = Field(description="exact prompt ids, generated ids and log-probs, as the backend returned them")
    reply: dict[str, Any] = Field(description="the assistant message the harness got (content, tool_calls)")
    sampling: SamplingParams = Field(description="what generated it: the trainer's, max_tokens capped")
    harness_params: dict[str, Any] = Field(default_factory=dict)
    continues: int | None = Field(None, description="the call whose tokens this prompt extends; None: rendered anew")
    tool_call_error: str | None = Field(None, description="tool calls in the text that could not be parsed")

    @property
    def finish_reason(self) -> str:
        return "tool_calls" if self.reply.get("tool_calls") else self.turn.finish_reason

    def assistant_turn(self) -> dict[str, Any]:
        """The call as a trajectory's assistant message: the model's text, its tool calls, the token fields."""
        message: dict[str, Any] = {"role": "assistant", "content": self.turn.text}
        if self.reply.get("tool_calls"):
            message["tool_calls"] = self.reply["tool_calls"]
        message |= self.turn.model_dump(include=set(TOKEN_FIELDS))
        message.update(finish_reason=self.finish_reason, call=self.index)
        if self.turn.policy_version is not None:
            message["policy_version"] = self.turn.policy_version
        return message


class ModelCalls:
    """The rollout's calls, answered and recorded in `calls` (in the order they were answered).

    `tool_format` parses tool calls out of the model's text when a request offers tools (`tool_calls.py`);
    `context_window` is what a reply may fill when neither side sets max_tokens."""

    def __init__(
        self, post: PostJSON, model: str, tokenizer: Tokenizer, sampling: SamplingParams,
        tool_format: str = "hermes", context_window: int | None = None,
    ) -> None:  # fmt: skip
        self._post = post
        self.model = model
        self.tokenizer = tokenizer
        self.sampling = sampling
        self.tool_format = tool_call_format(tool_format)
        self.context_window = context_window
        self.calls: list[ModelCall] = []
        self._conversations: list[list[tuple[Any, ...]]] = []  # each call's messages and reply, as compared

    async def complete(self, request: CallRequest) -> ModelCall:
        """Generate the reply to `request` and record the call; the backend's refusals (`LLMRequestError`,
        `ContextLengthExceeded`) and `LLMUnavailable` propagate for the adapter to answer."""
        previous = self._continued(request)
        sampling = self._sampling(request.max_tokens)
        generator = TokenInTokenOut(self._post, self.model, self.tokenizer, sampling, self.context_window)
        turn = await generator.generate(request.messages, request.tools, previous.turn if previous else None)
        reply, error = self._reply(turn, bool(request.tools))
        call = ModelCall(
            index=len(self.calls), api=request.api, messages=request.messages, tools=request.tools, turn=turn,
            reply=reply, sampling=sampling, harness_params=request.harness_params,
            continues=previous.index if previous else None, tool_call_error=error,
        )  # fmt: skip
        self.calls.append(call)
        self._conversations.append([_canonical(m) for m in [*call.messages, call.reply]])
        return call

    def _continued(self, request: CallRequest) -> ModelCall | None:
        """The latest call whose conversation and reply `request` repeats unchanged and then only adds to (tool
        results, user turns: no assistant turn of its own), with the same tools; None when none is."""
        asked = [_canonical(m) for m in request.messages]
        for call, seen in zip(reversed(self.calls), reversed(self._conversations), strict=True):
            added = asked[len(seen) :]
            fresh = bool(added) and all(role != "assistant" for role, *_ in added)
            if fresh and call.tools == request.tools and asked[: len(seen)] == seen:
                return call
        return None

    def _sampling(self, asked: int | None) -> SamplingParams:
        if asked is None:
            return self.sampling
        cap = asked if self.sampling.max_tokens is None else min(asked, self.sampling.max_tokens)
        return self.sampling.model_copy(update={"max_tokens": cap})

    def _reply(self, turn: Turn, tools_offered: bool) -> tuple[dict[str, Any], str | None]:
        """The assistant message for the harness, and the parse error of tool calls it could not be given. A reply
        whose calls do not all parse goes back as plain text, so the harness sees what the model wrote."""
        if not tools_offered or self.tool_format.name == "codeact":  # CodeAct harnesses read the text themselves
            return {"role": "assistant", "content": turn.text}, None
        parsed = self.tool_format.parse(turn.text)
        if parsed.tool_calls and parsed.error is None:
            calls = [call.to_openai() for call in parsed.tool_calls]
            return {"role": "assistant", "content": parsed.content or None, "tool_calls": calls}, None
        return {"role": "assistant", "content": turn.text}, None if parsed.no_call else parsed.error


def _canonical(message: dict[str, Any]) -> tuple[Any, ...]:
    """What must match for a message to be the same one again: a harness may re-send null content as "", or
    re-serialise a tool call's arguments."""
    calls = tuple(
        (call.get("function", {}).get("name"), _arguments(call.get("function", {}).get("arguments")))
        for call in message.get("tool_calls") or ()
    )
    return message.get("role"), message.get("content") or "", calls, message.get("tool_call_id")


def _arguments(arguments: Any) -> str:
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return arguments
    return json.dumps(arguments or {}, sort_keys=True)
