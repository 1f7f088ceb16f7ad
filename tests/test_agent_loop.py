"""The agent loop over a real sandbox and the real tokenizer, with a scripted model in place of the server."""

from __future__ import annotations

from pathlib import Path

import pytest

from nemo_gym_prorl.envs import make_environment
from nemo_gym_prorl.envs.dataset import TaskInstance
from nemo_gym_prorl.envs.task import load_task
from nemo_gym_prorl.models.engine import SamplingParams
from nemo_gym_prorl.models.tokenizer import Tokenizer
from nemo_gym_prorl.service.agent_loop import AgentLoop
from nemo_gym_prorl.service.llm_client import Completion, ContextLengthExceeded
from nemo_gym_prorl.service.rollout import run_rollout
from nemo_gym_prorl.service.trajectory import contiguity_violation
from nemo_gym_prorl.tool_calls import tool_call_format


class ScriptedModel:
    """Answers each turn with the next scripted reply, as the ids the tokenizer gives it (+ <|im_end|>)."""

    def __init__(self, tokenizer: Tokenizer, replies: list[str | None], max_tokens: int = 1000) -> None:
        self.tokenizer = tokenizer
        self.replies = list(replies)
        self.max_tokens = max_tokens
        self.prompts: list[list[int]] = []

    async def complete(self, prompt_ids: list[int], sampling: SamplingParams) -> Completion:
        self.prompts.append(prompt_ids)
        reply = self.replies.pop(0)
        if reply is None:
            raise ContextLengthExceeded("maximum context length")
        ids = self.tokenizer.encode(reply)
        cut = len(ids) > self.max_tokens
        ids = ids[: self.max_tokens] if cut else ids + [self.tokenizer.eos_token_id]
        return Completion(
            token_ids=ids,
            log_probs=[-0.5] * len(ids),
            text=self.tokenizer.decode(ids),
            finish_reason="length" if cut else "stop",
        )


@pytest.fixture
def math_task(tmp_path: Path):
    task = load_task("math/arithmetic")
    return task.model_copy(update={"max_turns": 3})


def agent(tokenizer: Tokenizer, model: ScriptedModel, fmt: str = "codeact", max_turns: int = 3) -> AgentLoop:
    return AgentLoop(model, tokenizer, tool_call_format(fmt), SamplingParams(max_tokens=64), max_turns)  # type: ignore[arg-type]


INSTANCE = TaskInstance(instance_id="t1", data={"id": "t1", "question": "Calculate 6 * 7.", "answer": "42"})


async def test_code_block_runs_in_the_sandbox_and_its_output_comes_back(math_task, tokenizer: Tokenizer) -> None:
    model = ScriptedModel(tokenizer, ["```python\nprint(open('problem.txt').read(), 6 * 7)\n```", "\\boxed{42}"])
    env = make_environment(math_task, "bwrap")
    trajectory = await run_rollout(env, agent(tokenizer, model), INSTANCE)
    assert trajectory.critical_error is None and trajectory.finish == "answer"
    assert trajectory.reward == 1.0 and trajectory.resolved and trajectory.num_tool_calls == 1
    observation = trajectory.messages[3]["content"]
    assert "Calculate 6 * 7. 42" in observation  # the staged problem file, read inside the sandbox
    turns = trajectory.assistant_turns()
    assert len(turns) == 2 and contiguity_violation(turns) is None
    # the second prompt is exactly: first prompt + what the model generated + the tokens that follow it
    assert model.prompts[1][: len(model.prompts[0]) + len(turns[0]["generation_token_ids"])] == (
        model.prompts[0] + turns[0]["generation_token_ids"]
    )


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
        "reply cut at max_tok",
    ]
    assert trajectory.finish == "max_turns" and trajectory.num_format_errors == 3
    assert trajectory.critical_error is None and trajectory.evaluation["reason"] == "no answer submitted"
    assert contiguity_violation(turns) is None


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
