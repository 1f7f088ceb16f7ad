"""SWE evaluation in a fresh, staged sandbox: apply the patch, add the hidden tests, run them, grade with swebench.

The patch goes through the chain SWE-bench's harness uses, each try on a clean tree: ``git apply -v``, then
``git apply -v --3way``, then ``patch --batch --forward --fuzz=5 -p1``. The files ``test_patch`` touches are put
back to the base (the agent may have edited or deleted them) and ``test_patch`` applied; a row that carries its own
SWE-bench eval script runs that as is instead (it applies ``test_patch`` itself; the row's ``base_commit`` in it
names the staged base, whose history is squashed into one commit). Tests write stdout and stderr to one
log, between swebench's start/end markers, with the test command's exit code after them.

Grading is swebench's own (``swebench.harness``, 5.x): the row's log parser from ``PARSER_REGISTRY``,
``get_logs_eval``, ``get_eval_tests_report`` and ``get_resolution_status``. R2E-Gym rows are resolved only when
the parsed test map equals their expected one.
"""

from __future__ import annotations

import shlex
import tempfile
from typing import Any

from pydantic import BaseModel
from swebench.harness.constants import (
    APPLY_PATCH_FAIL,
    APPLY_PATCH_PASS,
    END_TEST_OUTPUT,
    FAIL_TO_PASS,
    PASS_TO_PASS,
    START_TEST_OUTPUT,
    TEST_EXIT_CODE,
    ResolvedStatus,
)
from swebench.harness.grading import get_eval_tests_report, get_logs_eval, get_resolution_status
from swebench.harness.log_parsers import PARSER_REGISTRY
from swebench.types import TestSpec

from nemo_gym_prorl.envs.base import Evaluation
from nemo_gym_prorl.envs.swe.rows import SweRow
from nemo_gym_prorl.sandbox import Sandbox

_LOG = ".prorl-eval.log"
_MODEL_PATCH, _TEST_PATCH = ".prorl-model.patch", ".prorl-test.patch"

_APPLY = f"""set -u
cd "$1" && shift
mkdir -p /tmp/prorl-eval && mv {_MODEL_PATCH} {_TEST_PATCH} /tmp/prorl-eval/
clean() {{ git reset -q --hard && git clean -fdq; }}
if [ -s /tmp/prorl-eval/{_MODEL_PATCH} ]; then
  p=/tmp/prorl-eval/{_MODEL_PATCH}
  if git apply -v "$p"; then echo "{APPLY_PATCH_PASS} (git apply)"
  elif clean && git apply -v --3way "$p"; then echo "{APPLY_PATCH_PASS} (git apply --3way)"
  elif clean && patch --batch --forward --fuzz=5 -p1 -i "$p"; then echo "{APPLY_PATCH_PASS} (patch --fuzz=5)"
  else clean; echo "{APPLY_PATCH_FAIL}"; exit 10
  fi
fi
mode=$1 && shift
for f in "$@"; do
  if git cat-file -e "HEAD:$f" 2>/dev/null; then git checkout -q HEAD -- "$f"; else rm -rf -- "$f"; fi
done
if [ "$mode" = own-tests ] && [ -s /tmp/prorl-eval/{_TEST_PATCH} ]; then
  git apply -v /tmp/prorl-eval/{_TEST_PATCH} || {{ echo "test_patch does not apply to the base"; exit 11; }}
fi
"""


class GradeSettings(BaseModel):
    workdir: str
    test_command: str
    test_timeout_s: float
    apply_timeout_s: float
    partial_reward: bool


def eval_script(row: SweRow, test_command: str, workdir: str, base: str) -> str:
    """The bash the test run executes in `workdir`, its output all in one log."""
    if row.eval_script is not None:  # SWE-bench's own eval script (it applies test_patch and prints the markers)
        body = "\n".join(row.eval_script)
        body = body.replace(row.base_commit, base) if row.base_commit else body
    else:
        command = (row.test_command or test_command).format(
            **{k: v for k, v in row.fields.items() if isinstance(v, str)} | {"test_files": " ".join(row.test_files)}
        )
        body = (f"echo '{START_TEST_OUTPUT}'\n{command}\ncode=$?\necho '{END_TEST_OUTPUT}'\n"
                f"echo '{TEST_EXIT_CODE}: '$code")  # fmt: skip
    return f"cd {shlex.quote(workdir)}\n{{\n{body}\n}} > {shlex.quote(f'{workdir}/{_LOG}')} 2>&1\n"


async def evaluate(sandbox: Sandbox, row: SweRow, patch: str, base: str, settings: GradeSettings) -> Evaluation:
    """Grade `patch` in `sandbox`, a fresh one with the base commit `base` staged in `settings.workdir`."""
    await sandbox.write_file(_MODEL_PATCH, patch.encode())
    await sandbox.write_file(_TEST_PATCH, row.test_patch.encode())
    mode = "own-tests" if row.eval_script is None else "script"
    argv = ["bash", "-c", _APPLY, "prorl", settings.workdir, mode, *row.test_files]
    applied = await sandbox.exec(argv, timeout=settings.apply_timeout_s)
    apply_log = applied.output
    how = next((line.removeprefix(APPLY_PATCH_PASS).strip(" ()") for line in apply_log.splitlines()
                if line.startswith(APPLY_PATCH_PASS)), None)  # fmt: skip
    details: dict[str, Any] = {"patch_applied": how is not None or not patch.strip(), "apply": how}
    if applied.exit_code == 10 or applied.timed_out:
        return _zero(details | {"patch_applied": False}, "the patch does not apply", apply_log)
    if applied.exit_code == 11:
        return _zero(details, "the row's test_patch does not apply", apply_log)
    if applied.exit_code != 0:
        raise RuntimeError(f"preparing the evaluation failed (exit {applied.exit_code}): {apply_log[-2000:]}")

    script = eval_script(row, settings.test_command, settings.workdir, base)
    run = await sandbox.exec(["bash", "-c", script], timeout=settings.test_timeout_s)
    if run.timed_out:
        return _zero(details, f"the tests ran past their time limit of {settings.test_timeout_s:g} s", "")
    log = (await sandbox.read_file(_LOG)).decode(errors="replace")
    return grade_log(row, log, details, settings.partial_reward)


def grade_log(row: SweRow, log: str, details: dict[str, Any], partial_reward: bool) -> Evaluation:
    """swebench's verdict on a test log."""
    if row.log_parser not in PARSER_REGISTRY:
        raise ValueError(f"row {row.instance_id}: unknown log_parser {row.log_parser!r}")
    spec = TestSpec(instance_id=row.instance_id, image="", eval_script_list=[], repo=row.repo, version=row.version,
                    FAIL_TO_PASS=row.FAIL_TO_PASS, PASS_TO_PASS=row.PASS_TO_PASS, log_parser=row.log_parser)  # fmt: skip
    with tempfile.NamedTemporaryFile("w", suffix=".log") as f:
        f.write(log)
        f.flush()
        status_map, ok = get_logs_eval(spec, f.name)
    if not ok:
        return _zero(details, "the test run gave no usable results", log)
    if row.expected_status is not None:
        return _grade_exact(row, status_map, details)
    report = get_eval_tests_report(status_map, {FAIL_TO_PASS: row.FAIL_TO_PASS, PASS_TO_PASS: row.PASS_TO_PASS})
    status = get_resolution_status(report)
    f2p, p2p = report[FAIL_TO_PASS], report[PASS_TO_PASS]
    resolved = status == ResolvedStatus.FULL.value
    reward = 1.0 if resolved else 0.0
    if partial_reward and not resolved and not p2p["failure"] and row.FAIL_TO_PASS:
        reward = len(f2p["success"]) / len(row.FAIL_TO_PASS)
    failing = f2p["failure"] + p2p["failure"]
    reason = "resolved" if resolved else f"{len(failing)} test(s) fail: {', '.join(failing[:10])}"
    return Evaluation(
        reward=reward,
        resolved=resolved,
        details=details | {
            "reason": reason,
            "resolution": status,
            "fail_to_pass": f"{len(f2p['success'])}/{len(row.FAIL_TO_PASS)}",
            "pass_to_pass": f"{len(p2p['success'])}/{len(row.PASS_TO_PASS)}",
            "failing_tests": failing,
        },
    )


def _grade_exact(row: SweRow, status_map: dict[str, str], details: dict[str, Any]) -> Evaluation:
    expected = row.expected_status or {}
    differ = sorted(k for k in expected.keys() | status_map.keys() if expected.get(k) != status_map.get(k))
    resolved = not differ
    reason = "resolved" if resolved else f"{len(differ)} test(s) differ from the expected map: {', '.join(differ[:10])}"
    return Evaluation(reward=float(resolved), resolved=resolved,
                      details=details | {"reason": reason, "failing_tests": differ})  # fmt: skip


def _zero(details: dict[str, Any], reason: str, log: str) -> Evaluation:
    return Evaluation(reward=0.0, resolved=False, details=details | {"reason": reason, "log_tail": log[-2000:]})
