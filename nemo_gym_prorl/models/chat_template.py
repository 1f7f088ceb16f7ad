"""Rendering a model's own chat template, and the text that continues a conversation after a generation.

Token-in/token-out rollouts never re-tokenize what the model already produced: the next prompt is the previous
prompt ids + the generated ids + the tokens of `continuation_text` (end of the assistant turn, the tool results,
the next generation prompt). That keeps every turn an exact prefix of the next one (the contiguity rule NeMo RL
enforces), whatever the tokenizer would have merged differently on a full re-render.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from nemo_gym_prorl.tool_calls import hermes_tools_system_prompt

_SENTINEL = "\x00PRORL-GENERATION\x00"


class TemplateNotIncrementalError(ValueError):
    """The chat template renders earlier turns differently once later turns exist."""


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _tojson(value: Any, indent: int | None = None, ensure_ascii: bool = False, **_: Any) -> str:
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii)


class ChatTemplate:
    """A Jinja chat template (as shipped in a GGUF or a Hugging Face tokenizer config).

    Templates that do not mention ``tools`` (SmolLM2's plain ChatML, for one) still get tools: their definitions go
    into the system prompt in Hermes form, assistant tool calls into the text as ``<tool_call>`` blocks, and tool
    results into ``<tool_response>`` user turns — the convention Qwen's and Hermes' templates use natively.
    """

    def __init__(self, source: str, bos_token: str = "", eos_token: str = "") -> None:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        env.filters["tojson"] = _tojson
        self._template = env.from_string(source)
        self.source = source
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.renders_tools = "tools" in source

    def render(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = False,
    ) -> str:
        if not self.renders_tools:
            messages, tools = _inline_tools(messages, tools or []), None
        return self._template.render(
            messages=messages,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token,
            eos_token=self.eos_token,
        )

    def continuation_text(
        self,
        history: list[dict[str, Any]],
        new_messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        generation_end: str,
    ) -> str:
        """Text that follows the generated tokens of ``history[-1]`` (an assistant turn) up to the next
        generation prompt, with ``new_messages`` (tool results, user replies) in between.

        The generated text is replaced by a sentinel, so how the template would re-render it never matters.
        `generation_end` is the text of the end-of-generation token the turn's tokens end with ("" when cut): the
        template's turn end is not repeated when it starts with that token, and is kept when the model ended on
        another one (``<|endoftext|>`` where the template closes turns with ``<|im_end|>``).
        """
        if not history or history[-1].get("role") != "assistant":
            raise ValueError("continuation_text needs a history that ends with the assistant turn")
        history = [*history[:-1], {"role": "assistant", "content": _SENTINEL}]
        before = self.render(history, tools)
        after = self.render(history + list(new_messages), tools, add_generation_prompt=True)
        if not after.startswith(before):
            raise TemplateNotIncrementalError(
                "the chat template renders earlier turns differently once later turns exist; "
                "token-in/token-out rollouts need an incremental template"
            )
        turn_end = before[before.rindex(_SENTINEL) + len(_SENTINEL) :]
        if generation_end and turn_end.startswith(generation_end):
            turn_end = turn_end[len(generation_end) :]
        return turn_end + after[len(before) :]


def _inline_tools(messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages for a template that knows only role + content: tools, tool calls and tool results as text."""
    out: list[dict[str, Any]] = []
    if tools:
        tool_prompt = hermes_tools_system_prompt(tools)
        if messages and messages[0].get("role") == "system":
            out.append({"role": "system", "content": f"{messages[0].get('content') or ''}\n\n{tool_prompt}"})
            messages = messages[1:]
        else:
            out.append({"role": "system", "content": tool_prompt})
    for message in messages:
        role = message.get("role")
        content = message.get("content") or ""
        if role == "assistant" and message.get("tool_calls"):
            blocks = [
                json.dumps(
                    {"name": c["function"]["name"], "arguments": _json_arguments(c["function"].get("arguments"))},
                    ensure_ascii=False,
                )
                for c in message["tool_calls"]
            ]
            content = "\n".join([content, *(f"<tool_call>\n{b}\n</tool_call>" for b in blocks)]).strip()
            out.append({"role": "assistant", "content": content})
        elif role == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{content}\n</tool_response>"})
        else:
            out.append({"role": role, "content": content})
    return out


def _json_arguments(arguments: Any) -> Any:
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except json.JSONDecodeError:
            return arguments
    return arguments or {}
