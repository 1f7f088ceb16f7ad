"""A rollout's model calls: the one core every API the proxy speaks is an adapter over.

An adapter turns its wire request into a `CallRequest` (chat messages in OpenAI's form, OpenAI function tools) and
the `ModelCall` back into its wire answer. The core generates token-in/token-out through the rollout's `PostJSON`
(``pool.poster(trajectory_id)``: one backend per rollout, pause/resume honoured): it renders the chat template
itself and, when a request extends an earlier call's conversation and reply, reuses that call's exact prompt and
generated ids as the prefix (`TokenInTokenOut`). Every call is recorded: prompt and generated ids, log-probs, the
sampling used, what the harness asked for.

Sampling: the trainer's `SamplingParams` are used; the harness's temperature, top_p, seed, stop, model name ... are
recorded (`harness_params`), not applied; its max_tokens only caps the trainer's. Limits (`set_limits`): a call past
the rollout's deadline, its number of calls or its generated-token budget is refused (`CallRefused`, recorded in
`refused`: a policy limit, not a failure), one in flight at the deadline cut, a reply capped at the budget left.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, Literal

from pydantic import BaseModel, Field

from nemo_gym_prorl.agent.turns import PostJSON, TokenInTokenOut, Turn
from nemo_gym_prorl.contracts.sampling import SamplingParams
from nemo_gym_prorl.contracts.trajectory import TOKEN_FIELDS
from nemo_gym_prorl.models.tokenizer import Tokenizer
from nemo_gym_prorl.tool_calls import tool_call_format


class CallRequest(BaseModel):
    """What a harness asked, in the core's terms (each adapter's job to produce)."""

    api: str = Field(description="the API it came in through: chat.completions, responses or messages")
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


Limit = Literal["deadline", "token_budget", "max_calls"]


class Refusal(BaseModel):
    """A call the rollout's limits left unanswered (or cut): the harness hit a policy limit."""

    api: str
    reason: Limit
    message: str
    messages: int = Field(description="how many messages the refused request carried")
    cut: bool = Field(False, description="it was generating when the deadline came")


class CallRefused(Exception):
    """The rollout's deadline or token budget refuses the call; `refusal` is what was recorded."""

    def __init__(self, refusal: Refusal) -> None:
        super().__init__(refusal.message)
        self.refusal = refusal


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
        self.refused: list[Refusal] = []
        self.deadline_s: float | None = None
        self.token_budget: int | None = None
        self.max_calls: int | None = None
        self._deadline: float | None = None  # the event loop's time at the deadline
        self._had: dict[tuple[tuple[Any, ...], ...], list[int]] = {}  # a conversation (messages + reply, as
        # compared) -> the calls that had it

    def set_limits(self, deadline_s: float | None, token_budget: int | None, max_calls: int | None = None) -> None:
        """From now on: no call answered after `deadline_s` seconds, none once `token_budget` tokens were
        generated over all calls, none past `max_calls` answered calls (None: no limit)."""
        self.deadline_s, self.token_budget, self.max_calls = deadline_s, token_budget, max_calls
        self._deadline = None if deadline_s is None else asyncio.get_running_loop().time() + deadline_s

    @property
    def generated_tokens(self) -> int:
        return sum(len(call.turn.generation_token_ids) for call in self.calls)

    async def complete(self, request: CallRequest) -> ModelCall:
        """Generate the reply to `request` and record the call; `CallRefused` past the rollout's limits, and the
        backend's refusals (`LLMRequestError`, `ContextLengthExceeded`) and `LLMUnavailable` propagate for the
        adapter to answer."""
        left = self._budget_left(request)
        previous = self._continued(request)
        sampling = self._sampling(request.max_tokens, left)
        generator = TokenInTokenOut(self._post, self.model, self.tokenizer, sampling, self.context_window)
        deadline = asyncio.timeout_at(self._deadline)
        try:
            async with deadline:
                turn = await generator.generate(request.messages, request.tools, previous.turn if previous else None)
        except TimeoutError:
            if not deadline.expired():
                raise
            message = f"model call cut: the rollout's deadline ({self.deadline_s:g} s) came while it was generating"
            raise self._refuse(request, "deadline", message, cut=True) from None
        reply, error = self._reply(turn, bool(request.tools))
        call = ModelCall(
            index=len(self.calls), api=request.api, messages=request.messages, tools=request.tools, turn=turn,
            reply=reply, sampling=sampling, harness_params=request.harness_params,
            continues=previous.index if previous else None, tool_call_error=error,
        )  # fmt: skip
        self.calls.append(call)
        self._had.setdefault(tuple(_canonical(m) for m in [*call.messages, call.reply]), []).append(call.index)
        return call

    def _continued(self, request: CallRequest) -> ModelCall | None:
        """The latest call whose conversation and reply `request` repeats unchanged and then only adds to (tool
        results, user turns: no assistant turn of its own), with the same tools; None when none is."""
        asked = [_canonical(m) for m in request.messages]
        replies = [i for i, (role, *_) in enumerate(asked) if role == "assistant"]
        if not replies or replies[-1] == len(asked) - 1:  # it repeats no reply, or adds nothing after the last one
            return None
        # a call's conversation ends with its reply: the request can only continue one that ends at its last reply
        for index in reversed(self._had.get(tuple(asked[: replies[-1] + 1]), ())):
            if self.calls[index].tools == request.tools:
                return self.calls[index]
        return None

    def _budget_left(self, request: CallRequest) -> int | None:
        """The tokens this call may still generate (None: no budget); refuses it past a limit."""
        if self._deadline is not None and asyncio.get_running_loop().time() >= self._deadline:
            message = f"model call refused: the rollout's deadline ({self.deadline_s:g} s) has passed"
            raise self._refuse(request, "deadline", message)
        if self.max_calls is not None and len(self.calls) >= self.max_calls:
            message = f"model call refused: the rollout's {self.max_calls} model calls are made"
            raise self._refuse(request, "max_calls", message)
        if self.token_budget is None:
            return None
        left = self.token_budget - self.generated_tokens
        if left <= 0:
            message = f"model call refused: the rollout's token budget ({self.token_budget} generated tokens) is spent"
            raise self._refuse(request, "token_budget", message)
        return left

    def _refuse(self, request: CallRequest, reason: Limit, message: str, cut: bool = False) -> CallRefused:
        refusal = Refusal(api=request.api, reason=reason, message=message, messages=len(request.messages), cut=cut)
        self.refused.append(refusal)
        return CallRefused(refusal)

    def _sampling(self, asked: int | None, left: int | None) -> SamplingParams:
        caps = [cap for cap in (asked, left, self.sampling.max_tokens) if cap is not None]
        if not caps or min(caps) == self.sampling.max_tokens:
            return self.sampling
        return self.sampling.model_copy(update={"max_tokens": min(caps)})

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
