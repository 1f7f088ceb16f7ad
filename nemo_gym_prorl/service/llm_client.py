"""Token-in/token-out model calls: a prompt of token ids in, generated ids and their log-probs out.

Speaks the plain vLLM protocol (``/v1/completions`` with a token-id prompt, ``return_token_ids``, ``logprobs``),
which our embedded server implements too.
"""

from __future__ import annotations

from typing import Any

import httpx
from pydantic import BaseModel

from nemo_gym_prorl.models.engine import SamplingParams


class ContextLengthExceeded(Exception):
    """The server refused the prompt: it does not fit the model's context window."""


class Completion(BaseModel):
    token_ids: list[int]
    log_probs: list[float]
    text: str
    finish_reason: str


class CompletionsClient:
    def __init__(self, base_url: str, model: str, http: httpx.AsyncClient) -> None:
        self.url = base_url.rstrip("/") + "/completions"
        self.model = model
        self._http = http

    async def complete(self, prompt_ids: list[int], sampling: SamplingParams) -> Completion:
        body: dict[str, Any] = {
            "model": self.model,
            "prompt": prompt_ids,
            "max_tokens": sampling.max_tokens,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "logprobs": 0,
            "return_token_ids": True,
        }
        if sampling.seed is not None:
            body["seed"] = sampling.seed
        response = await self._http.post(self.url, json=body)
        if response.status_code == 400 and "context length" in response.text:
            raise ContextLengthExceeded(response.json()["error"]["message"])
        response.raise_for_status()
        choice = response.json()["choices"][0]
        token_ids = choice["token_ids"]
        log_probs = choice["logprobs"]["token_logprobs"]
        if len(log_probs) != len(token_ids):
            raise ValueError(f"server returned {len(log_probs)} log-probs for {len(token_ids)} tokens")
        return Completion(
            token_ids=token_ids, log_probs=log_probs, text=choice["text"], finish_reason=choice["finish_reason"]
        )
