"""A scripted model in place of the `/completions` server, and the pipeline pieces the agent-loop, pipeline and
fork tests build around it."""

from __future__ import annotations

import asyncio

from nemo_gym_prorl.agent.loop import AgentLoop
from nemo_gym_prorl.agent.turns import ContextLengthExceeded, TokenInTokenOut
from nemo_gym_prorl.contracts.sampling import SamplingParams
from nemo_gym_prorl.contracts.task import TaskInstance
from nemo_gym_prorl.models.tokenizer import Tokenizer
from nemo_gym_prorl.service.pipeline import PipelineConfig, Rollout, StageConfig
from nemo_gym_prorl.tool_calls import tool_call_format

INSTANCE = TaskInstance(instance_id="t1", data={"id": "t1", "question": "Calculate 6 * 7.", "answer": "42"})


class ScriptedModel:
    """A stand-in `/completions` server: answers each turn with the next scripted reply, as the ids the tokenizer
    gives it (+ <|im_end|>), and keeps the token prompts it was sent."""

    def __init__(self, tokenizer: Tokenizer, replies: list[str | None], max_tokens: int = 1000) -> None:
        self.tokenizer = tokenizer
        self.replies = list(replies)
        self.max_tokens = max_tokens
        self.prompts: list[list[int]] = []

    async def __call__(self, path: str, body: dict) -> dict:
        assert path == "/completions" and body["return_token_ids"]
        self.prompts.append(body["prompt"])
        reply = self.replies.pop(0)
        if reply is None:
            raise ContextLengthExceeded(400, "This model's maximum context length is 2048 tokens.")
        ids = self.tokenizer.encode(reply)
        cut = len(ids) > self.max_tokens
        ids = ids[: self.max_tokens] if cut else ids + [self.tokenizer.eos_token_id]
        choice = {
            "text": self.tokenizer.decode(ids),
            "token_ids": ids,
            "logprobs": {"token_logprobs": [-0.5] * len(ids)},
            "finish_reason": "length" if cut else "stop",
        }
        return {"choices": [choice]}


class BlockingModel(ScriptedModel):
    """Holds every generation until released; tells the test when one started."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        super().__init__(tokenizer, ["\\boxed{42}"] * 100)
        self.started = asyncio.Event()
        self.release = asyncio.Event()

    async def __call__(self, path: str, body: dict) -> dict:
        self.started.set()
        await self.release.wait()
        return await super().__call__(path, body)


def rollout(env, model, **kw) -> Rollout:
    loop = AgentLoop(TokenInTokenOut(model, "m", model.tokenizer, SamplingParams()), tool_call_format("codeact"), 2)
    return Rollout(env=env, agent=loop, instance=INSTANCE, **kw)


def config(**kw) -> PipelineConfig:
    return PipelineConfig(**{"init": StageConfig(workers=2), "run": StageConfig(workers=2), "eval": StageConfig(workers=2), **kw})
