"""A harness's model calls as training segments: each a run of turns NeMo RL's contiguity rule accepts.

A harness re-sends, rewrites and compacts its own history, so its calls are not one token sequence. A call whose
prompt ids start with every token of a segment so far (that segment's last prompt + generated ids) is that
segment's next turn; a call that extends no segment (compacted or rewritten history, a sub-agent's fresh
conversation) starts a new one. The newest segment is tried first, then older ones, so a main agent that resumes
after a sub-agent's calls continues its own segment. Each segment is a list of assistant messages with the token
fields (`ModelCall.assistant_turn`), in call order; `contiguity_violation` holds for every one of them.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from nemo_gym_prorl.harness.calls import ModelCall

Segment = list[dict[str, Any]]


def segments(calls: Iterable[ModelCall]) -> list[Segment]:
    """The segments of `calls` (in the order they were answered), in the order each began."""
    found: list[Segment] = []
    for call in calls:
        turn = call.assistant_turn()
        segment = next((s for s in reversed(found) if _extends(turn, s[-1])), None)
        if segment is None:
            found.append([turn])
        else:
            segment.append(turn)
    return found


def _extends(turn: dict[str, Any], last: dict[str, Any]) -> bool:
    """Whether `turn`'s prompt holds every token up to and including `last`'s generation (and so, by induction,
    every token of `last`'s segment)."""
    seen = last["prompt_token_ids"] + last["generation_token_ids"]
    return turn["prompt_token_ids"][: len(seen)] == seen
