"""Request and response shapes of the OpenAI-compatible API, with vLLM's and NeMo RL's token extensions."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from nemo_gym_prorl.contracts.sampling import SamplingParams


class _Request(BaseModel):
    # Clients send many OpenAI fields we do not use (user, metadata, ...): accept and ignore them.
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int | None = None
    max_tokens: int | None = Field(None, ge=1)
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = Field(1, ge=1, le=1, description="one choice per request")
    stream: bool = Field(False, description="completions only: one token a chunk, as server-sent events")
    return_token_ids: bool = False

    def sampling_params(self, top_logprobs: int) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(
            max_tokens=self.max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k if self.top_k is not None else -1,
            seed=self.seed,
            stop=stop,
            top_logprobs=top_logprobs,
        )


class ChatCompletionRequest(_Request):
    messages: list[dict[str, Any]] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    return_tokens_as_token_ids: bool = False

    @model_validator(mode="after")
    def _completion_tokens_alias(self) -> ChatCompletionRequest:
        if self.max_tokens is None:
            self.max_tokens = self.max_completion_tokens
        return self

    @field_validator("stream")
    @classmethod
    def _not_streamed(cls, stream: bool) -> bool:
        if stream:
            raise ValueError("streaming is for /v1/completions only: chat completions answer whole")
        return stream

    @field_validator("messages")
    @classmethod
    def _messages_have_roles(cls, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        for i, message in enumerate(messages):
            if message.get("role") not in ("system", "developer", "user", "assistant", "tool"):
                raise ValueError(f"messages[{i}].role must be system, user, assistant or tool")
        return messages


class CompletionRequest(_Request):
    prompt: str | list[int] | list[list[int]] | list[str]
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: Literal[False] = Field(False, description="echo is not supported")
    return_tokens_as_token_ids: bool = False

    @model_validator(mode="after")
    def _stream_without_stop(self) -> CompletionRequest:
        if self.stream and self.stop:
            raise ValueError("stop with stream is not supported: a streamed token cannot be taken back at a stop string")
        return self

    @field_validator("prompt")
    @classmethod
    def _single_prompt(cls, prompt: Any) -> Any:
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (list, str)):
            if len(prompt) != 1:
                raise ValueError("only one prompt per request is supported")
            return prompt[0]
        if isinstance(prompt, list) and not prompt:
            raise ValueError("prompt is empty")
        return prompt


class TokenizeRequest(BaseModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = True
    add_special_tokens: bool | None = None

    @model_validator(mode="after")
    def _prompt_or_messages(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt or messages")
        return self


class DetokenizeRequest(BaseModel):
    model: str | None = None
    tokens: list[int]


def error_body(message: str, status: int, param: str | None = None) -> dict[str, Any]:
    kind = {400: "BadRequestError", 404: "NotFoundError"}.get(status, "InternalServerError")
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}
