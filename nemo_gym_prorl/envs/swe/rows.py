"""SWE rows: SWE-bench's format, and adapters for SWE-Gym and R2E-Gym rows, checked before any sandbox starts.

A row is SWE-bench's (``instance_id, repo, base_commit, problem_statement, FAIL_TO_PASS, PASS_TO_PASS, patch,
test_patch, version``; F2P/P2P as JSON strings or lists) plus what evaluation needs and SWE-bench rows leave to a
harness: the test command (``test_command``, else the task's template), the log parser (``log_parser``, a name in
swebench's ``PARSER_REGISTRY``) and where the repository comes from (``repo_source``, see ``swe_repo``).

- SWE-Gym rows are SWE-bench rows (its images are named differently: see ``swe_images``).
- R2E-Gym rows carry ``docker_image``, ``repo_name``, ``commit_hash`` and ``expected_output_json`` (the test map a
  correct fix produces): they are graded as R2E-Gym grades, resolved only if the parsed test map equals it exactly.
- NeMo Gym's swebench rows are SWE-bench rows with ``responses_create_params`` (and other keys) beside them.

A missing or malformed field is a ``SweRowError`` naming the row and the field.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, Field

RowFormat = Literal["auto", "swebench", "swegym", "r2egym"]

_SWEBENCH_REQUIRED = ("instance_id", "repo", "base_commit", "problem_statement", "FAIL_TO_PASS", "PASS_TO_PASS",
                      "patch", "test_patch", "version")  # fmt: skip
_R2E_REQUIRED = ("docker_image", "problem_statement", "expected_output_json")


class SweRowError(ValueError):
    """A row the SWE environment cannot use; the message names the row and the field."""


class SweRow(BaseModel):
    """One SWE instance, whatever format it came in."""

    instance_id: str
    repo: str
    base_commit: str
    problem_statement: str
    FAIL_TO_PASS: list[str]
    PASS_TO_PASS: list[str]
    patch: str = Field(description="the gold patch")
    test_patch: str = Field(description="the hidden tests, applied only at evaluation")
    version: str = ""
    repo_source: str | None = Field(None, description="where the repository comes from; None: /testbed in the image")
    base_patch: str = Field("", description="applied to the source's tree before the base is committed")
    test_command: str | None = None
    eval_script: list[str] | None = Field(None, description="SWE-bench harness lines run before the test command")
    log_parser: str = "parse_log_pytest_v2"
    docker_image: str | None = None
    expected_status: dict[str, str] | None = Field(None, description="R2E-Gym: the exact test map of a correct fix")
    fields: dict[str, Any] = Field(default_factory=dict, description="the row as given (templates read it)")

    @property
    def test_files(self) -> list[str]:
        """The files the hidden tests touch (``diff --git a/X b/Y`` headers of ``test_patch``)."""
        return patch_files(self.test_patch)

    @property
    def hidden_test_files(self) -> list[str]:
        """The files ``test_patch`` creates: absent from the staged base, whatever the source tree holds."""
        return patch_files(self.test_patch, created_only=True)


def patch_files(patch: str, created_only: bool = False) -> list[str]:
    """The files a git diff touches (`created_only`: those it creates, ``new file mode``), in order."""
    files: list[str] = []
    path = None
    for line in patch.splitlines():
        if line.startswith("diff --git "):
            path = line.split(" b/", 1)[-1].strip()
            if not created_only and path not in files:
                files.append(path)
        elif created_only and path is not None and line.startswith("new file mode") and path not in files:
            files.append(path)
    return files


def _test_list(row_id: str, name: str, value: Any) -> list[str]:
    if isinstance(value, str):
        try:
            value = json.loads(value) if value.strip() else []
        except json.JSONDecodeError as e:
            raise SweRowError(f"row {row_id}: field {name!r} is not a JSON list of test ids ({e})") from None
    if not isinstance(value, list) or not all(isinstance(t, str) for t in value):
        raise SweRowError(f"row {row_id}: field {name!r} must be a list of test ids (or a JSON string of one)")
    return value


def _require(row_id: str, data: dict[str, Any], names: tuple[str, ...]) -> None:
    for name in names:
        if data.get(name) is None:
            raise SweRowError(f"row {row_id}: missing field {name!r}")


def detect_format(data: dict[str, Any]) -> RowFormat:
    return "r2egym" if "expected_output_json" in data or "docker_image" in data else "swebench"


def parse_row(data: dict[str, Any], row_id: str, row_format: RowFormat = "auto") -> SweRow:
    """`data` (one dataset row) as a SweRow; `row_id` names it in errors (the instance id or the row index)."""
    row_id = str(data.get("instance_id") or row_id)
    kind = detect_format(data) if row_format == "auto" else row_format
    if kind == "r2egym":
        return _r2egym_row(data, row_id)
    _require(row_id, data, _SWEBENCH_REQUIRED)
    return _build(
        data,
        row_id,
        instance_id=str(data["instance_id"]),
        repo=str(data["repo"]),
        base_commit=str(data["base_commit"]),
        FAIL_TO_PASS=_test_list(row_id, "FAIL_TO_PASS", data["FAIL_TO_PASS"]),
        PASS_TO_PASS=_test_list(row_id, "PASS_TO_PASS", data["PASS_TO_PASS"]),
        patch=str(data["patch"]),
        test_patch=str(data["test_patch"]),
        version=str(data["version"]),
    )


def _r2egym_row(data: dict[str, Any], row_id: str) -> SweRow:
    """R2E-Gym: no F2P/P2P lists; the expected test map decides, and every test in it is run."""
    _require(row_id, data, _R2E_REQUIRED)
    expected = data["expected_output_json"]
    if isinstance(expected, str):
        try:
            expected = json.loads(expected)
        except json.JSONDecodeError as e:
            raise SweRowError(f"row {row_id}: field 'expected_output_json' is not JSON ({e})") from None
    if not isinstance(expected, dict):
        raise SweRowError(f"row {row_id}: field 'expected_output_json' must map test names to statuses")
    expected = {str(k): str(v) for k, v in expected.items()}
    passing = [t for t, s in expected.items() if s in ("PASSED", "XFAIL")]
    return _build(
        data,
        row_id,
        instance_id=row_id,
        repo=str(data.get("repo_name") or data.get("repo") or ""),
        base_commit=str(data.get("commit_hash") or data.get("base_commit") or ""),
        FAIL_TO_PASS=passing,
        PASS_TO_PASS=[],
        patch=str(data.get("patch") or ""),
        test_patch=str(data.get("test_patch") or ""),
        docker_image=str(data["docker_image"]),
        expected_status=expected,
        test_command=data.get("test_command") or "bash run_tests.sh",
    )


def _build(data: dict[str, Any], row_id: str, **values: Any) -> SweRow:
    optional = {}
    for name in ("repo_source", "base_patch", "test_command", "log_parser", "docker_image"):
        if data.get(name) is not None and name not in values:
            if not isinstance(data[name], str):
                raise SweRowError(f"row {row_id}: field {name!r} must be a string")
            optional[name] = data[name]
    script = data.get("eval_script")
    if script is not None:
        if isinstance(script, str):
            script = script.splitlines()
        if not isinstance(script, list) or not all(isinstance(line, str) for line in script):
            raise SweRowError(f"row {row_id}: field 'eval_script' must be a script or a list of lines")
        optional["eval_script"] = script
    values = {k: v for k, v in values.items() if v is not None}
    return SweRow(problem_statement=str(data["problem_statement"]), fields=dict(data), **optional, **values)
