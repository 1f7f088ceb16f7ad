"""One trajectory's page: its conversation with per-turn token counts and per-token log-probs (with the tokens'
text when a tokenizer is known), grader details, final answer or patch, stage times and per-call spans."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nemo_gym_prorl.viewer.records import Summary, conversation, final_answer, is_gym_row, patch, timing

if TYPE_CHECKING:
    from nemo_gym_prorl.models.tokenizer import Tokenizer

# What a page shows in its own sections; the rest of a row's top-level keys is listed as it is.
_SHOWN = {"messages", "tools", "evaluation", "timing", "response", "responses_create_params", "instance_id",
          "trajectory_id", "reward", "resolved", "finish", "critical_error", "error", "num_tool_calls",
          "num_format_errors", "num_turns", "queued_time_s", "init_time_s", "run_time_s", "eval_time_s",
          "submission", "reverify"}


class TokenTexts:
    """The text of token ids, through a tokenizer given or read (once, on first use) from a GGUF; without either,
    the page shows ids."""

    def __init__(self, tokenizer: Tokenizer | None = None, gguf: Path | None = None) -> None:
        self._tokenizer = tokenizer
        self._gguf = gguf
        self._lock = threading.Lock()
        self.error: str | None = None

    @property
    def known(self) -> bool:
        return self._tokenizer is not None or self._gguf is not None

    def pieces(self, token_ids: list[int]) -> list[str] | None:
        with self._lock:
            if self._tokenizer is None and self._gguf is not None and self.error is None:
                from nemo_gym_prorl.models.tokenizer import Tokenizer  # llama.cpp: loaded only when a page needs it

                try:
                    self._tokenizer = Tokenizer.from_gguf(self._gguf)
                except (OSError, ValueError) as e:
                    self.error = f"{self._gguf}: {e}"
            tokenizer = self._tokenizer
        if tokenizer is None:
            return None
        return [tokenizer.piece(token_id) if 0 <= token_id < tokenizer.vocab_size else "" for token_id in token_ids]


def _with_token_counts(entries: list[dict[str, Any]], texts: TokenTexts) -> list[dict[str, Any]]:
    """Each assistant turn with token fields gets its counts: the prompt, what was new in it since the last turn
    (tool outputs, the environment's messages), the generated tokens and their log-probs' sum."""
    seen = 0
    for entry in entries:
        if "token_ids" not in entry:
            continue
        generated, log_probs = entry["token_ids"], entry["log_probs"]
        entry["counts"] = {
            "prompt": entry["prompt_tokens"],
            "new_prompt": max(entry["prompt_tokens"] - seen, 0),
            "generated": len(generated),
            "log_prob_sum": sum(log_probs),
            "log_prob_mean": sum(log_probs) / len(log_probs) if log_probs else None,
        }
        entry["token_texts"] = texts.pieces(generated)
        seen = entry["prompt_tokens"] + len(generated)
    return entries


def detail(summary: Summary, row: dict[str, Any], texts: TokenTexts) -> dict[str, Any]:
    spans = (row.get("timing") or {}).get("spans") if not is_gym_row(row) else row.get("spans")
    return {
        "summary": summary.model_dump(),
        "conversation": _with_token_counts(conversation(row), texts),
        "tools": row.get("tools") or (row.get("responses_create_params") or {}).get("tools") or [],
        "evaluation": row.get("evaluation") or {},
        "timing": timing(row),
        "spans": spans if isinstance(spans, list) else [],
        "final_answer": final_answer(row),
        "patch": patch(row),
        "error": row.get("error") or row.get("failure_reason"),
        "submission": row.get("submission") if isinstance(row.get("submission"), dict) else None,
        "reverify": row.get("reverify") if isinstance(row.get("reverify"), dict) else None,
        "tokenizer": texts.known and texts.error is None,
        "tokenizer_error": texts.error,
        "extra": {key: value for key, value in row.items() if key not in _SHOWN},
    }
