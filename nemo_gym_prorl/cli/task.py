"""`prorl task show|check NAME|FILE`: a task as it loads, and its grader tried on answers of known grade.

`show` prints what a run would use (the data and its splits, tools, limits, the verifier settings with their
defaults, one rendered first prompt), so a task file is read the way the package reads it. `check` grades each
row's gold answer (must score 1) and empty or wrong answers (must score 0) with the task's own grader, and lists
the rows where the grade differs: a grader or gold that is wrong trains a policy on the wrong signal.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from typing import Any

import yaml

from nemo_gym_prorl.contracts.task import TaskConfig, load_task

SANDBOXES = ("bwrap", "apptainer")


def task_command(args: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="prorl task", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="subcommand", required=True)
    show = sub.add_parser("show", help="the task as loaded: data, tools, limits, verifier settings, a first prompt")
    show.add_argument("task", help="a task name (math/arithmetic) or the path of a task YAML")
    check = sub.add_parser("check", help="grade every row's gold answer (1) and empty or wrong answers (0)")
    check.add_argument("task", help="a task name (math/arithmetic) or the path of a task YAML")
    check.add_argument("--limit", type=int, default=None, help="the first N rows of each dataset file")
    check.add_argument("--jobs", type=int, default=2, help="rows graded at once")
    check.add_argument("--sandbox", choices=SANDBOXES, default="bwrap", help="where tasks that grade in one do")
    options = parser.parse_args(args)
    task = load_task(options.task)
    if options.subcommand == "show":
        show_task(task)
    else:
        raise SystemExit(check_task(task, options.sandbox, options.limit, options.jobs))


def show_task(task: TaskConfig) -> None:
    from nemo_gym_prorl.envs import make_environment
    from nemo_gym_prorl.envs.task_check import check_rows, dataset_files

    env = make_environment(task, "bwrap")
    instances = check_rows(env)
    files = ", ".join(str(f) for f in dataset_files(env))
    print(f"task {task.name} ({task.origin}), type {task.type}")
    print(f"dataset: {len(instances)} rows in {files}; {_splits(task)}")
    print(f"tools: {', '.join(task.tools) or 'none'}; call format: {task.tool_call_format or 'the model default'}; "
          f"at most {task.max_turns} turns, {task.tool_timeout_s:g} s per tool call")  # fmt: skip
    print("limits: " + ", ".join(f"{k}={v}" for k, v in task.limits.model_dump().items()))
    print("verifier (defaults filled in):")
    print(_indented(yaml.safe_dump(env.settings.model_dump(mode="json"), sort_keys=False).rstrip() or "{}"))
    first = instances[0]
    print(f"first prompt of row {first.instance_id!r}:")
    for message in env.prompt_messages(first):
        print(_indented(f"[{message['role']}] {message['content']}"))


def check_task(task: TaskConfig, sandbox: str, limit: int | None, jobs: int) -> int:
    """Exit status: 0 when every probe of every row graded as known, 1 when any did not, 2 when nothing could be
    probed (the task's rows carry no gold answer, e.g. a Gym server's task)."""
    from nemo_gym_prorl.envs import make_environment
    from nemo_gym_prorl.envs.task_check import ProbeFailure, check_rows, probe_rows

    env = make_environment(task, sandbox)
    instances = check_rows(env)[:limit]
    if not any(env.probes(i) for i in instances):
        print(f"prorl task check: {task.name}: its rows carry no answer of known grade to submit "
              "(a Gym task is checked with Gym's own `ng_test`)", file=sys.stderr)  # fmt: skip
        return 2
    started, done = time.perf_counter(), 0

    def progress(instance: Any, failures: list[ProbeFailure]) -> None:
        nonlocal done
        done += 1
        verdict = "ok" if not failures else "FAILS " + "; ".join(_failure_line(f) for f in failures)
        print(f"[{done}/{len(instances)}] {instance.instance_id}: {verdict}", flush=True)

    async def run() -> list[ProbeFailure]:
        try:
            return await probe_rows(env, instances, jobs, progress)
        finally:
            await env.aclose()

    failures = asyncio.run(run())
    failing = sorted({f.instance_id for f in failures})
    print(f"prorl task check: {task.name}: {len(instances) - len(failing)} of {len(instances)} rows grade as known "
          f"({time.perf_counter() - started:.1f} s)")  # fmt: skip
    if failing:
        print(f"failing rows: {', '.join(failing)}")
    return 1 if failing else 0


def _failure_line(failure: Any) -> str:
    got = "an error" if failure.got is None else f"{failure.got:g}"
    return f"{failure.probe} scored {got}, expected {failure.expected:g} ({failure.reason})"


def _splits(task: TaskConfig) -> str:
    from nemo_gym_prorl.gym.data_export import ExportUsageError, split_instances

    try:
        train = len(split_instances(task, "train"))
        validation = len(split_instances(task, "validation"))
    except ExportUsageError as e:
        return f"no validation split ({e})"
    return f"train {train}, validation {validation}"


def _indented(text: str) -> str:
    return "\n".join("  " + line for line in text.splitlines())

