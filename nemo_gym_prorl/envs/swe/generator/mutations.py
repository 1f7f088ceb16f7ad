"""Procedural bugs in the spirit of SWE-smith (arXiv 2504.21798): one seeded edit inside one function, made with
Python's ``ast`` and applied to the source text at the edited node's position, so the diff is that edit alone.

Kinds: invert an ``if``, flip a comparison, change an arithmetic or boolean operator, remove an ``if``'s
condition (its body runs always), remove an assignment, remove a loop, change an integer constant by one, swap
two adjacent statements.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass

_FLIP_COMPARE = {ast.Eq: ast.NotEq, ast.NotEq: ast.Eq, ast.Lt: ast.GtE, ast.GtE: ast.Lt, ast.Gt: ast.LtE,
                 ast.LtE: ast.Gt, ast.Is: ast.IsNot, ast.IsNot: ast.Is, ast.In: ast.NotIn, ast.NotIn: ast.In}  # fmt: skip
_CHANGE_BINOP = {ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Mult: ast.Add, ast.FloorDiv: ast.Mult, ast.Mod: ast.FloorDiv}
_CHANGE_BOOLOP = {ast.And: ast.Or, ast.Or: ast.And}


@dataclass(frozen=True)
class Mutation:
    kind: str
    function: str
    line: int
    source: str  # the whole module after the edit


def _functions(tree: ast.Module) -> Iterator[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef):
                    yield f"{node.name}.{item.name}", item
        elif isinstance(node, ast.Module):
            for item in node.body:
                if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef):
                    yield item.name, item


class _Source:
    def __init__(self, text: str) -> None:
        self.lines = text.splitlines(keepends=True)

    def offset(self, line: int, col: int) -> int:
        return sum(len(s.encode()) for s in self.lines[: line - 1]) + col

    def replace_node(self, node: ast.AST, new: str) -> str:
        data = "".join(self.lines).encode()
        start = self.offset(node.lineno, node.col_offset)  # type: ignore[attr-defined]
        end = self.offset(node.end_lineno, node.end_col_offset)  # type: ignore[attr-defined]
        return (data[:start] + new.encode() + data[end:]).decode()

    def without_lines(self, first: int, last: int) -> str:
        return "".join(self.lines[: first - 1] + self.lines[last:])

    def swap_lines(self, a: ast.stmt, b: ast.stmt) -> str:
        first = self.lines[a.lineno - 1 : a.end_lineno]
        second = self.lines[b.lineno - 1 : b.end_lineno]
        return "".join(self.lines[: a.lineno - 1] + second + first + self.lines[b.end_lineno :])


def _blocks(function: ast.AST) -> Iterator[list[ast.stmt]]:
    for node in ast.walk(function):
        for name in ("body", "orelse", "finalbody"):
            block = getattr(node, name, None)
            if isinstance(block, list) and block and isinstance(block[0], ast.stmt):
                yield block


def _own_lines(stmt: ast.stmt, source: _Source) -> bool:
    """Whether the statement has its lines to itself (no `a = 1; b = 2`), so line edits touch it alone."""
    before = source.lines[stmt.lineno - 1][: stmt.col_offset]
    after = source.lines[stmt.end_lineno - 1][stmt.end_col_offset :]  # type: ignore[index]
    return not before.strip() and (not after.strip() or after.strip().startswith("#"))


def mutations(text: str) -> list[Mutation]:
    """Every single-edit mutation of the module's functions, in source order (the generator samples from these)."""
    tree = ast.parse(text)
    source = _Source(text)
    found: list[Mutation] = []

    def add(kind: str, function: str, node: ast.AST, new_text: str) -> None:
        try:
            ast.parse(new_text)
        except SyntaxError:
            return
        if new_text != text:
            found.append(Mutation(kind, function, node.lineno, new_text))  # type: ignore[attr-defined]

    for name, function in _functions(tree):
        for node in ast.walk(function):
            if isinstance(node, ast.If):
                segment = ast.get_source_segment(text, node.test)
                if segment and "\n" not in segment:
                    add("invert_if", name, node, source.replace_node(node.test, f"not ({segment})"))
            if isinstance(node, ast.Compare) and len(node.ops) == 1 and type(node.ops[0]) in _FLIP_COMPARE:
                flipped = ast.Compare(node.left, [_FLIP_COMPARE[type(node.ops[0])]()], node.comparators)
                add("flip_operator", name, node, source.replace_node(node, ast.unparse(flipped)))
            if isinstance(node, ast.BinOp) and type(node.op) in _CHANGE_BINOP:
                changed = ast.BinOp(node.left, _CHANGE_BINOP[type(node.op)](), node.right)
                add("change_operator", name, node, source.replace_node(node, f"({ast.unparse(changed)})"))
            if isinstance(node, ast.BoolOp) and type(node.op) in _CHANGE_BOOLOP:
                changed = ast.BoolOp(_CHANGE_BOOLOP[type(node.op)](), node.values)
                add("change_operator", name, node, source.replace_node(node, f"({ast.unparse(changed)})"))
            if isinstance(node, ast.Constant) and type(node.value) is int and node.col_offset >= 0:
                add("constant_off_by_one", name, node, source.replace_node(node, repr(node.value + 1)))
        for block in _blocks(function):
            for i, stmt in enumerate(block):
                own = _own_lines(stmt, source)
                if own and len(block) > 1 and isinstance(stmt, ast.Assign | ast.AugAssign):
                    add("remove_assignment", name, stmt, source.without_lines(stmt.lineno, stmt.end_lineno))
                if own and len(block) > 1 and isinstance(stmt, ast.For | ast.While):
                    add("remove_loop", name, stmt, source.without_lines(stmt.lineno, stmt.end_lineno))
                if own and isinstance(stmt, ast.If) and not stmt.orelse and stmt.test.lineno == stmt.lineno:
                    segment = ast.get_source_segment(text, stmt.test)
                    if segment and "\n" not in segment:
                        add("remove_condition", name, stmt, source.replace_node(stmt.test, "True"))
                nxt = block[i + 1] if i + 1 < len(block) else None
                if (nxt is not None and own and _own_lines(nxt, source) and nxt.lineno == stmt.end_lineno + 1
                        and not isinstance(stmt, ast.Return) and not isinstance(nxt, ast.Return)):  # fmt: skip
                    add("shuffle_statements", name, stmt, source.swap_lines(stmt, nxt))
    return found
