"""Grading programs in a sandbox: run them there with `sandbox_runner.py`, judge what came back here.

One grading sandbox runs a batch of submissions (a rollout's one, with those of the rollouts graded at the same time
when they queue for a sandbox: `coalesce.py`; many for a benchmark or a test): the runner
and a job file go into its workspace, one runner process works through the batch (each test a child of its own,
each problem's leftovers killed before the next), and its results file comes back. The sandbox is fresh (never
the rollout's own, where the agent may have left anything) and closed at the end, whatever happened. Expected
outputs stay here; only inputs go in.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import weakref
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from nemo_gym_prorl.envs.base import Evaluation
from nemo_gym_prorl.envs.code.cases import CodeProblem, output_lines, output_mismatch, value_mismatch
from nemo_gym_prorl.envs.code.coalesce import Coalescer
from nemo_gym_prorl.sandbox import SandboxLimits, SandboxSpec, open_sandbox

RUNNER = Path(__file__).with_name("sandbox_runner.py")
_GRADER_DIR = ".grader"

# What LiveCodeBench (and so NeMo Gym's code_gen) puts in scope before a stdin or call-based program: LeetCode
# signatures use typing names without importing them, and deep recursion is common in contest solutions.
PRELUDE = (
    "import sys, math, heapq, bisect, itertools, functools, collections, string, re, copy, operator, random\n"
    "from typing import *\nfrom collections import *\nfrom itertools import *\nfrom functools import *\n"
    "from heapq import *\nfrom bisect import *\nfrom math import *\n"
    "sys.setrecursionlimit(50000)\nsys.set_int_max_str_digits(0)\n"
)

_UNITTEST_FAILED = re.compile(r"^\d+ of \d+ tests failed: ")  # the runner's last line when unittest tests failed
TestStatus = Literal["passed", "wrong_answer", "timeout", "runtime_error", "output_limit", "killed", "not_run"]


class GradingSettings(BaseModel):
    """A task's `verifier:` settings for code."""

    model_config = ConfigDict(extra="forbid")

    timeout_s: float = Field(6.0, gt=0, description="wall-clock limit per test")
    output_cap_bytes: int = Field(8 << 20, gt=0, description="largest stdout a test may write")
    partial_reward: bool = Field(False, description="reward = fraction of tests passed (default: 1.0 all-pass)")
    sandboxes: int = Field(default_factory=lambda: os.cpu_count() or 1, ge=1,
                           description="grading sandboxes at once; gradings that queue share the next one")
    batch_programs: int = Field(16, ge=1, description="most programs of queued gradings one sandbox runs")


class TestOutcome(BaseModel):
    index: int
    status: TestStatus
    detail: str = ""
    time_s: float = 0.0


def _read_results(text: str, ids: list[str]) -> list[list[dict[str, Any]]]:
    """The results the grader trusts: those of the problems before the first one without a line. The runner works
    through the problems in order and writes each line after killing what the problem left, so a line for a later
    problem can only be a forgery by a problem that then killed the runner (the last line for an id wins)."""
    by_id: dict[str, list[dict[str, Any]]] = {}
    for line in text.splitlines():
        try:
            record = json.loads(line)
            by_id[str(record["id"])] = record["results"]
        except (ValueError, KeyError, TypeError):
            continue
    trusted = []
    for problem_id in ids:
        if problem_id not in by_id:
            break
        trusted.append(by_id[problem_id])
    return trusted


async def _run_batch(
    problems: list[dict[str, Any]], settings: GradingSettings, sandbox_backend: str, limits: SandboxLimits,
    image: str | None,
) -> tuple[list[list[dict[str, Any]]], str]:
    job = {
        "problems": problems,
        "timeout_s": settings.timeout_s,
        "output_cap_bytes": settings.output_cap_bytes,
        "prelude": PRELUDE,
        "stop_on_failure": not settings.partial_reward,
    }
    budget = sum(max(1, len(p["inputs"])) for p in problems) * (settings.timeout_s + 0.5) + 15.0
    limits = limits.model_copy(update={"wall_clock_s": budget + 30})
    async with open_sandbox(sandbox_backend, SandboxSpec(image=image, limits=limits, network=False)) as sandbox:
        await sandbox.write_file(f"{_GRADER_DIR}/runner.py", RUNNER.read_bytes())
        await sandbox.write_file(f"{_GRADER_DIR}/job.json", json.dumps(job).encode())
        ran = await sandbox.run(
            f"PRORL_GRADING_SANDBOX=1 python3 -I {_GRADER_DIR}/runner.py {_GRADER_DIR}/job.json "
            f"{_GRADER_DIR}/results.jsonl; echo \"[test runner exit status $?]\"",
            timeout=budget,
        )
        try:
            text = (await sandbox.read_file(f"{_GRADER_DIR}/results.jsonl")).decode(errors="replace")
        except (OSError, ValueError):
            text = ""
    note = ran.output[-2000:] + ("\n[the test runner timed out]" if ran.timed_out else "")
    return _read_results(text, [p["id"] for p in problems]), note


async def run_in_sandbox(
    submissions: list[tuple[CodeProblem, str]],
    settings: GradingSettings,
    *,
    sandbox_backend: str = "bwrap",
    limits: SandboxLimits | None = None,
    image: str | None = None,
) -> list[tuple[list[dict[str, Any]] | None, str]]:
    """Raw runner results per submission (None where the runner gave none) and the runner's last words. A
    submission that kills the runner gets None; those after it run again in a fresh sandbox. `image`: the sandbox's
    root (a rootfs directory, a SIF), None for the backend's default."""
    problems = [
        {
            "id": str(i),
            "kind": problem.kind,
            "program": problem.program(code),
            "inputs": problem.inputs,
            "fn_name": problem.fn_name,
            "test": problem.test,
            "entry_point": problem.entry_point,
            "line_counts": [len(output_lines(out)) for out in problem.outputs] if problem.kind == "stdin" else [],
        }
        for i, (problem, code) in enumerate(submissions)
    ]
    out: list[tuple[list[dict[str, Any]] | None, str]] = []
    while problems:
        trusted, note = await _run_batch(problems, settings, sandbox_backend, limits or SandboxLimits(), image)
        out.extend((results, "") for results in trusted)
        if len(trusted) < len(problems):
            out.append((None, note))  # the problem the runner died on
        problems = problems[len(trusted) + 1 :]
    return out


def _judge_test(problem: CodeProblem, index: int, raw: dict[str, Any]) -> TestOutcome:
    status, time_s = raw["status"], raw.get("time_s", 0.0)
    if status == "ok":
        if problem.kind in ("humaneval", "bigcodebench"):
            return TestOutcome(index=index, status="passed", time_s=time_s)
        expected = problem.outputs[index]
        why = (
            value_mismatch(expected, raw.get("return_json"))
            if problem.kind == "call"
            else output_mismatch(expected, raw.get("output", ""))
        )
        if why is None:
            return TestOutcome(index=index, status="passed", time_s=time_s)
        return TestOutcome(index=index, status="wrong_answer", detail=why, time_s=time_s)
    tail = (raw.get("stderr") or "").strip()
    last_line = tail.splitlines()[-1] if tail else ""
    if problem.kind == "humaneval" and status == "runtime_error" and last_line == "AssertionError":
        return TestOutcome(index=index, status="wrong_answer", detail="an assertion of the tests failed: " + tail[-800:],
                           time_s=time_s)
    if problem.kind == "bigcodebench" and status == "runtime_error" and _UNITTEST_FAILED.match(last_line):
        failures = tail.removesuffix(last_line).strip()
        return TestOutcome(index=index, status="wrong_answer", detail=f"{last_line}\n{failures[:800]}", time_s=time_s)
    detail = {
        "timeout": "time limit exceeded",
        "output_limit": "output limit exceeded",
        "killed": f"killed by signal {raw.get('signal')}",
        "runtime_error": f"exit code {raw.get('exit_code')}",
    }[status]
    if tail:
        detail += ": " + tail[-800:]
    return TestOutcome(index=index, status=status, detail=detail, time_s=time_s)


def judge(
    problem: CodeProblem, raw: list[dict[str, Any]] | None, settings: GradingSettings, runner_note: str = ""
) -> Evaluation:
    """The reward and the diagnostics: which test failed first and how, counts, the time the tests took."""
    n_tests = max(1, len(problem.inputs))
    if raw is None:
        return Evaluation(
            reward=0.0,
            resolved=False,
            details={"reason": "the test runner gave no result (killed by the program?)", "runner": runner_note,
                     "tests": n_tests, "passed": 0},
        )
    outcomes = [_judge_test(problem, i, r) for i, r in enumerate(raw)]
    passed = sum(o.status == "passed" for o in outcomes)
    resolved = passed == n_tests
    first_failure = next((o for o in outcomes if o.status != "passed"), None)
    reward = 1.0 if resolved else (passed / n_tests if settings.partial_reward else 0.0)
    details: dict[str, Any] = {
        "reason": "all tests passed" if resolved else (first_failure.status if first_failure else "not_run"),
        "tests": n_tests,
        "passed": passed,
        "run": len(outcomes),
        "time_s": round(sum(o.time_s for o in outcomes), 4),
    }
    if first_failure is not None:
        details["failed_test"] = first_failure.index
        details["failure"] = first_failure.detail
    return Evaluation(reward=reward, resolved=resolved, details=details)


_COALESCERS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[str, Coalescer]] = weakref.WeakKeyDictionary()


def _coalescer(settings: GradingSettings, sandbox_backend: str, limits: SandboxLimits | None,
               image: str | None) -> Coalescer:
    """The queue of gradings that may share a sandbox: same settings, backend, limits and image, same loop."""
    key = json.dumps([settings.model_dump(), sandbox_backend, limits.model_dump() if limits else None, image])
    by_key = _COALESCERS.setdefault(asyncio.get_running_loop(), {})
    if key not in by_key:
        async def batch(submissions: list[tuple[CodeProblem, str]]) -> list[tuple[list | None, str, int]]:
            raw = await run_in_sandbox(submissions, settings, sandbox_backend=sandbox_backend, limits=limits,
                                       image=image)
            return [(result, note, len(submissions)) for result, note in raw]

        by_key[key] = Coalescer(batch, slots=settings.sandboxes, max_items=settings.batch_programs)
    return by_key[key]


async def grade_programs(
    submissions: list[tuple[CodeProblem, str | None]],
    settings: GradingSettings,
    *,
    sandbox_backend: str = "bwrap",
    limits: SandboxLimits | None = None,
    image: str | None = None,
) -> list[Evaluation]:
    """Grade each (problem, code) pair; a None or empty code scores 0 without running anything."""
    runnable = [(i, p, c) for i, (p, c) in enumerate(submissions) if c and c.strip()]
    evaluations: list[Evaluation | None] = [
        None if code and code.strip() else Evaluation(reward=0.0, resolved=False, details={"reason": "no code"})
        for _, code in submissions
    ]
    if runnable:
        coalescer = _coalescer(settings, sandbox_backend, limits, image)
        raw = await coalescer.run([(p, c) for _, p, c in runnable])
        for (i, problem, _), (result, note, shared) in zip(runnable, raw):
            evaluations[i] = judge(problem, result, settings, note)
            evaluations[i].details["sandbox_programs"] = shared
    return [e for e in evaluations if e is not None]


async def grade_program(problem: CodeProblem, code: str | None, settings: GradingSettings, **kw: Any) -> Evaluation:
    return (await grade_programs([(problem, code)], settings, **kw))[0]


__all__ = ["GradingSettings", "TestOutcome", "grade_program", "grade_programs", "judge", "run_in_sandbox"]
