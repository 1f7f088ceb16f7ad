"""Segments from recorded calls alone (token ids written out): the cases a real harness makes rarely on demand, and
the trajectory that carries them."""

from __future__ import annotations

import json

from nemo_gym_prorl.agent.turns import Turn
from nemo_gym_prorl.contracts.sampling import SamplingParams
from nemo_gym_prorl.contracts.trajectory import Trajectory, contiguity_violation
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


def sub_agent_rollout() -> Trajectory:
    """The main agent (calls 0, 2), a sub-agent's fresh conversation between them (call 1): the main agent's reply
    ends the rollout, in the segment that began first."""
    calls = [call(0, [1, 2], [3]), call(1, [9, 8], [7]), call(2, [1, 2, 3, 4], [5, 6])]
    return Trajectory(instance_id="i", trajectory_id="j:0", segments=segments(calls), reward=1.0)


def test_a_harness_trajectory_keeps_its_segments_through_json_and_ends_in_its_last_calls_segment() -> None:
    trajectory = Trajectory.model_validate_json(sub_agent_rollout().model_dump_json())
    assert [[turn["call"] for turn in segment] for segment in trajectory.training_segments()] == [[0, 2], [1]]
    assert [turn["call"] for turn in trajectory.final_segment()] == [0, 2]
    assert trajectory.final_segment()[1]["generation_token_ids"] == [5, 6]
    assert trajectory.mask_reason() is None


def test_a_trajectory_stored_before_segments_reads_as_its_own_loops_one_segment() -> None:
    turn = {"role": "assistant", "content": "4", "prompt_token_ids": [1, 2], "generation_token_ids": [3],
            "generation_log_probs": [-0.1]}  # fmt: skip
    messages = [{"role": "user", "content": "q"}, turn]
    stored = json.dumps({"instance_id": "i", "trajectory_id": "t", "messages": messages})
    trajectory = Trajectory.model_validate_json(stored)
    assert trajectory.segments == []
    assert trajectory.training_segments() == [[turn]] and trajectory.final_segment() == [turn]


def test_a_segment_whose_prompt_does_not_extend_its_turns_masks_the_rollout() -> None:
    trajectory = sub_agent_rollout()
    trajectory.segments[0][1]["prompt_token_ids"] = [1, 2, 99, 4]  # the token generated at call 0 is not there
    expected = "segment 0 breaks contiguity: turn 1: prompt does not extend the 3 tokens of earlier turns"
    assert trajectory.mask_reason() == expected
