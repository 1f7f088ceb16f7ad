"""The agent's tools against real bubblewrap sandboxes: bash, the persistent python interpreter, the editor."""

from __future__ import annotations

import json
import os
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest

from nemo_gym_prorl.contracts.task import load_task
from nemo_gym_prorl.envs import make_environment
from nemo_gym_prorl.sandbox import Sandbox, SandboxSpec, open_sandbox
from nemo_gym_prorl.tools import BashTool, EditorTool, FinishTool, PythonTool, ToolOutput, make_tools


@pytest.fixture
async def sandbox() -> AsyncIterator[Sandbox]:
    async with open_sandbox("bwrap", SandboxSpec()) as sbx:
        yield sbx


async def python(sbx: Sandbox, code: str, tool: PythonTool | None = None) -> str:
    return (await (tool or PythonTool(timeout_s=10))(sbx, {"code": code})).text


async def bash(sbx: Sandbox, command: str) -> str:
    return (await BashTool(timeout_s=10)(sbx, {"command": command})).text


# -- registry ------------------------------------------------------------------------------------------------


def test_make_tools_builds_the_named_tools_with_matching_schemas() -> None:
    tools = make_tools(["bash", "python", "str_replace_editor", "finish"], timeout_s=7)
    assert list(tools) == ["bash", "python", "str_replace_editor", "finish"]
    for name, tool in tools.items():
        assert tool.name == name and tool.schema()["function"]["name"] == name
    assert tools["python"].timeout_s == 7  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="unknown tool 'shell'"):
        make_tools(["shell"], timeout_s=1)


async def test_tool_descriptions_name_the_workspace_of_the_tasks_sandboxes() -> None:
    """An SWE task's sandboxes have their workspace at /testbed (SandboxSpec.workspace): no tool description may
    point the model at /workspace, which does not exist there."""
    swe_task = load_task("swe/offline")
    for workdir in ("/testbed", "/src/repo"):
        task = swe_task.model_copy(update={"verifier": swe_task.verifier | {"workdir": workdir}})
        env = make_environment(task, "bwrap")
        described = json.dumps(env.tool_schemas())
        assert env.workspace == workdir
        assert "/workspace" not in described and f"`{workdir}/file.py`" in described
    async with open_sandbox("bwrap", SandboxSpec(workspace="/testbed")) as sbx:  # as SweEnvironment opens them
        assert (await sbx.run("cd /workspace 2>/dev/null || pwd", timeout=10)).output.strip() == "/testbed"
    assert "`/workspace/file.py`" in json.dumps(make_tools(["str_replace_editor"], 1)["str_replace_editor"].schema())


# -- bash ----------------------------------------------------------------------------------------------------


async def test_bash_timeout_is_reported_and_the_session_survives(sandbox: Sandbox) -> None:
    tool = BashTool(timeout_s=1)
    await tool(sandbox, {"command": "cd /tmp && export KEEP=yes"})
    text = (await tool(sandbox, {"command": "echo started; sleep 30"})).text
    assert text.startswith("started") and "timed out after 1s" in text
    assert (await tool(sandbox, {"command": "echo $PWD $KEEP"})).text.strip() == "/tmp yes"


async def test_bash_reports_a_failing_exit_code(sandbox: Sandbox) -> None:
    assert (await bash(sandbox, "echo no; (exit 3)")).endswith("no\n[exit code 3]")


# -- python --------------------------------------------------------------------------------------------------


async def test_python_keeps_variables_and_imports_between_calls(sandbox: Sandbox) -> None:
    tool = PythonTool(timeout_s=10)
    assert await python(sandbox, "import math\nx = 41\ndef inc(v):\n    return v + 1", tool) == ""
    assert await python(sandbox, "inc(x)", tool) == "42\n"  # a last expression is printed, as in the REPL
    assert await python(sandbox, "print(math.floor(math.pi), x)", tool) == "3 41\n"


async def test_python_exception_comes_back_as_a_traceback_and_the_state_stays(sandbox: Sandbox) -> None:
    tool = PythonTool(timeout_s=10)
    await python(sandbox, "total = 10", tool)
    text = await python(sandbox, "def f():\n    return 1 / 0\nf()", tool)
    assert text.startswith("Traceback (most recent call last):")
    assert "line 2, in f\n    return 1 / 0" in text and text.rstrip().endswith("ZeroDivisionError: division by zero")
    assert "repl.py" not in text  # the interpreter's own frames are not shown
    assert "SyntaxError" in await python(sandbox, "def broken(:", tool)
    assert await python(sandbox, "total", tool) == "10\n"


async def test_python_hung_cell_is_interrupted_and_the_interpreter_survives(sandbox: Sandbox) -> None:
    tool = PythonTool(timeout_s=1, interrupt_grace_s=5)
    await python(sandbox, "kept = 'still here'", tool)
    started = time.monotonic()
    text = await python(sandbox, "print('looping', flush=True)\nwhile True: pass", tool)
    assert time.monotonic() - started < 5  # interrupted at the timeout, not at the end of the grace period
    assert text.startswith("looping\nTraceback") and "KeyboardInterrupt" in text
    assert "[timed out after 1s: interrupted with KeyboardInterrupt; the interpreter and its variables survive]" in text
    assert await python(sandbox, "kept", tool) == "'still here'\n"


async def test_python_cell_ignoring_the_interrupt_is_killed_and_the_next_call_says_so(sandbox: Sandbox) -> None:
    tool = PythonTool(timeout_s=1, interrupt_grace_s=0.5)
    await python(sandbox, "lost = 1", tool)
    text = await python(
        sandbox, "import signal, time\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\nwhile True: time.sleep(0.05)", tool
    )
    assert "did not stop on KeyboardInterrupt: the interpreter was killed" in text
    text = await python(sandbox, "lost", tool)
    assert "NameError: name 'lost' is not defined" in text and "a new Python interpreter was started" in text
    assert await python(sandbox, "1 + 1", tool) == "2\n"  # and the new one keeps going without further notes


async def test_python_exiting_interpreter_is_reported_and_replaced(sandbox: Sandbox) -> None:
    tool = PythonTool(timeout_s=10)
    assert "[SystemExit(3) ignored: the interpreter keeps running]" in await python(
        sandbox, "import sys; sys.exit(3)", tool
    )
    assert "the Python interpreter exited while running this cell" in await python(
        sandbox, "import os; os._exit(1)", tool
    )
    assert "a new Python interpreter was started" in await python(sandbox, "print('ok')", tool)


async def test_python_captures_stdout_stderr_and_child_processes_in_order(sandbox: Sandbox) -> None:
    code = "import os, sys\nprint('one')\nprint('two', file=sys.stderr)\nos.system('echo three')\nprint('four')"
    assert await python(sandbox, code) == "one\ntwo\nthree\nfour\n"


async def test_python_follows_the_shell_into_a_new_directory(sandbox: Sandbox) -> None:
    tool = PythonTool(timeout_s=10)
    await sandbox.write_file("problem.txt", b"top")
    assert await python(sandbox, "open('problem.txt').read()", tool) == "'top'\n"
    await bash(sandbox, "mkdir -p sub && cd sub && echo -n nested > problem.txt")
    assert await python(sandbox, "import os; print(os.getcwd(), open('problem.txt').read())", tool) == (
        "/workspace/sub nested\n"
    )


async def test_python_output_is_capped_head_and_tail(sandbox: Sandbox) -> None:
    tool = PythonTool(timeout_s=10, max_output_bytes=1000)
    text = await python(sandbox, "for i in range(10000): print(i)", tool)
    assert text.startswith("0\n1\n") and text.endswith("9998\n9999\n") and "bytes of output truncated" in text
    assert len(text) < 1200


async def test_one_python_tool_keeps_separate_interpreters_per_sandbox(sandbox: Sandbox) -> None:
    tool = PythonTool(timeout_s=10)
    async with open_sandbox("bwrap", SandboxSpec()) as other:
        await python(sandbox, "who = 'first'", tool)
        await python(other, "who = 'second'", tool)
        assert await python(sandbox, "who", tool) == "'first'\n"
        assert await python(other, "who", tool) == "'second'\n"


async def test_closing_the_sandbox_ends_its_interpreter(sandbox: Sandbox) -> None:
    await python(sandbox, "x = 1")
    outer = sandbox.pid  # type: ignore[attr-defined]
    interpreters = [pid for pid in _descendants(outer) if b"repl.py\0serve" in _cmdline(pid)]
    assert len(interpreters) == 1
    await sandbox.close()
    assert not any(os.path.exists(f"/proc/{pid}") for pid in interpreters)


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


def _descendants(root: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", "rb") as f:
                    ppid = int(f.read().rsplit(b")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    found, todo = set(), [root]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


# -- str_replace_editor ------------------------------------------------------------------------------------------


async def edit(sbx: Sandbox, tool: EditorTool | None = None, **arguments: Any) -> str:
    return (await (tool or EditorTool())(sbx, arguments)).text


async def test_editor_views_a_file_with_line_numbers_and_a_range(sandbox: Sandbox) -> None:
    await sandbox.write_file("src/a.py", b"one\ntwo\nthree\n")
    assert await edit(sandbox, command="view", path="/workspace/src/a.py") == (
        "Here's the result of running `cat -n` on /workspace/src/a.py:\n     1\tone\n     2\ttwo\n     3\tthree"
    )
    text = await edit(sandbox, command="view", path="src/a.py", view_range=[2, -1])
    assert text.endswith("     2\ttwo\n     3\tthree") and "1\tone" not in text
    assert "Invalid `view_range`" in await edit(sandbox, command="view", path="src/a.py", view_range=[5, 6])


async def test_editor_lists_a_directory_two_levels_deep_without_hidden_entries(sandbox: Sandbox) -> None:
    for path in ("pkg/mod.py", "pkg/sub/deep.py", "pkg/sub/deeper/x.py", "pkg/.hidden/h.py", "top.txt"):
        await sandbox.write_file(path, b"")
    text = await edit(sandbox, command="view", path="/workspace")
    listed = text.splitlines()[1:]
    assert listed == ["/workspace/pkg", "/workspace/pkg/mod.py", "/workspace/pkg/sub", "/workspace/top.txt"]
    assert "up to 2 levels deep in /workspace" in text.splitlines()[0]


async def test_editor_creates_files_but_never_overwrites(sandbox: Sandbox) -> None:
    assert await edit(sandbox, command="create", path="/workspace/new/f.txt", file_text="hi\n") == (
        "File created successfully at: /workspace/new/f.txt"
    )
    assert await sandbox.read_file("new/f.txt") == b"hi\n"
    text = await edit(sandbox, command="create", path="/workspace/new/f.txt", file_text="other")
    assert "File already exists at: /workspace/new/f.txt" in text
    assert await sandbox.read_file("new/f.txt") == b"hi\n"


async def test_editor_str_replace_needs_exactly_one_match(sandbox: Sandbox) -> None:
    original = b"a = 1\nb = 2\na = 1\nc = 3\n"
    await sandbox.write_file("f.py", original)
    text = await edit(sandbox, command="str_replace", path="/workspace/f.py", old_str="a = 1", new_str="a = 9")
    assert text.startswith("Error: No replacement was performed") and "2 times" in text and "lines 1, 3" in text
    text = await edit(sandbox, command="str_replace", path="/workspace/f.py", old_str="zzz", new_str="y")
    assert "did not appear verbatim in /workspace/f.py" in text
    assert await sandbox.read_file("f.py") == original  # neither touched the file
    text = await edit(sandbox, command="str_replace", path="/workspace/f.py", old_str="b = 2\na = 1", new_str="b = 7")
    assert text.startswith("The file /workspace/f.py has been edited.") and "     2\tb = 7\n     3\tc = 3" in text
    assert await sandbox.read_file("f.py") == b"a = 1\nb = 7\nc = 3\n"


async def test_editor_inserts_after_a_line_and_undoes_edits_in_order(sandbox: Sandbox) -> None:
    tool = EditorTool()
    await sandbox.write_file("f.txt", b"first\nsecond\n")
    assert "has been edited" in await edit(
        sandbox, tool, command="insert", path="f.txt", insert_line=1, new_str="middle"
    )
    assert await sandbox.read_file("f.txt") == b"first\nmiddle\nsecond\n"
    await edit(sandbox, tool, command="insert", path="f.txt", insert_line=0, new_str="zero")
    await edit(sandbox, tool, command="insert", path="f.txt", insert_line=4, new_str="last")
    assert await sandbox.read_file("f.txt") == b"zero\nfirst\nmiddle\nsecond\nlast\n"
    text = await edit(sandbox, tool, command="insert", path="f.txt", insert_line=9, new_str="x")
    assert "Invalid `insert_line` parameter: 9" in text and "[0, 5]" in text
    await edit(sandbox, tool, command="str_replace", path="f.txt", old_str="middle", new_str="MIDDLE")
    for expected in (
        b"zero\nfirst\nmiddle\nsecond\nlast\n",
        b"zero\nfirst\nmiddle\nsecond\n",
        b"first\nmiddle\nsecond\n",
        b"first\nsecond\n",
    ):
        assert "undone successfully" in await edit(sandbox, tool, command="undo_edit", path="/workspace/f.txt")
        assert await sandbox.read_file("f.txt") == expected
    assert "No edit history found for /workspace/f.txt" in await edit(sandbox, tool, command="undo_edit", path="f.txt")


async def test_editor_refuses_paths_outside_the_workspace(sandbox: Sandbox) -> None:
    for path in ("/etc/passwd", "/workspace/../etc/passwd", "../../etc/hostname", "/workspaces/x"):
        text = await edit(sandbox, command="view", path=path)
        assert text.startswith("Error: The path") and "outside the workspace" in text, path
    await bash(sandbox, "ln -s /etc/passwd link")
    text = await edit(sandbox, command="view", path="/workspace/link")
    assert text.startswith("Error:") and "root:" not in text
    text = await edit(sandbox, command="create", path="/tmp/x", file_text="x")
    assert "outside the workspace" in text


async def test_editor_reports_missing_files_and_directories_as_errors(sandbox: Sandbox) -> None:
    assert "does not exist" in await edit(sandbox, command="view", path="/workspace/nope.txt")
    assert "does not exist" in await edit(sandbox, command="str_replace", path="nope.txt", old_str="a")
    await sandbox.write_file("d/f", b"")
    assert "is a directory" in await edit(sandbox, command="insert", path="d", insert_line=0, new_str="x")
    assert "not allowed when `path` is a directory" in await edit(sandbox, command="view", path="d", view_range=[1, 2])


async def test_one_editor_keeps_undo_history_per_sandbox(sandbox: Sandbox) -> None:
    tool = EditorTool()
    async with open_sandbox("bwrap", SandboxSpec()) as other:
        for sbx in (sandbox, other):
            await sbx.write_file("f.txt", b"x\n")
        await edit(sandbox, tool, command="str_replace", path="f.txt", old_str="x", new_str="y")
        assert "No edit history" in await edit(other, tool, command="undo_edit", path="f.txt")
        assert "undone successfully" in await edit(sandbox, tool, command="undo_edit", path="f.txt")


# -- bad arguments never raise -----------------------------------------------------------------------------------

BAD_CALLS: list[tuple[str, Any]] = [
    ("bash", {}),
    ("bash", {"command": 5}),
    ("bash", {"command": "  "}),
    ("python", {}),
    ("python", {"code": ["print(1)"]}),
    ("str_replace_editor", {}),
    ("str_replace_editor", {"command": "delete", "path": "/workspace/f.txt"}),
    ("str_replace_editor", {"command": "view"}),
    ("str_replace_editor", {"command": "view", "path": 3}),
    ("str_replace_editor", {"command": "create", "path": "/workspace/g.txt"}),
    ("str_replace_editor", {"command": "str_replace", "path": "/workspace/f.txt"}),
    ("str_replace_editor", {"command": "str_replace", "path": "/workspace/f.txt", "old_str": ""}),
    ("str_replace_editor", {"command": "insert", "path": "/workspace/f.txt", "new_str": "x", "insert_line": "two"}),
    ("str_replace_editor", {"command": "insert", "path": "/workspace/f.txt", "insert_line": 1}),
    ("str_replace_editor", {"command": "view", "path": "/workspace/f.txt", "view_range": "all"}),
    ("str_replace_editor", {"command": "view", "path": "/workspace/f.txt", "view_range": [1, 2, 3]}),
    ("str_replace_editor", "not an object"),
    ("finish", {}),
]


@pytest.mark.parametrize(("name", "arguments"), BAD_CALLS)
async def test_tools_answer_bad_arguments_with_text(sandbox: Sandbox, name: str, arguments: Any) -> None:
    await sandbox.write_file("f.txt", b"line\n")
    output = await make_tools([name], timeout_s=5)[name](sandbox, arguments)
    assert isinstance(output, ToolOutput) and output.text and not output.finished
    assert await sandbox.read_file("f.txt") == b"line\n"


async def test_finish_ends_the_episode_with_the_answer(sandbox: Sandbox) -> None:
    output = await FinishTool()(sandbox, {"answer": 42})
    assert output.finished and output.answer == "42"
