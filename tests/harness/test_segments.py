"""Segments from recorded calls alone (token ids written out): the cases a real harness makes rarely on demand."""

from __future__ import annotations

from nemo_gym_prorl.agent.turns import Turn
from nemo_gym_prorl.contracts.sampling import SamplingParams
from nemo_gym_prorl.contracts.trajectory import contiguity_violation
from nemo_gym_prorl.harness.calls import ModelCall
from nemo_gym_prorl.harness.segments import segments


def call(index: int, prompt: list[int], generated: list[int]) -> ModelCall:
    turn = Turn(
        prompt_token_ids=prompt, generation_token_ids=generated, generation_log_probs=[-0.5] * len(generated),
        text=f"reply {index}", finish_reason="stop",
    )  # fmt: skip
    reply = {"role": "assistant", "content": turn.text}
    return ModelCall(index=index, api="chat.completions", messages=[], tools=None, turn=turn, reply=reply,
                     sampling=SamplingParams())  # fmt: skip


def test_a_main_agent_resuming_after_a_sub_agent_continues_its_own_segment() -> None:
    calls = [
        call(0, [1, 2], [3]),  # the main agent
        call(1, [9, 8], [7]),  # a sub-agent's fresh conversation
        call(2, [1, 2, 3, 4], [5]),  # the main agent again, with the sub-agent's result
        call(3, [9, 8, 7, 6], [5]),  # the sub-agent's second turn
        call(4, [1, 2, 3], [4]),  # a retry that drops the tool result: rewritten history
    ]
    found = segments(calls)
    assert [[turn["call"] for turn in segment] for segment in found] == [[0, 2], [1, 3], [4]]
    assert all(contiguity_violation(segment) is None for segment in found)
    assert found[0][1]["generation_log_probs"] == [-0.5] and found[0][1]["content"] == "reply 2"


def test_a_prompt_that_repeats_the_last_prompt_without_its_reply_starts_a_segment() -> None:
    found = segments([call(0, [1, 2], [3]), call(1, [1, 2], [4])])  # the harness asked the same thing twice
    assert [len(segment) for segment in found] == [1, 1]
