"""A token-in/token-out completion that a weight update may cut, and its re-issue with the exact same prefix.

Streamed, every token arrives with its log-prob and is kept with the version of the weights that generated it. Cut,
the request is re-issued as prompt + the ids generated so far (never re-tokenised text) with the rest of its token
budget, and the continuation appended: one answer whose ids and log-probs are each token's own and whose
``version_spans`` say which version generated which tokens (NeMo RL's ``in_flight_weight_updates``, with a cut in
place of vLLM's in-place swap). Design notes: docs/service.md#weight-updates
"""

from __future__ import annotations

from typing import Any


class PartialCompletion:
    """What one ``/completions`` request (a body with a token-id ``prompt``) has generated so far, over its cuts."""

    def __init__(self, request: dict[str, Any]) -> None:
        prompt = request.get("prompt")
        if not isinstance(prompt, list) or not all(isinstance(t, int) for t in prompt):
            raise ValueError("a completion cut by a weight update is re-issued by token ids: `prompt` must be a list of ids")
        self.request = request
        self.ids: list[int] = []
        self.log_probs: list[float] = []
        self.texts: list[str] = []
        self.spans: list[list[int | None]] = []  # [version, tokens], in order
        self.finish_reason: str | None = None
        self.cuts = 0

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def budget(self) -> int | None:
        """Tokens it may still generate (None: no max_tokens was asked)."""
        max_tokens = self.request.get("max_tokens")
        return None if max_tokens is None else max_tokens - len(self.ids)

    def body(self) -> dict[str, Any]:
        """The request to send now: its prompt extended by what was generated before a cut, streamed."""
        body = {**self.request, "prompt": self.request["prompt"] + self.ids, "stream": True}
        if self.budget is not None:
            body["max_tokens"] = self.budget
        return body

    def add(self, event: dict[str, Any], version: int | None) -> None:
        """One streamed chunk; its tokens are `version`'s unless its server stamped its own."""
        for choice in event.get("choices") or ():
            ids = choice.get("token_ids") or []
            log_probs = (choice.get("logprobs") or {}).get("token_logprobs") or []
            if len(log_probs) != len(ids):
                raise ValueError(f"a streamed chunk had {len(log_probs)} log-probs for {len(ids)} token ids")
            self.ids += ids
            self.log_probs += log_probs
            self.texts.append(choice.get("text") or "")
            stamped = choice.get("policy_version", version)
            if ids and self.spans and self.spans[-1][0] == stamped:
                self.spans[-1][1] = (self.spans[-1][1] or 0) + len(ids)
            elif ids:
                self.spans.append([stamped, len(ids)])
            if choice.get("finish_reason") is not None:
                self.finish_reason = choice["finish_reason"]

    def answer(self) -> dict[str, Any]:
        """The whole completion as a plain (unstreamed) answer; ``policy_version`` is the version it started on."""
        finish = self.finish_reason or "length"  # only a spent budget ends it without one
        choice: dict[str, Any] = {
            "index": 0,
            "text": "".join(self.texts),
            "token_ids": self.ids,
            "logprobs": {"token_logprobs": self.log_probs},
            "finish_reason": finish,
        }
        if self.spans and self.spans[0][0] is not None:
            choice["policy_version"] = self.spans[0][0]
        if self.cuts:
            choice["version_spans"] = self.spans
        prompt = len(self.request["prompt"])
        usage = {"prompt_tokens": prompt, "completion_tokens": len(self.ids), "total_tokens": prompt + len(self.ids)}
        return {"object": "text_completion", "choices": [choice], "usage": usage, "cuts": self.cuts}
