"""The multi-turn agent loop in token-in/token-out mode.

Each turn: generate from the current prompt ids → parse tool calls → run them in the sandbox → extend the prompt
with the generated ids and the tokens of what follows (tool results, next generation prompt). Earlier turns are
never re-tokenized, so every turn's prompt is an exact prefix-extension of the one before (NeMo RL's contiguity
rule), and each assistant message records the ids and log-probs the model really produced.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from nemo_gym_prorl.envs.base import Environment, Episode
from nemo_gym_prorl.models.engine import SamplingParams
from nemo_gym_prorl.models.tokenizer import Tokenizer
from nemo_gym_prorl.service.llm_client import CompletionsClient, ContextLengthExceeded
from nemo_gym_prorl.service.trajectory import Finish
from nemo_gym_prorl.tool_calls import ToolCallFormat


@dataclass
class AgentOutcome:
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]]
    finish: Finish
    num_tool_calls: int = 0
    num_format_errors: int = 0


class AgentLoop:
    def __init__(
        self,
        llm: CompletionsClient,
        tokenizer: Tokenizer,
        tool_format: ToolCallFormat,
        sampling: SamplingParams,
        max_turns: int,
    ) -> None:
        self.llm = llm
        self.tokenizer = tokenizer
        self.tool_format = tool_format
        self.sampling = sampling
        self.max_turns = max_turns

    async def run(self, env: Environment, episode: Episode) -> AgentOutcome:
        template = self.tokenizer.chat_template
        messages = env.prompt_messages(episode.instance)
        # CodeAct agents act through code blocks the prompt describes, not through function schemas.
        tools = [] if self.tool_format.name == "codeact" else env.tool_schemas()
        outcome = AgentOutcome(messages=messages, tools=tools, finish="max_turns")
        prompt_ids = self.tokenizer.encode(template.render(messages, tools or None, add_generation_prompt=True))
        for turn in range(self.max_turns):
            try:
                completion = await self.llm.complete(prompt_ids, self.sampling)
            except ContextLengthExceeded:
                outcome.finish = "context_length"
                return outcome
            parsed = self.tool_format.parse(completion.text)
            error = parsed.error
            if completion.finish_reason == "length":
                error = f"reply cut at max_tokens={self.sampling.max_tokens}" + (f"; {error}" if error else "")
            assistant: dict[str, Any] = {
                "role": "assistant",
                "content": completion.text,
                "prompt_token_ids": prompt_ids,
                "generation_token_ids": completion.token_ids,
                "generation_log_probs": completion.log_probs,
                "finish_reason": completion.finish_reason,
            }
            if parsed.tool_calls:
                assistant["tool_calls"] = [call.to_openai() for call in parsed.tool_calls]
            if error:
                assistant["format_error"] = error
                outcome.num_format_errors += 1
            messages.append(assistant)

            if parsed.final_answer is not None and completion.finish_reason != "length":
                episode.answer = parsed.final_answer
                outcome.finish = "answer"
                return outcome
            replies: list[dict[str, Any]] = []
            for call in parsed.tool_calls:
                result = await env.call_tool(episode, call)
                outcome.num_tool_calls += 1
                replies.append(self.tool_format.tool_result_message(call, result.text))
                if result.finished:
                    messages.extend(replies)
                    outcome.finish = "finish"
                    return outcome
            if not parsed.tool_calls:
                replies.append(self.tool_format.format_error_message(error or "no tool call"))
            if turn == self.max_turns - 1:
                messages.extend(replies)
                break
            generated = completion.token_ids
            ended = bool(generated) and self.tokenizer.is_end_of_generation(generated[-1])
            following = template.continuation_text(messages, replies, tools or None, ended)
            messages.extend(replies)
            prompt_ids = prompt_ids + generated + self.tokenizer.encode(following)
        return outcome
