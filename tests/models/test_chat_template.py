"""Continuation text keeps multi-turn token prompts exact prefix-extensions of each other."""

from __future__ import annotations

import pytest

from nemo_gym_prorl.models.chat_template import ChatTemplate, TemplateNotIncrementalError
from nemo_gym_prorl.models.tokenizer import Tokenizer

CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def test_continuation_after_an_eos_ended_generation_is_newline_then_next_turns() -> None:
    template = ChatTemplate(CHATML, eos_token="<|im_end|>")
    history = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "whatever was generated"}]
    text = template.continuation_text(history, [{"role": "user", "content": "more"}], None, generation_end="<|im_end|>")
    assert text == "\n<|im_start|>user\nmore<|im_end|>\n<|im_start|>assistant\n"
    cut = template.continuation_text(history, [{"role": "user", "content": "more"}], None, generation_end="")
    assert cut == "<|im_end|>" + text
    # ended on another end-of-generation token (Qwen2.5's and SmolLM2's <|endoftext|>): the turn is still closed
    other = template.continuation_text(history, [{"role": "user", "content": "more"}], None, generation_end="<|endoftext|>")
    assert other == cut


def test_tool_results_become_tool_responses_for_templates_without_tool_support() -> None:
    template = ChatTemplate(CHATML, eos_token="<|im_end|>")
    history = [{"role": "user", "content": "ls"}, {"role": "assistant", "content": "x"}]
    text = template.continuation_text(history, [{"role": "tool", "content": "a.txt"}], None, "<|im_end|>")
    assert "<|im_start|>user\n<tool_response>\na.txt\n</tool_response><|im_end|>" in text


def test_a_template_that_rewrites_earlier_turns_is_refused() -> None:
    rewriting = "{% for m in messages %}{{ m['role'] }}{{ messages|length }}{% endfor %}"
    with pytest.raises(TemplateNotIncrementalError):
        ChatTemplate(rewriting).continuation_text(
            [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}], [{"role": "user", "content": "c"}], None, ""
        )


def test_continuation_of_the_real_model_template_tokenizes_to_the_full_render_suffix(tokenizer: Tokenizer) -> None:
    template = tokenizer.chat_template
    history = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]
    new = [{"role": "user", "content": "and 3+3?"}]
    full = tokenizer.encode(template.render(history + new, add_generation_prompt=True))
    before = tokenizer.encode(template.render(history))[:-1]  # generation ends at <|im_end|>; "\n" not generated
    assert before + tokenizer.encode(template.continuation_text(history, new, None, "<|im_end|>")) == full
