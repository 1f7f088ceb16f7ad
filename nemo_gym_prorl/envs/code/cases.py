"""Code problems and their tests, as rows carry them, and how a program's output is judged against them.

LiveCodeBench's rows (NeMo Gym's ``code_gen``): ``verifier_metadata.unit_tests = {inputs, outputs, fn_name?}`` (or
``{packed, fn_name?}``: that JSON zlib-compressed, base64-encoded); no ``fn_name``: a program reading stdin and
writing stdout; a ``fn_name``: a function called with the JSON values on each line of an input (a method of
``Solution()`` when the program defines ``class Solution``). HumanEval's: ``prompt``, ``entry_point`` and ``test``
holding ``check(candidate)``. BigCodeBench's (Gym's ``bigcodebench``): ``verifier_metadata = {code_prompt,
entry_point, test}``, ``test`` a unittest ``TestCases`` that must run without a failure or an error on the row's
``code_prompt``, a ``pass`` closing that stub, then the code (as Gym and BigCodeBench's ``calibrated`` run it).

Judging (LiveCodeBench's rules, as Gym applies them). Program output: both texts stripped, split into lines, each
stripped; as many lines, each pair agreeing: the same text, or the same yes/no in any case, or the same numbers
token by token, where a token written with a decimal point or an exponent may differ by 1e-6 absolute or relative.
A returned value: equal to the expected JSON value (a tuple counting as a list), or, where floats are involved,
close by ``math.isclose`` (rel 1e-9, abs 1e-8: numpy.allclose's defaults), element by element for a flat list.
"""

from __future__ import annotations

import base64
import json
import math
import re
import zlib
from decimal import Decimal, InvalidOperation
from typing import Any, Literal

from pydantic import BaseModel, Field, ValidationError

ProblemKind = Literal["stdin", "call", "humaneval", "bigcodebench"]
FLOAT_TOLERANCE = Decimal("1e-6")


class CodeProblem(BaseModel):
    """What a submitted program is tested against."""

    kind: ProblemKind
    inputs: list[str] = Field(default_factory=list, description="stdin texts, or JSON arguments one per line")
    outputs: list[str] = Field(default_factory=list, description="expected stdout texts, or JSON return values")
    fn_name: str | None = None
    prompt: str = ""
    test: str = ""
    entry_point: str = ""

    def program(self, code: str) -> str:
        """The program to run: for HumanEval, the prompt (imports, helpers, signature) and then the code, which
        either continues the prompt's function (a body) or defines it again; for BigCodeBench, its code prompt
        calibrated as Gym does (the stub closed with ``pass``, so the entry point exists whatever the code holds)."""
        if self.kind == "bigcodebench":
            return self.prompt + "\n    pass\n" + code
        if self.kind != "humaneval":
            return code
        body = code if code[:1] in (" ", "\t") else "\n\n" + code
        return self.prompt + body + "\n"


class _UnitTests(BaseModel):
    inputs: list[str]
    outputs: list[str]
    fn_name: str | None = None


def unpack_unit_tests(raw: Any) -> _UnitTests:
    """LiveCodeBench unit tests, plain or packed (``{"packed": base64(zlib(json))}``)."""
    if isinstance(raw, str):
        raw = json.loads(raw)
    if isinstance(raw, dict) and "packed" in raw:
        decoded = json.loads(zlib.decompress(base64.b64decode(raw["packed"])))
        raw = {"inputs": decoded["inputs"], "outputs": decoded["outputs"], "fn_name": raw.get("fn_name")}
    return _UnitTests.model_validate(raw)


def problem_from_row(row: dict[str, Any]) -> CodeProblem:
    """The problem a dataset row holds; ValueError naming what is missing or malformed."""
    raw = (row.get("verifier_metadata") or {}).get("unit_tests", row.get("unit_tests"))
    if raw is not None:
        try:
            tests = unpack_unit_tests(raw)
        except (ValidationError, ValueError, TypeError, zlib.error, KeyError) as e:
            raise ValueError(f"unit_tests are malformed: {str(e)[:300]}") from None
        if len(tests.inputs) != len(tests.outputs) or not tests.inputs:
            raise ValueError(f"unit_tests need as many outputs as inputs (and at least one): "
                             f"{len(tests.inputs)} inputs, {len(tests.outputs)} outputs")
        kind: ProblemKind = "call" if tests.fn_name else "stdin"
        return CodeProblem(kind=kind, inputs=tests.inputs, outputs=tests.outputs, fn_name=tests.fn_name)
    metadata = row.get("verifier_metadata") or {}
    if isinstance(metadata, dict) and all(isinstance(metadata.get(k), str) for k in ("test", "entry_point")):
        return CodeProblem(kind="bigcodebench", prompt=str(metadata.get("code_prompt") or ""), test=metadata["test"],
                           entry_point=metadata["entry_point"])  # fmt: skip
    if all(isinstance(row.get(k), str) for k in ("prompt", "test", "entry_point")):
        return CodeProblem(kind="humaneval", prompt=row["prompt"], test=row["test"], entry_point=row["entry_point"])
    raise ValueError("the row has no tests: expected verifier_metadata.unit_tests (LiveCodeBench format), "
                     "verifier_metadata.test and entry_point (BigCodeBench) or HumanEval's prompt, test and "
                     "entry_point")


_FENCE = re.compile(r"```[^\n`]*\n(.*?)```", re.DOTALL)


def final_code_block(text: str) -> str | None:
    """The content of the last complete fenced code block in `text`, None when there is none."""
    blocks = _FENCE.findall(text)
    return blocks[-1] if blocks else None


# ------------------------------------------------------------------------------------------------ judging output
def output_lines(text: str) -> list[str]:
    """An output as the rules compare it: stripped, split into lines, each line stripped."""
    return [line.strip() for line in text.strip().split("\n")]


def _is_float_token(token: str) -> bool:
    return "." in token or "e" in token.lower()


def _numbers_agree(expected: str, got: str) -> bool:
    expected_tokens, got_tokens = expected.split(), got.split()
    if len(expected_tokens) != len(got_tokens):
        return False
    for e_tok, g_tok in zip(expected_tokens, got_tokens):
        try:
            e_val, g_val = Decimal(e_tok), Decimal(g_tok)
        except InvalidOperation:
            return False
        if e_val == g_val:
            continue
        if not (_is_float_token(e_tok) or _is_float_token(g_tok)) or not (e_val.is_finite() and g_val.is_finite()):
            return False
        error = abs(e_val - g_val)
        if error > FLOAT_TOLERANCE and error / max(abs(e_val), Decimal(1)) > FLOAT_TOLERANCE:
            return False
    return True


def output_mismatch(expected: str, got: str) -> str | None:
    """None when `got` is an accepted stdout for `expected`; otherwise why not, briefly."""
    want, got_lines = output_lines(expected), output_lines(got)
    if len(want) != len(got_lines):
        return f"{len(got_lines)} output lines, expected {len(want)}"
    for i, (e_line, g_line) in enumerate(zip(want, got_lines)):
        if e_line == g_line:
            continue
        if g_line.lower() in ("yes", "no") and g_line.lower() == e_line.lower():
            continue
        if _numbers_agree(e_line, g_line):
            continue
        return f"line {i + 1}: got {_clip(g_line)!r}, expected {_clip(e_line)!r}"
    return None


def _close(expected: Any, got: Any) -> bool:
    if isinstance(expected, bool) or isinstance(got, bool):
        return False
    if isinstance(expected, (int, float)) and isinstance(got, (int, float)):
        return (isinstance(expected, float) or isinstance(got, float)) and math.isclose(
            got, expected, rel_tol=1e-9, abs_tol=1e-8
        )
    return False


def value_mismatch(expected_json: str, returned_json: str | None) -> str | None:
    """None when the returned value (JSON) is accepted for the expected one; otherwise why not."""
    if returned_json is None:
        return "the function returned nothing the grader could read"
    expected = json.loads(expected_json)
    try:
        got = json.loads(returned_json)
    except json.JSONDecodeError:
        return f"returned a value that is not JSON: {_clip(returned_json)!r}"
    if got == expected or _close(expected, got):
        return None
    if isinstance(expected, list) and isinstance(got, list) and len(expected) == len(got):
        if all(e == g or _close(e, g) for e, g in zip(expected, got)):
            return None
    return f"returned {_clip(json.dumps(got))}, expected {_clip(expected_json)}"


def _clip(text: str, limit: int = 200) -> str:
    return text if len(text) <= limit else text[: limit // 2] + " ... " + text[-limit // 2 :]
