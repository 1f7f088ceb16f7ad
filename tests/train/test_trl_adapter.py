"""The TRL adapter's mapping of trajectories to GRPO samples (unit level: trajectories built here; the real
service, model and trainer run in tests/test_train.py)."""

from __future__ import annotations

import math

import pytest

from nemo_gym_prorl.contracts.trajectory import Trajectory
from nemo_gym_prorl.train.trl_adapter import (
    REWARD_FIELD,
    TURNS_FIELD,
    PolicyVersionError,
    group_prompts,
    rollout_output,
    trajectory_sample,
    verifier_reward,
)

EOS = 2


def turn(prompt: list[int], generated: list[int], version: int | None = 0) -> dict:
    message = {"role": "assistant", "content": "x", "prompt_token_ids": prompt, "generation_token_ids": generated,
               "generation_log_probs": [-0.5 - i for i in range(len(generated))]}  # fmt: skip
    if version is not None:
        message["policy_version"] = version
    return message


def two_turns(**fields) -> Trajectory:
    """System+user prompt [1 2 3], generation [4 5], a tool result [6 7 8] before the second generation [9 EOS]."""
    messages = [
        {"role": "user", "content": "q"},
        turn([1, 2, 3], [4, 5]),
        {"role": "tool", "content": "output"},
        turn([1, 2, 3, 4, 5, 6, 7, 8], [9, EOS]),
    ]
    return Trajectory(instance_id="i", trajectory_id="t", messages=messages, reward=1.0, **fields)


def test_multi_turn_trajectory_lays_out_tokens_as_the_contiguity_rule_does():
    sample = trajectory_sample(two_turns(), EOS, policy_version=0)
    assert sample.prompt_ids == [1, 2, 3]
    assert sample.completion_ids == [4, 5, 6, 7, 8, 9, EOS]
    assert sample.env_mask == [1, 1, 0, 0, 0, 1, 1]  # 0 exactly on the tool result's tokens
    assert sample.logprobs[:2] == [-0.5, -1.5] and sample.logprobs[5:] == [-0.5, -1.5]
    assert all(math.isnan(lp) for lp in sample.logprobs[2:5])
    assert sample.reward == 1.0 and sample.excluded is None and sample.model_turns == 2


@pytest.mark.parametrize(
    "fields, why",
    [
        ({"critical_error": "run", "error": "sandbox killed"}, "critical_error=run"),
        ({"evaluation": {"mask_sample": True}}, "grader masked"),
    ],
)
def test_failed_or_masked_rollouts_do_not_train(fields, why):
    sample = trajectory_sample(two_turns(**fields), EOS)
    assert why in sample.excluded
    assert sample.reward is None  # TRL: no advantage, left out of the group's mean and std
    assert sample.env_mask == [0]  # and nothing in the loss or its token count


def test_a_turn_that_breaks_contiguity_does_not_train():
    trajectory = two_turns()
    trajectory.messages[3]["prompt_token_ids"] = [1, 2, 3, 4, 99, 6, 7, 8]
    sample = trajectory_sample(trajectory, EOS)
    assert sample.reward is None and "does not extend" in sample.excluded


def test_a_rollout_without_model_turns_is_a_placeholder():
    empty = Trajectory(instance_id="i", trajectory_id="t", messages=[{"role": "user", "content": "q"}])
    sample = trajectory_sample(empty, EOS)
    assert (sample.prompt_ids, sample.completion_ids, sample.env_mask, sample.reward) == ([EOS], [EOS], [0], None)


def test_turns_of_two_policy_versions_are_refused():
    trajectory = two_turns()
    trajectory.messages[3]["policy_version"] = 1
    with pytest.raises(PolicyVersionError, match="span policy versions"):
        trajectory_sample(trajectory, EOS)


def test_turns_of_another_version_than_the_step_are_refused():
    with pytest.raises(PolicyVersionError, match="version 0, the step trains version 3"):
        trajectory_sample(two_turns(), EOS, policy_version=3)


def test_reward_function_reads_the_verifier_reward_and_logs_exclusions():
    samples = [trajectory_sample(two_turns(), EOS), trajectory_sample(two_turns(critical_error="init"), EOS)]
    output = rollout_output(samples)
    logged = {}
    rewards = verifier_reward(["p", "p"], ["c", "c"], log_metric=logged.__setitem__,
                              **{k: v for k, v in output.items() if k.startswith("prorl_")})  # fmt: skip
    assert rewards == [1.0, None]
    assert logged == {"prorl/excluded": 0.5, "prorl/multi_turn": 1.0, "prorl/multi_segment": 0.0,
                      "prorl/delivered_fraction": 1.0}  # fmt: skip
    assert output[TURNS_FIELD] == [2, 0] and output[REWARD_FIELD] == [1.0, None]


def compacted(**fields) -> Trajectory:
    """A harness rollout: two calls that extend each other, then a call on a compacted history [1 2 30] (call 2)."""
    first = [{**turn([1, 2, 3], [4, 5]), "call": 0}, {**turn([1, 2, 3, 4, 5, 6], [7, EOS]), "call": 1}]
    after = [{**turn([1, 2, 30], [31, 32, EOS]), "call": 2}]
    return Trajectory(instance_id="i", trajectory_id="j:0", segments=[first, after], reward=1.0, **fields)


def test_a_rollout_of_several_segments_trains_on_its_final_one_with_the_rollouts_reward():
    sample = trajectory_sample(compacted(), EOS, policy_version=0)
    assert (sample.prompt_ids, sample.completion_ids, sample.env_mask) == ([1, 2, 30], [31, 32, EOS], [1, 1, 1])
    assert sample.logprobs == [-0.5, -1.5, -2.5]
    assert sample.reward == 1.0 and sample.excluded is None
    assert sample.segments == 2 and sample.delivered_fraction == 3 / 7  # 4 generated tokens do not train
    output = rollout_output([sample, trajectory_sample(two_turns(), EOS)])
    logged = {}
    verifier_reward(["p", "p"], ["c", "c"], log_metric=logged.__setitem__,
                    **{k: v for k, v in output.items() if k.startswith("prorl_")})  # fmt: skip
    assert logged["prorl/multi_segment"] == 0.5 and logged["prorl/delivered_fraction"] == (3 / 7 + 1) / 2


def test_a_segment_that_breaks_contiguity_excludes_the_whole_rollout():
    trajectory = compacted()
    trajectory.segments[0][1]["generation_log_probs"] = [-0.5]  # one log-prob for two tokens, in a segment not trained
    sample = trajectory_sample(trajectory, EOS)
    assert sample.reward is None and sample.env_mask == [0]
    assert sample.excluded == "segment 0 breaks contiguity: turn 1: 1 log-probs for 2 generated tokens"


def test_prompts_arrive_as_whole_groups():
    assert group_prompts(["a", "a", "b", "b"], 2) == ["a", "b"]
    with pytest.raises(ValueError, match="not one group"):
        group_prompts(["a", "b", "b", "b"], 2)
    with pytest.raises(ValueError, match="whole groups"):
        group_prompts(["a", "a", "a"], 2)
