"""Code grading throughput: ours, sandboxed, against NeMo Gym's code_gen verifier, unsandboxed, on the same rows.

Workload: NeMo Gym code_gen's shipped example rows with the programs of its shipped rollouts (LiveCodeBench
stdin/stdout tests, 1 to 100 per row), repeated ``--rounds`` times. Gym's side is its verifier's own grading
function, ``check_correctness`` (a multiprocessing Manager and Process per program, every test in that process,
model code executed on the host), called in ``--concurrency`` pool workers, as its server runs it in Ray
workers. Ours grades each program as a rollout's eval does (`envs.code.grading.grade_program`, all at once, as a
group's rollouts finish together) with as many grading sandboxes at once as Gym has workers; gradings that queue
share the next sandbox, at most ``--batch`` programs in one (``--batch 1``: a fresh sandbox per program). Gym and
ours alternate per round so both see the same machine. Every program's reward is checked to agree. The last line
is the ratio of graded programs per second, ours / Gym's (goal >= 1.0x).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import resources_servers.code_gen as code_gen

from nemo_gym_prorl.envs.code.cases import CodeProblem, problem_from_row
from nemo_gym_prorl.envs.code.grading import GradingSettings, grade_program

TIMEOUT_S = 10  # per test, code_gen's unit_test_timeout_secs


def workload() -> list[tuple[dict, CodeProblem, str]]:
    """(row, problem, program) for each of Gym's shipped code_gen rollouts."""
    data = Path(code_gen.__path__[0]) / "data"
    prompt = lambda row: row["responses_create_params"]["input"][0]["content"]  # noqa: E731
    rows = {prompt(row): row for row in map(json.loads, (data / "example.jsonl").read_text().splitlines())}
    out = []
    for rollout in map(json.loads, (data / "example_rollouts.jsonl").read_text().splitlines()):
        row = rows[prompt(rollout)]
        out.append((row, problem_from_row(row), rollout["extracted_model_code"]))
    return out


def _gym_grade(row: dict, program: str) -> float:
    """Gym's verifier on one program, in a pool worker (as its server runs it in a Ray worker)."""
    if code_gen.__path__[0] not in sys.path:
        sys.path.insert(0, code_gen.__path__[0])  # its lcb_integration package lives in its folder
    from lcb_integration.compute_code_generation_metrics import check_correctness

    sample = {"input_output": json.dumps(row["verifier_metadata"]["unit_tests"])}
    results, _ = check_correctness(sample, program, TIMEOUT_S, debug=False)
    return 1.0 if all(r is True for r in results) else 0.0


def _gym_round(pool: ProcessPoolExecutor, items: list[tuple[dict, CodeProblem, str]]) -> tuple[float, list[float]]:
    started = time.perf_counter()
    rewards = list(pool.map(_gym_grade, [row for row, _, _ in items], [program for _, _, program in items]))
    return time.perf_counter() - started, rewards


async def _our_round(items: list[tuple[dict, CodeProblem, str]], concurrency: int, batch: int) -> tuple[float, list[float]]:
    settings = GradingSettings(timeout_s=TIMEOUT_S, sandboxes=concurrency, batch_programs=batch)
    started = time.perf_counter()
    evaluations = await asyncio.gather(*(grade_program(problem, code, settings) for _, problem, code in items))
    return time.perf_counter() - started, [e.reward for e in evaluations]


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="prorl bench code", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="rounds, each grading every program once per side")
    parser.add_argument("--repeat", type=int, default=4, help="copies of the shipped programs in one round")
    parser.add_argument("--concurrency", type=int, default=2, help="programs graded at once, per side")
    parser.add_argument("--batch", type=int, default=16, help="most programs of queued gradings in one sandbox (ours)")
    args = parser.parse_args(argv)
    items = workload() * args.repeat
    gym_s = ours_s = 0.0
    context = multiprocessing.get_context("fork")  # its workers fork its test processes, as Ray workers do
    with ProcessPoolExecutor(args.concurrency, mp_context=context) as pool:
        _gym_round(pool, items[: args.concurrency])  # workers up and Gym's modules imported before timing
        for r in range(args.rounds):
            g_time, g_rewards = _gym_round(pool, items)
            o_time, o_rewards = asyncio.run(_our_round(items, args.concurrency, args.batch))
            if g_rewards != o_rewards:
                raise SystemExit(f"round {r}: rewards differ: Gym {g_rewards}, ours {o_rewards}")
            gym_s, ours_s = gym_s + g_time, ours_s + o_time
            print(f"round {r}: {len(items)} programs: Gym {len(items) / g_time:.2f}/s, ours {len(items) / o_time:.2f}/s")
    n = len(items) * args.rounds
    gym_rate, our_rate = n / gym_s, n / ours_s
    print(f"Gym code_gen (in-process, unsandboxed): {gym_rate:.2f} programs/s; ours (bwrap sandboxes, at most "
          f"{args.batch} programs in one): {our_rate:.2f} programs/s; rewards agree on all {n}")
    ratio = our_rate / gym_rate
    print(f"code grading: ours / Gym's graded programs per second = {ratio:.2f}x "
          f"(goal >= 1.0x: {'met' if ratio >= 1.0 else 'not met'})")
