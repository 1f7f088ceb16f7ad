"""The two ways a rollout asks a model for its next turn, both keeping exact token ids.

- ``TokenInTokenOut``: we render the chat template ourselves and send token-id prompts to ``/v1/completions``
  (plain vLLM, our embedded server). The next prompt is the previous prompt + the generated ids + the tokens of
  what follows, so earlier turns are never re-tokenized.
- ``ChatCompletions``: ``/v1/chat/completions`` with NeMo RL's token fields; earlier assistant messages carry their
  ``prompt_token_ids``/``generation_token_ids`` and the server splices them back as the exact prefix.

Both post through a ``PostJSON`` callable — one HTTP client to one server, or the service's LLM pool, which keeps a
trajectory on one backend.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, Literal, Protocol

from pydantic import BaseModel

from nemo_gym_prorl.contracts.sampling import SamplingParams
from nemo_gym_prorl.contracts.trajectory import TOKEN_FIELDS
from nemo_gym_prorl.json_http import JsonHttp
from nemo_gym_prorl.models.tokenizer import Tokenizer
from nemo_gym_prorl.telemetry import tracing

GenerationMode = Literal["tokens", "chat"]
PostJSON = Callable[[str, dict[str, Any]], Awaitable[dict[str, Any]]]


class LLMRequestError(Exception):
    """The model server refused a request (a 4xx): retrying it unchanged cannot help."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status
        self.message = message


class ContextLengthExceeded(LLMRequestError):
    """The prompt (plus the completion budget) does not fit the model's context window."""


class NoCompletionsRoute(LLMRequestError):
    """Token-in/token-out against a server without ``/v1/completions`` (NeMo RL's chat server)."""


# How servers word a prompt that does not fit: vLLM ("maximum context length"), NeMo RL's server ("Prompt length (N)
# fills or exceeds max_model_len (M)"), ours.
_CONTEXT_OVERFLOW = ("context length", "fills or exceeds max_model_len")


def refusal(status: int, message: str) -> LLMRequestError:
    """The typed error for a 4xx answer; context-window refusals are told apart by their message."""
    if status == 400 and any(words in message for words in _CONTEXT_OVERFLOW):
        return ContextLengthExceeded(status, message)
    return LLMRequestError(status, message)


def request_fault(status: int, message: str) -> LLMRequestError | None:
    """A 5xx whose body says the request caused it (a context overflow, a failed assertion); None when it does not."""
    if any(words in message for words in _CONTEXT_OVERFLOW):
        return ContextLengthExceeded(status, message)
    if "AssertionError" in message:
        return LLMRequestError(status, message)
    return None


def http_poster(http: JsonHttp, base_url: str) -> PostJSON:
    """A PostJSON to one server: 4xx become LLMRequestError, 5xx HttpStatusError, no answer HttpTransportError."""
    base = base_url.rstrip("/")

    async def post(path: str, body: dict[str, Any]) -> dict[str, Any]:
        tracing.annotate(backend=base)
        response = await http.post(base + path, body)
        if 400 <= response.status < 500:
            raise refusal(response.status, response.error_message())
        response.raise_for_status()
        return response.json()

    return post


class Turn(BaseModel):
    """One generation: the exact prompt it continued, what the model produced, and how it stopped."""

    prompt_token_ids: list[int]
    generation_token_ids: list[int]
    generation_log_probs: list[float]
    text: str
    finish_reason: str
    server_message: dict[str, Any] | None = None  # chat mode: the message as the server parsed it
    policy_version: int | None = None  # the version of the weights that generated it (began it), when known
    version_spans: list[tuple[int | None, int]] | None = None  # cut by weight updates: (version, tokens) in order


def _sampling_body(sampling: SamplingParams) -> dict[str, Any]:
    body: dict[str, Any] = {"temperature": sampling.temperature, "top_p": sampling.top_p}
    if sampling.max_tokens is not None:
        body["max_tokens"] = sampling.max_tokens
    if sampling.seed is not None:
        body["seed"] = sampling.seed
    if sampling.top_k > 0:
        body["top_k"] = sampling.top_k
    return body


def _checked_turn(turn: Turn) -> Turn:
    if len(turn.generation_log_probs) != len(turn.generation_token_ids):
        raise ValueError(
            f"server returned {len(turn.generation_log_probs)} log-probs for {len(turn.generation_token_ids)} tokens"
        )
    return turn


class TurnGenerator(Protocol):
    async def generate(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, previous: Turn | None
    ) -> Turn:
        """The next assistant turn for `messages` (the whole conversation so far, ending with the newest
        user/tool messages); `previous` is this rollout's last turn, whose assistant message is in `messages`."""
        ...


class TokenInTokenOut:
    """`context_window`: what a turn may fill when the sampling params set no max_tokens. /v1/completions caps such
    a turn at 16 tokens (OpenAI's default, which vLLM keeps), where chat completions give it the rest of the
    context; this gives it the rest of the context too."""

    def __init__(
        self, post: PostJSON, model: str, tokenizer: Tokenizer, sampling: SamplingParams,
        context_window: int | None = None,
    ) -> None:  # fmt: skip
        self._post = post
        self.model = model
        self.tokenizer = tokenizer
        self.sampling = sampling
        self.context_window = context_window

    def next_prompt(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, previous: Turn | None) -> list[int]:
        template = self.tokenizer.chat_template
        if previous is None:
            return self.tokenizer.encode(template.render(messages, tools, add_generation_prompt=True))
        last = max(i for i, m in enumerate(messages) if m.get("role") == "assistant")
        generated = previous.generation_token_ids
        end = self.tokenizer.generation_end(generated)
        following = template.continuation_text(messages[: last + 1], messages[last + 1 :], tools, end)
        return previous.prompt_token_ids + generated + self.tokenizer.encode(following)

    async def generate(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, previous: Turn | None
    ) -> Turn:
        prompt = self.next_prompt(messages, tools, previous)
        body = {"model": self.model, "prompt": prompt, "logprobs": 0, "return_token_ids": True}
        body |= _sampling_body(self.sampling)
        if "max_tokens" not in body and self.context_window is not None:
            body["max_tokens"] = self.context_window - len(prompt)
            if body["max_tokens"] < 1:
                filled = f"the {len(prompt)}-token prompt fills the {self.context_window}-token context"
                raise ContextLengthExceeded(400, filled)
        try:
            choice = (await self._post("/completions", body))["choices"][0]
        except LLMRequestError as e:
            if e.status in (404, 405):
                raise NoCompletionsRoute(
                    e.status,
                    f"{e.message}: the model server has no /v1/completions, which token-in/token-out generation "
                    "needs (plain vLLM and our local server have it; NeMo RL's chat server speaks only "
                    "/v1/chat/completions and /tokenize): use generation_mode=chat with it",
                ) from None
            raise
        return _checked_turn(
            Turn(
                prompt_token_ids=prompt,
                generation_token_ids=choice["token_ids"],
                generation_log_probs=choice["logprobs"]["token_logprobs"],
                text=choice["text"],
                finish_reason=choice["finish_reason"],
                policy_version=choice.get("policy_version"),
                version_spans=choice.get("version_spans"),
            )
        )


class ChatCompletions:
    def __init__(self, post: PostJSON, model: str, sampling: SamplingParams) -> None:
        self._post = post
        self.model = model
        self.sampling = sampling

    async def generate(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, previous: Turn | None
    ) -> Turn:
        body: dict[str, Any] = {
            "model": self.model,
            "messages": [_wire_message(m) for m in messages],
            "logprobs": True,
            "top_logprobs": 0,
            "return_tokens_as_token_ids": True,
        }
        if tools:
            body["tools"] = tools
        sampling = _sampling_body(self.sampling)
        try:
            answer = await self._post("/chat/completions", body | sampling)
        except LLMRequestError as e:
            if e.status < 500 or isinstance(e, ContextLengthExceeded):
                raise
            sent = ", ".join(f"{k}={sampling.get(k)}" for k in ("temperature", "top_p", "top_k"))
            raise LLMRequestError(
                e.status,
                f"{e.message}. This request sent {sent}: NeMo RL's chat server answers 500 when temperature or top_p "
                "differ from the policy's (generation.temperature/top_p, or val_temperature/val_top_p) or top_k is "
                "set; the row's responses_create_params carry them",
            ) from None
        choice = answer["choices"][0]
        message = choice["message"]
        missing = [f for f in TOKEN_FIELDS if f not in message]
        if missing:
            raise ValueError(f"the chat server returned no {', '.join(missing)}: it does not speak NeMo RL's token fields")
        return _checked_turn(
            Turn(
                prompt_token_ids=message["prompt_token_ids"],
                generation_token_ids=message["generation_token_ids"],
                generation_log_probs=message["generation_log_probs"],
                text=message.get("content") or "",
                finish_reason=choice["finish_reason"],
                server_message=message,
                policy_version=message.get("policy_version"),
            )
        )


_WIRE_KEYS = ("role", "content", "tool_calls", "tool_call_id", "name", *TOKEN_FIELDS)


def _wire_message(message: dict[str, Any]) -> dict[str, Any]:
    """A message as a chat server takes it: our bookkeeping keys (format_error, ...) stay home, token fields go."""
    return {k: v for k, v in message.items() if k in _WIRE_KEYS}


def turn_generator(
    mode: GenerationMode, post: PostJSON, model: str, sampling: SamplingParams, tokenizer: Tokenizer | None,
    context_window: int | None = None,
) -> TurnGenerator:  # fmt: skip
    if mode == "chat":
        return ChatCompletions(post, model, sampling)
    if tokenizer is None:
        raise ValueError("token-in/token-out generation needs the model's tokenizer")
    return TokenInTokenOut(post, model, tokenizer, sampling, context_window)
