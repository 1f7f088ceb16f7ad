"""Token-in/token-out over the chat templates RL users train with: Qwen3 (think blocks), Llama 3.1, SmolLM2.

Each template string is written here as its model ships it. The vocabulary is SmolLM2's (it has the ChatML tokens
Qwen3 uses; Llama's header tokens become plain text, which keeps the text comparisons exact). A multi-turn tool
conversation is built the way TokenInTokenOut builds it — earlier prompt + generated ids + the continuation — and
its text must be what the template renders for the whole conversation at once.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from nemo_gym_prorl.agent.turns import TokenInTokenOut, Turn, http_poster
from nemo_gym_prorl.contracts.sampling import SamplingParams
from nemo_gym_prorl.json_http import JsonHttp
from nemo_gym_prorl.models.chat_template import TemplateNotIncrementalError
from nemo_gym_prorl.models.tokenizer import Tokenizer
from nemo_gym_prorl.tools import make_tools

# Qwen3's template (Qwen3-8B's tokenizer_config.json), with its think blocks and Hermes tool calls.
QWEN3 = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\\n\\n' }}
    {%- endif %}
    {{- "# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}"""

# Llama 3.1 Instruct's template (JSON tool calls, tool results as `ipython` turns, tools in the first user turn).
LLAMA31 = """{{- bos_token }}
{%- if custom_tools is defined %}
    {%- set tools = custom_tools %}
{%- endif %}
{%- if not tools_in_user_message is defined %}
    {%- set tools_in_user_message = true %}
{%- endif %}
{%- if not date_string is defined %}
    {%- set date_string = "26 Jul 2024" %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}

{#- This block extracts the system message, so we can slot it into the right place. #}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}

{#- System message + builtin tools #}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{%- if builtin_tools is defined or tools is not none %}
    {{- "Environment: ipython\\n" }}
{%- endif %}
{%- if builtin_tools is defined %}
    {{- "Tools: " + builtin_tools | reject('equalto', 'code_interpreter') | join(", ") + "\\n\\n"}}
{%- endif %}
{{- "Cutting Knowledge Date: December 2023\\n" }}
{{- "Today Date: " + date_string + "\\n\\n" }}
{%- if tools is not none and not tools_in_user_message %}
    {{- "You have access to the following functions. To call a function, please respond with JSON for a function call." }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\\n\\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\\n\\n" }}
    {%- endfor %}
{%- endif %}
{{- system_message }}
{{- "<|eot_id|>" }}

{#- Custom tools are passed in a user message with some extra guidance #}
{%- if tools_in_user_message and not tools is none %}
    {#- Extract the first user message so we can plug it in here #}
    {%- if messages | length != 0 %}
        {%- set first_user_message = messages[0]['content']|trim %}
        {%- set messages = messages[1:] %}
    {%- else %}
        {{- raise_exception("Cannot put tools in the first user message when there's no first user message!") }}
{%- endif %}
    {{- '<|start_header_id|>user<|end_header_id|>\\n\\n' -}}
    {{- "Given the following functions, please respond with a JSON for a function call " }}
    {{- "with its proper arguments that best answers the given prompt.\\n\\n" }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\\n\\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\\n\\n" }}
    {%- endfor %}
    {{- first_user_message + "<|eot_id|>"}}
{%- endif %}

{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- if not message.tool_calls|length == 1 %}
            {{- raise_exception("This model only supports single tool-calls at once!") }}
        {%- endif %}
        {%- set tool_call = message.tool_calls[0].function %}
        {%- if builtin_tools is defined and tool_call.name in builtin_tools %}
            {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}
            {{- "<|python_tag|>" + tool_call.name + ".call(" }}
            {%- for arg_name, arg_val in tool_call.arguments | items %}
                {{- arg_name + '="' + arg_val + '"' }}
                {%- if not loop.last %}
                    {{- ", " }}
                {%- endif %}
                {%- endfor %}
            {{- ")" }}
        {%- else  %}
            {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}
            {{- '{"name": "' + tool_call.name + '", ' }}
            {{- '"parameters": ' }}
            {{- tool_call.arguments | tojson }}
            {{- "}" }}
        {%- endif %}
        {%- if builtin_tools is defined %}
            {#- This means we're in ipython mode #}
            {{- "<|eom_id|>" }}
        {%- else %}
            {{- "<|eot_id|>" }}
        {%- endif %}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\\n\\n" }}
        {%- if message.content is mapping or message.content is iterable %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

# SmolLM2-Instruct's template as its GGUF carries it (plain ChatML; tools go in as Hermes text).
SMOLLM2 = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\n"
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>'"
    " + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# A template of the Mistral kind: the tools block sits before the *last* user message, so it moves as turns come.
TOOLS_BEFORE_LAST_USER = (
    "{%- set last_user = namespace(i=-1) %}{%- for m in messages %}{%- if m.role == 'user' %}"
    "{%- set last_user.i = loop.index0 %}{%- endif %}{%- endfor %}"
    "{%- for m in messages %}{%- if m.role == 'user' %}{%- if loop.index0 == last_user.i and tools %}"
    "[TOOLS]{{ tools | tojson }}[/TOOLS]{%- endif %}[INST]{{ m.content }}[/INST]"
    "{%- elif m.role == 'assistant' %}{{ m.content }}</s>{%- else %}[RESULT]{{ m.content }}[/RESULT]{%- endif %}"
    "{%- endfor %}"
)

TOOLS = [tool.schema() for tool in make_tools(["bash", "python"], 10).values()]
PROMPT = [{"role": "system", "content": "Solve it with the tools."}, {"role": "user", "content": "What is 6*7?"}]


def _call(name: str, arguments: dict[str, Any], n: int) -> dict[str, Any]:
    return {"id": f"call_{n}", "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}


def _tool(n: int, output: str) -> dict[str, Any]:
    return {"role": "tool", "tool_call_id": f"call_{n}", "content": output}


class Rollout:
    """A rollout's prompts built as TokenInTokenOut builds them, from scripted generations."""

    def __init__(self, tokenizer: Tokenizer, end_token: str | None) -> None:
        self.client = TokenInTokenOut(None, "m", tokenizer, SamplingParams())  # type: ignore[arg-type]
        self.tokenizer = tokenizer
        self.end_ids = tokenizer.encode(end_token) if end_token else []  # the model's end-of-generation token
        self.messages = [dict(m) for m in PROMPT]
        self.previous: Turn | None = None

    def generate(self, text: str, tool_calls: list[dict[str, Any]] | None = None) -> Turn:
        prompt = self.client.next_prompt(self.messages, TOOLS, self.previous)
        generated = self.tokenizer.encode(text) + self.end_ids
        turn = Turn(prompt_token_ids=prompt, generation_token_ids=generated,
                    generation_log_probs=[0.0] * len(generated), text=text, finish_reason="stop")  # fmt: skip
        if self.previous is not None:
            seen = self.previous.prompt_token_ids + self.previous.generation_token_ids
            assert prompt[: len(seen)] == seen  # contiguity: NeMo RL's rule
        calls = {"tool_calls": tool_calls} if tool_calls else {}
        self.messages.append({"role": "assistant", "content": text, **calls})
        self.previous = turn
        return turn

    def prompt_text(self) -> str:
        return self.tokenizer.decode(self.client.next_prompt(self.messages, TOOLS, self.previous), special=True)


def _as_written(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The conversation with each assistant turn as the model wrote it (its text, tool calls inside)."""
    return [{"role": "assistant", "content": m["content"]} if m["role"] == "assistant" else m for m in messages]


def test_qwen3_think_blocks_and_tool_calls_over_three_turns_render_as_the_template_renders_them(
    tokenizer: Tokenizer,
) -> None:
    qwen3 = tokenizer.with_chat_template(QWEN3)
    rollout = Rollout(qwen3, "<|im_end|>")
    rollout.generate(
        '<think>\nMultiply with python.\n</think>\n\n<tool_call>\n{"name": "python", "arguments": '
        '{"code": "print(6*7)"}}\n</tool_call>',
        [_call("python", {"code": "print(6*7)"}, 1)],
    )
    rollout.messages.append(_tool(1, "42"))
    # no think block this time: the turn Qwen3's template used to render with an empty one while it was last
    rollout.generate(
        '<tool_call>\n{"name": "bash", "arguments": {"command": "echo 42"}}\n</tool_call>\n<tool_call>\n'
        '{"name": "python", "arguments": {"code": "6*7"}}\n</tool_call>',
        [_call("bash", {"command": "echo 42"}, 2), _call("python", {"code": "6*7"}, 3)],
    )
    rollout.messages += [_tool(2, "42"), _tool(3, "42")]  # two results: one user turn in Qwen3's template
    rollout.generate(
        '<think>\nBoth say 42; finish.\n</think>\n\n<tool_call>\n{"name": "bash", "arguments": {"command": "true"}}\n'
        "</tool_call>",
        [_call("bash", {"command": "true"}, 4)],
    )
    rollout.messages.append(_tool(4, ""))

    expected = qwen3.chat_template.render(_as_written(rollout.messages), TOOLS, add_generation_prompt=True)
    text = rollout.prompt_text()
    assert text == expected
    assert text.count("<think>\n\n</think>") == 0  # never the empty block of a last message
    both = "<|im_start|>user\n<tool_response>\n42\n</tool_response>\n<tool_response>\n42\n</tool_response><|im_end|>"
    assert both in text


def test_a_generation_prompt_that_opens_the_think_block_qwen3_thinking_2507(tokenizer: Tokenizer) -> None:
    """Qwen3-*-Thinking-2507 prompts with '<think>\\n' already open; the model writes the rest of the block."""
    thinking = QWEN3.replace("{{- '<|im_start|>assistant\\n' }}", "{{- '<|im_start|>assistant\\n<think>\\n' }}")
    assert thinking != QWEN3
    rollout = Rollout(tokenizer.with_chat_template(thinking), "<|im_end|>")
    rollout.generate('Use python.\n</think>\n\n<tool_call>\n{"name": "python", "arguments": {"code": "1"}}\n'
                     "</tool_call>", [_call("python", {"code": "1"}, 1)])  # fmt: skip
    rollout.messages.append(_tool(1, "1"))
    rollout.generate('More.\n</think>\n\n<tool_call>\n{"name": "bash", "arguments": {"command": "ls"}}\n</tool_call>',
                     [_call("bash", {"command": "ls"}, 2)])  # fmt: skip
    rollout.messages.append(_tool(2, "a"))
    written = [m if m["role"] != "assistant" else {"role": "assistant", "content": "<think>\n" + m["content"]}
               for m in rollout.messages]  # fmt: skip
    assert rollout.prompt_text() == rollout.tokenizer.chat_template.render(written, TOOLS, add_generation_prompt=True)


def test_llama31_json_tool_calls_and_ipython_results_render_as_the_template_renders_them(tokenizer: Tokenizer) -> None:
    llama = tokenizer.with_chat_template(LLAMA31)
    assert llama.chat_template.bos_token == "<|im_start|>"  # SmolLM2's; the comparison below is on text
    rollout = Rollout(llama, None)  # <|eot_id|> is not a token here: the turns end as cut ones, closed by the template
    call = '{"name": "python", "parameters": {"code": "print(6*7)"}}'
    rollout.generate(call, [_call("python", {"code": "print(6*7)"}, 1)])
    rollout.messages.append(_tool(1, "42"))
    rollout.generate('{"name": "bash", "parameters": {"command": "ls"}}', [_call("bash", {"command": "ls"}, 2)])
    rollout.messages.append(_tool(2, "42"))
    rollout.generate("The answer is \\boxed{42}.")
    rollout.messages.append({"role": "user", "content": "Sure?"})

    text = rollout.prompt_text()
    assert text == llama.chat_template.render(_as_written(rollout.messages), TOOLS, add_generation_prompt=True)
    assert text.count("<|start_header_id|>ipython<|end_header_id|>\n\n\"42\"<|eot_id|>") == 2
    assert text.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")


def test_smollm2_with_tools_inlined_as_hermes_text_renders_as_the_template_renders_it(tokenizer: Tokenizer) -> None:
    smol = tokenizer.with_chat_template(SMOLLM2)
    assert smol.chat_template.source == tokenizer.chat_template.source  # the GGUF's own template
    rollout = Rollout(smol, "<|im_end|>")
    rollout.generate('<tool_call>\n{"name": "python", "arguments": {"code": "print(6*7)"}}\n</tool_call>',
                     [_call("python", {"code": "print(6*7)"}, 1)])  # fmt: skip
    rollout.messages.append(_tool(1, "42"))
    rollout.generate("\\boxed{42}")
    rollout.messages.append({"role": "user", "content": "Sure?"})

    assert rollout.prompt_text() == smol.chat_template.render(
        _as_written(rollout.messages), TOOLS, add_generation_prompt=True
    )


def test_a_turn_cut_at_max_tokens_is_closed_by_the_template_before_the_tool_results(tokenizer: Tokenizer) -> None:
    qwen3 = tokenizer.with_chat_template(QWEN3)
    rollout = Rollout(qwen3, None)  # no end-of-generation token: cut
    rollout.generate("<think>\nstill thinking")
    rollout.messages.append({"role": "user", "content": "Your last reply could not be used: cut"})
    assert rollout.prompt_text().endswith(
        "still thinking<|im_end|>\n<|im_start|>user\nYour last reply could not be used: cut<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_qwen3_keeps_the_model_s_own_reasoning_where_its_template_would_drop_it(tokenizer: Tokenizer) -> None:
    """A new user message makes Qwen3's template drop earlier turns' reasoning; the tokens the model saw stay."""
    qwen3 = tokenizer.with_chat_template(QWEN3)
    rollout = Rollout(qwen3, "<|im_end|>")
    rollout.generate('<think>\nUse python.\n</think>\n\n<tool_call>\n{"name": "python", "arguments": {"code": "1"}}\n'
                     "</tool_call>", [_call("python", {"code": "1"}, 1)])  # fmt: skip
    rollout.messages.append(_tool(1, "1"))
    rollout.generate("<think>\nHmm.\n</think>\n\nno call")
    rollout.messages.append({"role": "user", "content": "Your last reply could not be used: no tool call"})
    text = rollout.prompt_text()
    assert "Use python." in text and "Hmm." in text
    assert "Use python." not in qwen3.chat_template.render(_as_written(rollout.messages), TOOLS, True)


def test_a_template_that_moves_earlier_text_as_turns_come_fails_loudly(tokenizer: Tokenizer) -> None:
    rollout = Rollout(tokenizer.with_chat_template(TOOLS_BEFORE_LAST_USER), "<|im_end|>")
    rollout.generate("no call")
    rollout.messages.append(_tool(1, "fine: no user message yet"))
    rollout.generate("still none")
    rollout.messages.append({"role": "user", "content": "Use a tool."})
    with pytest.raises(TemplateNotIncrementalError, match=r"earlier turns differently.*TOOLS"):
        rollout.prompt_text()


# Short prompts keep the real model's prompt evaluation cheap on a CPU.
SMALL_TOOLS = [{"type": "function", "function": {"name": "sh", "description": "Run.", "parameters": {}}}]
TEMPLATES = {"qwen3": (QWEN3, "<|im_end|>"), "llama3.1": (LLAMA31, "<|eot_id|>"), "smollm2": (SMOLLM2, "<|im_end|>")}


@pytest.mark.parametrize("name", list(TEMPLATES))
async def test_multi_turn_tool_rollouts_against_the_real_model_server_match_a_one_shot_render(
    name: str, tokenizer: Tokenizer, model_server
) -> None:
    """Real turns per template: every prompt extends the last exactly, and the last prompt is the template's render
    of the whole conversation with each turn's generated text where its content goes."""
    source, turn_end = TEMPLATES[name]
    tok = tokenizer.with_chat_template(source)
    http = JsonHttp(timeout_s=120)
    sampling = SamplingParams(max_tokens=6, seed=3)
    client = TokenInTokenOut(http_poster(http, model_server.base_url), "local", tok, sampling)
    messages, previous, written = [{"role": "user", "content": "6*7?"}], None, []
    try:
        for n in range(2):  # two real turns; the third prompt is built below
            turn = await client.generate(messages, SMALL_TOOLS, previous)
            if previous is not None:
                seen = previous.prompt_token_ids + previous.generation_token_ids
                assert turn.prompt_token_ids[: len(seen)] == seen
            text = tok.decode(turn.generation_token_ids, special=True)
            written.append(text.removesuffix(turn_end))  # the template's own turn end follows a marker below
            messages += [{"role": "assistant", "content": turn.text, "tool_calls": [_call("sh", {}, n)]},
                         _tool(n, f"out {n}")]  # fmt: skip
            previous = turn
    finally:
        await http.aclose()
    final = client.next_prompt(messages, SMALL_TOOLS, previous)
    markers = [f"@@turn{n}@@" for n in range(2)]
    masked, n = [], 0
    for m in messages:
        if m["role"] == "assistant":
            m, n = {"role": "assistant", "content": markers[n]}, n + 1
        masked.append(m)
    expected = tok.chat_template.render(masked, SMALL_TOOLS, add_generation_prompt=True)
    for marker, text in zip(markers, written):
        expected = expected.replace(marker, text)
    assert tok.decode(final, special=True) == expected
