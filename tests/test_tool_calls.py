"""Tool-call formats parse what models really write, and report what they cannot use instead of raising."""

from __future__ import annotations

import pytest

from nemo_gym_prorl.tool_calls import CodeActFormat, parse_hermes, parse_openai_tool_calls, tool_call_format


def test_hermes_blocks_become_tool_calls_with_the_text_around_them() -> None:
    reply = 'Let me look.\n<tool_call>\n{"name": "bash", "arguments": {"command": "ls"}}\n</tool_call>\n<tool_call>{"name": "finish", "arguments": "{\\"answer\\": \\"4\\"}"}</tool_call>'
    parsed = parse_hermes(reply)
    assert [(c.name, c.arguments) for c in parsed.tool_calls] == [("bash", {"command": "ls"}), ("finish", {"answer": "4"})]
    assert parsed.content == "Let me look." and parsed.error is None


@pytest.mark.parametrize(
    ("reply", "problem"),
    [
        ("<tool_call>{not json}</tool_call>", "malformed tool call JSON"),
        ('<tool_call>{"arguments": {}}</tool_call>', '"name"'),
        ('<tool_call>{"name": "bash", "arguments": [1]}</tool_call>', "must be an object"),
        ("I think the answer is 4.", "no tool call"),
    ],
)
def test_hermes_format_errors_are_reported_not_raised(reply: str, problem: str) -> None:
    parsed = parse_hermes(reply)
    assert parsed.tool_calls == [] and problem in (parsed.error or "")


def test_hermes_call_cut_off_by_max_tokens_still_parses_when_complete_json() -> None:
    parsed = parse_hermes('<tool_call>{"name": "bash", "arguments": {"command": "pwd"}}')
    assert parsed.tool_calls[0].arguments == {"command": "pwd"}


def test_openai_tool_calls_from_a_chat_completion_message() -> None:
    message = {"content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "python", "arguments": '{"code": "print(1)"}'}}]}
    parsed = parse_openai_tool_calls(message)
    assert parsed.tool_calls[0].id == "c1" and parsed.tool_calls[0].arguments == {"code": "print(1)"}
    broken = parse_openai_tool_calls({"tool_calls": [{"function": {"name": "python", "arguments": "{"}}]})
    assert broken.error and "malformed" in broken.error


def test_codeact_code_blocks_are_actions_and_plain_replies_are_answers() -> None:
    fmt = CodeActFormat()
    parsed = fmt.parse("First:\n```python\nprint(6*7)\n```\nthen\n```bash\nls -la\n```")
    assert [(c.name, c.arguments) for c in parsed.tool_calls] == [("python", {"code": "print(6*7)"}), ("bash", {"command": "ls -la"})]
    assert parsed.final_answer is None
    answer = fmt.parse("The answer is \\boxed{42}.")
    assert answer.tool_calls == [] and answer.final_answer == "The answer is \\boxed{42}."


def test_unknown_format_name_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="unknown tool_call_format 'xml'"):
        tool_call_format("xml")
