"""The agent loop over a real sandbox and the real tokenizer, with a scripted model in place of the server."""

from __future__ import annotations

from pathlib import Path

import pytest
from scripted_model import INSTANCE, ScriptedModel

from nemo_gym_prorl.agent.loop import AgentLoop
from nemo_gym_prorl.agent.turns import ContextLengthExceeded, TokenInTokenOut
from nemo_gym_prorl.contracts.sampling import SamplingParams
from nemo_gym_prorl.contracts.task import TaskInstance, load_task
from nemo_gym_prorl.contracts.trajectory import Trajectory, contiguity_violation
from nemo_gym_prorl.envs import make_environment
from nemo_gym_prorl.envs.base import Episode
from nemo_gym_prorl.models.tokenizer import Tokenizer
from nemo_gym_prorl.service.pipeline import PipelineConfig, Rollout, run_rollouts
from nemo_gym_prorl.tool_calls import tool_call_format


@pytest.fixture
def math_task(tmp_path: Path):
    task = load_task("math/arithmetic")
    return task.model_copy(update={"max_turns": 3})


def agent(tokenizer: Tokenizer, model: ScriptedModel, fmt: str = "codeact", max_turns: int = 3) -> AgentLoop:
    generator = TokenInTokenOut(model, "scripted", tokenizer, SamplingParams(max_tokens=64))
    return AgentLoop(generator, tool_call_format(fmt), max_turns)


async def run_rollout(env, loop: AgentLoop, instance: TaskInstance):
    (trajectory,) = await run_rollouts([Rollout(env=env, agent=loop, instance=instance)], PipelineConfig())
    return trajectory


async def test_code_block_runs_in_the_sandbox_and_its_output_comes_back(math_task, tokenizer: Tokenizer) -> None:
    model = ScriptedModel(tokenizer, ["```python\nprint(open('problem.txt').read(), 6 * 7)\n```", "\\boxed{42}"])
    env = make_environment(math_task, "bwrap")
    trajectory = await run_rollout(env, agent(tokenizer, model), INSTANCE)
    assert trajectory.critical_error is None and trajectory.finish == "answer"
    assert trajectory.reward == 1.0 and trajectory.resolved and trajectory.num_tool_calls == 1
    observation = trajectory.messages[-2]["content"]  # question, code, its observation, answer
    assert "Calculate 6 * 7. 42" in observation  # the staged problem file, read inside the sandbox
    turns = trajectory.assistant_turns()
    assert len(turns) == 2 and contiguity_violation(turns) is None
    # the second prompt is exactly: first prompt + what the model generated + the tokens that follow it
    assert model.prompts[1][: len(model.prompts[0]) + len(turns[0]["generation_token_ids"])] == (
        model.prompts[0] + turns[0]["generation_token_ids"]
    )


async def test_the_prompt_rendered_when_accepted_is_the_one_staged_and_sent(math_task, tokenizer: Tokenizer) -> None:
    carried = [{"role": "user", "content": "Calculate 6 * 7 (as accepted)."}]  # not what the template renders
    instance = INSTANCE.model_copy(update={"prompt": carried})
    model = ScriptedModel(tokenizer, ["```python\nprint(open('problem.txt').read())\n```", "\\boxed{42}"])
    trajectory = await run_rollout(make_environment(math_task, "bwrap"), agent(tokenizer, model), instance)
    assert trajectory.messages[0] == carried[0] and instance.prompt == carried  # each sample has its own copy
    assert "Calculate 6 * 7 (as accepted)." in trajectory.messages[-2]["content"]  # the problem file init staged
    assert tokenizer.decode(model.prompts[0]).count("(as accepted)") == 1


async def test_hermes_tool_calls_and_finish(math_task, tokenizer: Tokenizer) -> None:
    model = ScriptedModel(
        tokenizer,
        [
            '<tool_call>\n{"name": "bash", "arguments": {"command": "cd /tmp && pwd"}}\n</tool_call>',
            '<tool_call>\n{"name": "bash", "arguments": {"command": "pwd; exit 3"}}\n</tool_call>',
            '<tool_call>\n{"name": "finish", "arguments": {"answer": "41"}}\n</tool_call>',
        ],
    )
    trajectory = await run_rollout(make_environment(math_task, "bwrap"), agent(tokenizer, model, "hermes"), INSTANCE)
    assert trajectory.finish == "finish" and trajectory.reward == 0.0
    assert trajectory.evaluation["reason"] == "wrong answer"
    tool_outputs = [m["content"] for m in trajectory.messages if m["role"] == "tool"]
    assert tool_outputs[0].strip() == "/tmp"
    assert tool_outputs[1].startswith("/tmp") and "[exit code 3]" in tool_outputs[1]  # cwd persisted
    assert [t["function"]["name"] for t in trajectory.tools] == ["bash", "python", "finish"]
    assert contiguity_violation(trajectory.assistant_turns()) is None


async def test_format_errors_are_recorded_per_turn_and_the_rollout_goes_on(math_task, tokenizer: Tokenizer) -> None:
    model = ScriptedModel(
        tokenizer,
        ["<tool_call>{broken json</tool_call>", "I will not call a tool.", "x " * 200],
        max_tokens=50,
    )
    trajectory = await run_rollout(make_environment(math_task, "bwrap"), agent(tokenizer, model, "hermes"), INSTANCE)
    turns = trajectory.assistant_turns()
    assert [t.get("format_error", "")[:20] for t in turns] == [
        "malformed tool call ",
        "no tool call: call a",
        "reply cut at the max",
    ]
    assert trajectory.finish == "max_turns" and trajectory.num_format_errors == 3
    assert trajectory.critical_error is None and trajectory.evaluation["reason"] == "no answer submitted"
    assert contiguity_violation(turns) is None


async def test_in_a_gym_environment_a_plain_reply_ends_the_episode_and_a_malformed_call_is_still_a_format_error(
    math_task, tokenizer: Tokenizer
) -> None:
    # No reply here calls a tool, so the resources server (port 9, discard) is never contacted; the loop runs on a
    # hand-made episode, as a seeded Gym session would give it.
    task = math_task.model_copy(update={"type": "gym", "resources_server_url": "http://127.0.0.1:9", "verifier": {}})
    env = make_environment(task, "bwrap")
    row = {"responses_create_params": {"input": [{"role": "user", "content": "What is 1 + 2?"}], "tools": []}}
    episode = Episode(instance=TaskInstance(instance_id="g1", data=row), sandbox=None)
    replies = ["<tool_call>{broken json</tool_call>", "x " * 200, "It is \\boxed{3}."]
    model = ScriptedModel(tokenizer, replies, max_tokens=50)
    trajectory = Trajectory(instance_id="g1", trajectory_id="g1:0")
    loop = agent(tokenizer, model, "hermes", max_turns=3)
    try:
        loop.start(env, episode, trajectory)
        await loop.run(env, episode, trajectory)
    finally:
        await env.aclose()
    turns = trajectory.assistant_turns()
    assert [t.get("format_error", "")[:20] for t in turns] == ["malformed tool call ", "reply cut at the max", ""]
    assert (trajectory.finish, trajectory.num_format_errors) == ("answer", 2)
    assert episode.messages is trajectory.messages and trajectory.messages[-1] is turns[-1]  # what the env reads
    assert episode.answer == replies[-1]


async def test_context_overflow_ends_the_rollout_cleanly(math_task, tokenizer: Tokenizer) -> None:
    model = ScriptedModel(tokenizer, ["```bash\necho hi\n```", None])
    trajectory = await run_rollout(make_environment(math_task, "bwrap"), agent(tokenizer, model), INSTANCE)
    assert trajectory.finish == "context_length" and trajectory.critical_error is None
    assert len(trajectory.assistant_turns()) == 1


async def test_a_failing_init_is_classified_and_nothing_runs(math_task, tokenizer: Tokenizer) -> None:
    bad = math_task.model_copy(update={"prompt_template": "{missing_column}"})
    model = ScriptedModel(tokenizer, [])
    trajectory = await run_rollout(make_environment(bad, "bwrap"), agent(tokenizer, model), INSTANCE)
    assert trajectory.critical_error == "init" and "missing_column" in (trajectory.error or "")
    assert model.prompts == []


class ScriptedChatServer:
    """A stand-in `/chat/completions` server returning NeMo RL token fields; `drift` makes turn 2's prompt not
    extend turn 1 (as a server that re-tokenized the history would)."""

    def __init__(self, tokenizer: Tokenizer, replies: list[str], drift: bool = False) -> None:
        self.tokenizer = tokenizer
        self.replies = list(replies)
        self.drift = drift
        self.bodies: list[dict] = []

    async def __call__(self, path: str, body: dict) -> dict:
        assert path == "/chat/completions" and body["logprobs"] and body["return_tokens_as_token_ids"]
        self.bodies.append(body)
        earlier = [m for m in body["messages"] if "prompt_token_ids" in m]  # as NeMo RL's server: a worked example has none
        prefix = (earlier[-1]["prompt_token_ids"] + earlier[-1]["generation_token_ids"]) if earlier else []
        if self.drift and prefix:
            prefix = prefix[:-1]
        prompt = prefix + self.tokenizer.encode(body["messages"][-1]["content"])
        ids = self.tokenizer.encode(self.replies.pop(0)) + [self.tokenizer.eos_token_id]
        message = {
            "role": "assistant",
            "content": self.tokenizer.decode(ids),
            "prompt_token_ids": prompt,
            "generation_token_ids": ids,
            "generation_log_probs": [-1.0] * len(ids),
        }
        return {"choices": [{"message": message, "finish_reason": "stop"}]}


@pytest.mark.parametrize("drift", [False, True])
async def test_chat_mode_echoes_token_fields_and_masks_a_non_contiguous_turn(math_task, tokenizer: Tokenizer, drift: bool) -> None:
    from nemo_gym_prorl.agent.turns import ChatCompletions

    server = ScriptedChatServer(tokenizer, ["```bash\necho 6\n```", "\\boxed{42}"], drift=drift)
    loop = AgentLoop(ChatCompletions(server, "scripted", SamplingParams()), tool_call_format("codeact"), 3)
    trajectory = await run_rollout(make_environment(math_task, "bwrap"), loop, INSTANCE)
    assert trajectory.reward == 1.0
    second_request_assistant = [m for m in server.bodies[1]["messages"] if m["role"] == "assistant"][-1]
    assert "generation_token_ids" in second_request_assistant and "finish_reason" not in second_request_assistant
    turns = trajectory.assistant_turns()
    assert ("contiguity_error" in turns[1]) == drift and turns[1].get("mask", False) == drift
    assert (contiguity_violation(turns) is None) != drift


@pytest.mark.parametrize("mode", ["tokens", "chat"])
async def test_both_generation_modes_stay_contiguous_against_the_real_model_server(
    math_task, tokenizer: Tokenizer, model_server, mode: str
) -> None:
    from nemo_gym_prorl.agent.turns import http_poster, turn_generator
    from nemo_gym_prorl.json_http import JsonHttp

    http = JsonHttp(timeout_s=120)
    try:
        generator = turn_generator(mode, http_poster(http, model_server.base_url), "local", SamplingParams(max_tokens=40, seed=1), tokenizer)
        loop = AgentLoop(generator, tool_call_format("hermes"), 3)
        trajectory = await run_rollout(make_environment(math_task, "bwrap"), loop, INSTANCE)
    finally:
        await http.aclose()
    turns = trajectory.assistant_turns()
    assert trajectory.critical_error is None and len(turns) == 3
    assert contiguity_violation(turns) is None and not any("contiguity_error" in t for t in turns)


async def test_a_turn_without_max_tokens_may_fill_the_context_as_in_chat_mode(tokenizer: Tokenizer, model_server) -> None:
    """/v1/completions caps a request without max_tokens at 16 tokens (OpenAI's default; vLLM's and our server's)."""
    from nemo_gym_prorl.agent.turns import http_poster
    from nemo_gym_prorl.json_http import JsonHttp

    messages = [{"role": "user", "content": "Write three long sentences about the sea."}]
    http = JsonHttp(timeout_s=120)
    try:
        post = http_poster(http, model_server.base_url)
        turn = await TokenInTokenOut(post, "local", tokenizer, SamplingParams(seed=1), context_window=2048).generate(
            messages, None, None
        )
        full = TokenInTokenOut(post, "local", tokenizer, SamplingParams(seed=1), context_window=len(turn.prompt_token_ids))
        with pytest.raises(ContextLengthExceeded, match="fills the"):
            await full.generate(messages, None, None)
    finally:
        await http.aclose()
    assert len(turn.generation_token_ids) > 16 and turn.finish_reason == "stop"
