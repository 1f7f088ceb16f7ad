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

        It is the template's own text after that turn's content when the whole conversation is rendered, the
        turn's content replaced by a sentinel: how the template would re-render the generated text (its tool
        calls, a think block) never matters, and neither does what the template renders only while the turn is
        the last message (Qwen3's empty think block). `generation_end` is the text of the end-of-generation token
        the turn's tokens end with ("" when cut): the template's turn end is not repeated when it starts with that
        token, and is kept when the model ended on another one (``<|endoftext|>`` where the template closes turns
        with ``<|im_end|>``).

        The earlier turns' exact tokens stay the prefix, so the template must render them the same once later
        turns exist; `TemplateNotIncrementalError` says where one does not (tools placed before the last user
        message, say). What a template does to an assistant turn's own content (Qwen3 drops the reasoning of
        turns before the last user message, Llama 3 trims it) is not checked: the model's own tokens are kept,
        as NeMo RL's server keeps them when it splices earlier turns.
        """
        if not history or history[-1].get("role") != "assistant":
            raise ValueError("continuation_text needs a history that ends with the assistant turn")
        earlier = [_content_masked(m, i) for i, m in enumerate(history[:-1])]
        before = self.render(earlier, tools)
        rendered = self.render(
            [*earlier, {"role": "assistant", "content": _SENTINEL}, *new_messages], tools, add_generation_prompt=True
        )
        if rendered.count(_SENTINEL) != 1:
            raise TemplateNotIncrementalError(
                "the chat template does not render an assistant turn's content as given, so the text after a "
                "generation cannot be told; token-in/token-out rollouts need one that does"
            )
        head, tail = rendered.split(_SENTINEL)
        if not head.startswith(before):
            at = next((i for i, (a, b) in enumerate(zip(before, head)) if a != b), min(len(before), len(head)))
            raise TemplateNotIncrementalError(
                f"the chat template renders earlier turns differently once later turns exist (from character {at}: "
                f"{before[at : at + 60]!r} becomes {head[at : at + 60]!r}); token-in/token-out rollouts keep earlier "
                "turns' tokens and need a template whose earlier turns render stably"
            )
        if generation_end and tail.startswith(generation_end):
            tail = tail[len(generation_end) :]
        return tail


def _content_masked(message: dict[str, Any], index: int) -> dict[str, Any]:
    """An earlier assistant turn with a placeholder for its content: the stability check compares the template's
    own text around turns, not what it makes of generated content (which may depend on later turns by design)."""
    if message.get("role") != "assistant":
        return message
    return {**message, "content": f"\x00PRORL-TURN-{index}\x00"}


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
