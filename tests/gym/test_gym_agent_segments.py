"""A harness rollout of several segments as the agent's `/run` verify response: NeMo RL takes one contiguous token
sequence per result, so `response.output` carries the final segment (checked with NeMo Gym's own contiguity check of
a rebuilt response) and the other segments come as output items beside it, in `other_segments`."""

from __future__ import annotations

from typing import Any

from nemo_gym.token_id_capture.builder import assert_prefix_contiguity

from nemo_gym_prorl.contracts.trajectory import TOKEN_FIELDS, Trajectory
from nemo_gym_prorl.gym.agent_routes import GymRunRequest, gym_verify_response

ROW = GymRunRequest.model_validate({"responses_create_params": {"input": "Fix the bug."}, "_ng_task_index": 3})


def turn(call: int, prompt: list[int], generated: list[int], **message: Any) -> dict[str, Any]:
    tokens = {"prompt_token_ids": prompt, "generation_token_ids": generated,
              "generation_log_probs": [-0.25] * len(generated)}  # fmt: skip
    return {"role": "assistant", "content": f"reply {call}", **message, **tokens, "call": call}


def compacted() -> Trajectory:
    """Calls 0 and 1 extend each other (call 0 asks for a tool); call 2 runs on a compacted history and ends it."""
    tool_call = {"id": "call_0", "type": "function", "function": {"name": "bash", "arguments": '{"command": "ls"}'}}
    before = [turn(0, [1, 2], [3, 4], tool_calls=[tool_call]), turn(1, [1, 2, 3, 4, 5], [6])]
    after = [turn(2, [1, 7], [8, 9, 10])]
    return Trajectory(instance_id="i", trajectory_id="j:0", segments=[before, after], reward=1.0, resolved=True)


def token_fields(items: list[dict[str, Any]]) -> list[tuple[list[Any], ...]]:
    return [tuple(item[f] for f in TOKEN_FIELDS) for item in items if "generation_token_ids" in item]


def test_the_final_segment_is_the_trained_output_and_the_others_come_beside_it() -> None:
    body = gym_verify_response(ROW, compacted(), "policy")
    output = body["response"]["output"]
    assert token_fields(output) == [([1, 7], [8, 9, 10], [-0.25] * 3)]
    assert_prefix_contiguity(body["response"])
    (other,) = body["other_segments"]
    assert [item["type"] for item in other] == ["message", "function_call", "message"]
    assert token_fields(other) == [([1, 2], [3, 4], [-0.25] * 2), ([1, 2, 3, 4, 5], [6], [-0.25])]
    assert_prefix_contiguity({"output": other})
    assert (body["reward"], body["mask_sample"], body["instance_config"]["mask_sample"]) == (1.0, False, False)
    assert (body["num_segments"], body["num_turns"], body["delivered_fraction"]) == (2, 3, 0.5)
    assert body["_ng_task_index"] == 3  # the row's keys come back, as for any result


def test_our_own_loops_result_is_one_segment_delivered_whole() -> None:
    messages = [{"role": "user", "content": "q"}, turn(0, [1, 2], [3]), {"role": "user", "content": "more"},
                turn(1, [1, 2, 3, 4], [5])]  # fmt: skip
    body = gym_verify_response(ROW, Trajectory(instance_id="i", trajectory_id="t", messages=messages), "policy")
    assert token_fields(body["response"]["output"]) == [([1, 2], [3], [-0.25]), ([1, 2, 3, 4], [5], [-0.25])]
    assert (body["other_segments"], body["num_segments"], body["delivered_fraction"]) == ([], 1, 1.0)


def test_a_segment_that_breaks_contiguity_masks_the_result() -> None:
    trajectory = compacted()
    trajectory.segments[0][1]["prompt_token_ids"] = [1, 2, 3]  # drops a token call 0 generated
    body = gym_verify_response(ROW, trajectory, "policy")
    assert body["mask_sample"] is True and body["instance_config"]["mask_sample"] is True
