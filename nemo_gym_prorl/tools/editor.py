"""`str_replace_editor`: view, create and edit text files in the workspace (the SWE-agent / OpenHands editor).

Commands: `view` (a file with line numbers, optionally a `view_range`; a directory as a listing two levels deep,
hidden entries left out), `create` (a new file; never overwrites), `str_replace` (`old_str` must occur exactly
once; otherwise nothing changes and the error says where it occurs), `insert` (`new_str` after line
`insert_line`, 0 for the top), `undo_edit` (reverts the last `str_replace`/`insert` on that file, repeatedly).

Paths are absolute under the workspace (a relative one is taken as relative to the workspace); anything that
leads outside is refused with an explanation. Files move through the sandbox API (`read_file`/`write_file`,
which also refuse symlinks out of the workspace); directory listings run `find` with `exec`. The undo history
lives in the tool, per sandbox and per file, so edits made with bash meanwhile are overwritten by an undo.
"""

from __future__ import annotations

import json
import posixpath
import weakref
from typing import Any

from nemo_gym_prorl.contracts.sandbox import WORKSPACE, Sandbox
from nemo_gym_prorl.tools.base import ToolOutput, function_schema, workspace_dir

COMMANDS = ("view", "create", "str_replace", "insert", "undo_edit")
SNIPPET_LINES = 4
MAX_RESPONSE_CHARS = 16_000
MAX_UNDO_PER_FILE = 20

_CLIPPED = (
    "<response clipped><NOTE>To save on context only part of this file has been shown to you. Search inside the "
    "file with `grep -n` to find the line numbers you need, then view them with `view_range`.</NOTE>"
)


class EditorError(Exception):
    """A request the editor refuses; the message is for the model."""


class EditorTool:
    name = "str_replace_editor"

    def __init__(self, timeout_s: float = 30.0) -> None:
        self.timeout_s = timeout_s
        self._history: weakref.WeakKeyDictionary[Sandbox, dict[str, list[bytes]]] = weakref.WeakKeyDictionary()

    def schema(self, workspace: str = WORKSPACE) -> dict[str, Any]:
        return function_schema(
            "str_replace_editor",
            "Custom editing tool for viewing, creating and editing plain-text files in the workspace.\n"
            "* If `path` is a file, `view` displays it with line numbers (like `cat -n`). If `path` is a directory, "
            "`view` lists non-hidden files and directories up to 2 levels deep.\n"
            "* `create` makes a new file; it cannot be used if `path` already exists.\n"
            "* `str_replace` replaces `old_str` with `new_str`. `old_str` must match EXACTLY one place in the file, "
            "whitespace included: if it matches nowhere or more than once, nothing is replaced; include enough "
            "surrounding lines to make it unique.\n"
            "* `insert` inserts `new_str` after line `insert_line` (0 inserts at the top).\n"
            "* `undo_edit` reverts the last `str_replace` or `insert` made to the file at `path`.\n"
            "* Long outputs are clipped and marked with `<response clipped>`.",
            {
                "command": {"type": "string", "enum": list(COMMANDS), "description": "the command to run"},
                "path": {
                    "type": "string",
                    "description": f"absolute path to a file or directory in the workspace, e.g. `{workspace}/file.py`",
                },
                "file_text": {"type": "string", "description": "`create`: the content of the new file"},
                "old_str": {"type": "string", "description": "`str_replace`: the exact text to replace"},
                "new_str": {
                    "type": "string",
                    "description": "`str_replace`: the replacement (empty when omitted); `insert`: the text to insert",
                },
                "insert_line": {
                    "type": "integer",
                    "description": "`insert`: `new_str` goes after this line (1-based; 0 for the top of the file)",
                },
                "view_range": {
                    "type": "array",
                    "items": {"type": "integer"},
                    "description": "`view` of a file: [start, end] lines to show, 1-based and inclusive; "
                    "end -1 shows to the end of the file",
                },
            },
            ["command", "path"],
        )

    async def __call__(self, sandbox: Sandbox, arguments: dict[str, Any]) -> ToolOutput:
        try:
            if not isinstance(arguments, dict):
                raise EditorError(f"arguments must be an object, got {type(arguments).__name__}")
            command = arguments.get("command")
            if command not in COMMANDS:
                raise EditorError(
                    f"Unrecognized command {command!r}. The allowed commands for the {self.name} tool are: "
                    + ", ".join(COMMANDS)
                )
            path = self._resolve(sandbox, arguments.get("path"))
            text = await getattr(self, f"_{command}")(sandbox, path, arguments)
        except EditorError as e:
            text = f"Error: {e}"
        except (OSError, ValueError) as e:  # the sandbox refused the file: outside the workspace, a symlink, ...
            text = f"Error: {type(e).__name__}: {e}"
        return ToolOutput(text=_clip(text))

    # -- commands ----------------------------------------------------------------------------------------------

    async def _view(self, sandbox: Sandbox, path: str, arguments: dict[str, Any]) -> str:
        view_range = arguments.get("view_range")
        try:
            text = await self._read_text(sandbox, path) if path != workspace_dir(sandbox) else None
        except IsADirectoryError:
            text = None
        if text is None:
            if view_range is not None:
                raise EditorError("`view_range` is not allowed when `path` is a directory")
            return await self._list_directory(sandbox, path)
        lines = _lines(text)
        if view_range is None:
            if not lines:
                return f"The file {path} is empty."
            return f"Here's the result of running `cat -n` on {path}:\n{_numbered(lines, 1)}"
        start, end = _view_range(view_range, len(lines))
        return f"Here's the result of running `cat -n` on {path} (lines {start}-{end}):\n" + _numbered(
            lines[start - 1 : end], start
        )

    async def _create(self, sandbox: Sandbox, path: str, arguments: dict[str, Any]) -> str:
        file_text = _string(arguments, "file_text", "create")
        try:
            await sandbox.read_file(path)
        except FileNotFoundError:
            pass
        except IsADirectoryError:
            raise EditorError(f"{path} is a directory; `create` makes files") from None
        else:
            raise EditorError(f"File already exists at: {path}. Cannot overwrite files using command `create`.")
        await sandbox.write_file(path, file_text.encode("utf-8"))
        self._files(sandbox).pop(path, None)
        return f"File created successfully at: {path}"

    async def _str_replace(self, sandbox: Sandbox, path: str, arguments: dict[str, Any]) -> str:
        old_str = _string(arguments, "old_str", "str_replace")
        new_str = _string(arguments, "new_str", "str_replace", default="")
        if not old_str:
            raise EditorError("`old_str` is empty; give the exact text to replace")
        text = await self._read_file_text(sandbox, path)
        starts = _occurrences(text, old_str)
        if not starts:
            hint = ""
            if old_str.strip() and old_str.strip() in text:
                hint = (
                    " It does occur once leading and trailing whitespace is ignored: check indentation and line breaks."
                )
            raise EditorError(f"No replacement was performed: `old_str` did not appear verbatim in {path}.{hint}")
        if len(starts) > 1:
            lines = ", ".join(str(text.count("\n", 0, i) + 1) for i in starts)
            raise EditorError(
                f"No replacement was performed: `old_str` occurs {len(starts)} times in {path}, starting in lines "
                f"{lines}. Include more surrounding lines in `old_str` so that it matches exactly once."
            )
        at = starts[0]
        new_text = text[:at] + new_str + text[at + len(old_str) :]
        await self._write_edit(sandbox, path, text, new_text)
        first = text.count("\n", 0, at)
        return _edited(path, new_text, first, first + new_str.count("\n"))

    async def _insert(self, sandbox: Sandbox, path: str, arguments: dict[str, Any]) -> str:
        new_str = _string(arguments, "new_str", "insert")
        after = _integer(arguments, "insert_line", "insert")
        text = await self._read_file_text(sandbox, path)
        lines = _split_keepends(text)
        if not 0 <= after <= len(lines):
            raise EditorError(
                f"Invalid `insert_line` parameter: {after}. It should be within the range of lines of the file: "
                f"[0, {len(lines)}]"
            )
        block = new_str if new_str.endswith("\n") else new_str + "\n"
        if after == len(lines) and lines and not lines[-1].endswith("\n"):
            lines[-1] += "\n"  # appending after a last line that had no newline
            block = block[:-1] if not new_str.endswith("\n") else block
        new_text = "".join(lines[:after]) + block + "".join(lines[after:])
        await self._write_edit(sandbox, path, text, new_text)
        return _edited(path, new_text, after, after + max(block.count("\n"), 1) - 1)

    async def _undo_edit(self, sandbox: Sandbox, path: str, arguments: dict[str, Any]) -> str:
        history = self._files(sandbox).get(path)
        if not history:
            raise EditorError(f"No edit history found for {path}.")
        previous = history.pop()
        await sandbox.write_file(path, previous)
        lines = _lines(previous.decode("utf-8"))
        return f"Last edit to {path} undone successfully. Here's the result of running `cat -n` on {path}:\n" + (
            _numbered(lines, 1) if lines else "(the file is now empty)"
        )

    # -- helpers -----------------------------------------------------------------------------------------------

    def _resolve(self, sandbox: Sandbox, raw: Any) -> str:
        """`raw` as a normalized absolute path under the workspace, or EditorError saying why not."""
        if not isinstance(raw, str) or not raw.strip():
            raise EditorError('argument "path" (a string) is required')
        workspace = workspace_dir(sandbox)
        raw = raw.strip()
        path = posixpath.normpath(raw if raw.startswith("/") else posixpath.join(workspace, raw))
        if path != workspace and not path.startswith(workspace.rstrip("/") + "/"):
            raise EditorError(
                f"The path {raw} is outside the workspace. Only files under {workspace} can be viewed or edited."
            )
        return path

    def _files(self, sandbox: Sandbox) -> dict[str, list[bytes]]:
        files = self._history.get(sandbox)
        if files is None:
            files = self._history[sandbox] = {}
        return files

    async def _read_text(self, sandbox: Sandbox, path: str) -> str:
        try:
            data = await sandbox.read_file(path)
        except FileNotFoundError:
            raise EditorError(f"The path {path} does not exist. Please provide a valid path.") from None
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError:
            raise EditorError(
                f"{path} is not a UTF-8 text file ({len(data)} bytes); inspect it with bash instead"
            ) from None

    async def _read_file_text(self, sandbox: Sandbox, path: str) -> str:
        try:
            return await self._read_text(sandbox, path)
        except IsADirectoryError:
            raise EditorError(f"{path} is a directory; only files can be edited") from None

    async def _write_edit(self, sandbox: Sandbox, path: str, old: str, new: str) -> None:
        await sandbox.write_file(path, new.encode("utf-8"))
        history = self._files(sandbox).setdefault(path, [])
        history.append(old.encode("utf-8"))
        del history[:-MAX_UNDO_PER_FILE]

    async def _list_directory(self, sandbox: Sandbox, path: str) -> str:
        argv = ["find", path, "-mindepth", "1", "-maxdepth", "2", "-name", ".*", "-prune", "-o", "-print"]
        result = await sandbox.exec(argv, timeout=self.timeout_s)
        if result.exit_code != 0:
            if "No such file" in result.output:
                raise EditorError(f"The path {path} does not exist. Please provide a valid path.")
            raise EditorError(f"could not list {path}: {result.output.strip() or result.exit_code}")
        entries = sorted(line for line in result.output.splitlines() if line)
        listing = "\n".join(entries) if entries else "(empty)"
        return f"Here are the files and directories up to 2 levels deep in {path}, excluding hidden items:\n{listing}"


def _string(arguments: dict[str, Any], key: str, command: str, default: str | None = None) -> str:
    value = arguments.get(key)
    if value is None and default is not None:
        return default
    if not isinstance(value, str):
        got = "nothing" if value is None else type(value).__name__
        raise EditorError(f"`{key}` (a string) is required for `{command}`, got {got}")
    return value


def _integer(arguments: dict[str, Any], key: str, command: str) -> int:
    value = arguments.get(key)
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool):
        got = "nothing" if value is None else repr(value)
        raise EditorError(f"`{key}` (an integer) is required for `{command}`, got {got}")
    return value


def _view_range(raw: Any, n_lines: int) -> tuple[int, int]:
    """A validated 1-based inclusive [start, end]; end -1 (or past the end) means the last line."""
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except ValueError:
            pass
    if (
        not isinstance(raw, list | tuple)
        or len(raw) != 2
        or not all(isinstance(x, int) and not isinstance(x, bool) for x in raw)
    ):
        raise EditorError(f"Invalid `view_range`: {raw!r}. It should be a list of two integers, e.g. [1, 20]")
    start, end = raw
    if n_lines == 0:
        raise EditorError("Invalid `view_range`: the file is empty")
    if not 1 <= start <= n_lines:
        raise EditorError(f"Invalid `view_range`: {raw}. Its first element should be within [1, {n_lines}]")
    if end == -1 or end > n_lines:
        end = n_lines
    if end < start:
        raise EditorError(f"Invalid `view_range`: {raw}. Its second element should be -1 or at least {start}")
    return start, end


def _occurrences(text: str, needle: str) -> list[int]:
    starts, at = [], text.find(needle)
    while at >= 0:
        starts.append(at)
        at = text.find(needle, at + len(needle))
    return starts


def _lines(text: str) -> list[str]:
    """The file's lines as `cat -n` numbers them (a final newline does not start another line)."""
    lines = text.split("\n")
    return lines[:-1] if lines and lines[-1] == "" else lines


def _split_keepends(text: str) -> list[str]:
    """Lines with their "\\n" kept, splitting on "\\n" only (str.splitlines would also split on "\\r")."""
    parts = text.split("\n")
    lines = [p + "\n" for p in parts[:-1]]
    return lines + [parts[-1]] if parts[-1] else lines


def _numbered(lines: list[str], first: int) -> str:
    return "\n".join(f"{n:6}\t{line}" for n, line in enumerate(lines, first))


def _edited(path: str, new_text: str, first_changed: int, last_changed: int) -> str:
    """The edit's confirmation with a snippet around 0-based lines first_changed..last_changed of the new file."""
    lines = _lines(new_text)
    start = max(0, first_changed - SNIPPET_LINES)
    end = min(len(lines), last_changed + SNIPPET_LINES + 1)
    snippet = _numbered(lines[start:end], start + 1)
    return (
        f"The file {path} has been edited. Here's the result of running `cat -n` on a snippet of {path}:\n"
        f"{snippet}\nReview the changes and make sure they are as expected. Edit the file again if necessary."
    )


def _clip(text: str) -> str:
    return text if len(text) <= MAX_RESPONSE_CHARS else text[:MAX_RESPONSE_CHARS] + "\n" + _CLIPPED
