"""Our sandboxed code grading against NeMo Gym code_gen's own verifier (LiveCodeBench's check_correctness, run in
a process of its own as Gym's server runs it) on Gym's example rows and rollouts and on programs made from them,
and against the verdicts Gym's bigcodebench verifier gave its example rollouts. Prints the figures;
docs/code-and-stem.md states them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import resources_servers.bigcodebench as bigcodebench
import resources_servers.code_gen as code_gen

from nemo_gym_prorl.envs.code.cases import final_code_block, problem_from_row
from nemo_gym_prorl.envs.code.grading import GradingSettings, grade_programs

DATA = Path(code_gen.__path__[0]) / "data"
# Gym's verifier forks a multiprocessing Manager and a worker per program. Forked from the test process after the
# suite's earlier tests (their threads still in it), the Manager died at start in CI (EOFError); so it runs as in
# Gym's server, in an interpreter of its own, its server folder on sys.path (it imports lcb_integration from there).
GYMS_VERIFIER = """
import json, sys
sys.path.insert(0, sys.argv[1])
from lcb_integration.compute_code_generation_metrics import check_correctness
for case in map(json.loads, sys.stdin):
    results, _ = check_correctness({"input_output": json.dumps(case["unit_tests"])}, case["code"], 10, debug=False)
    print("verdict", json.dumps(all(r is True for r in results)), flush=True)
"""


def gyms_rewards(cases: list[tuple[str, dict, str]]) -> list[float]:
    lines = "".join(json.dumps({"unit_tests": row["verifier_metadata"]["unit_tests"], "code": code}) + "\n"
                    for _, row, code in cases)
    done = subprocess.run([sys.executable, "-c", GYMS_VERIFIER, code_gen.__path__[0]], input=lines,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    # only the verdict lines: a program under test prints too
    rewards = [1.0 if line == "verdict true" else 0.0 for line in done.stdout.splitlines() if line.startswith("verdict ")]
    assert len(rewards) == len(cases), done.stdout
    return rewards


def _prompt(row: dict) -> str:
    return row["responses_create_params"]["input"][0]["content"]


def _cases() -> list[tuple[str, dict, str]]:
    rows = {_prompt(row): row for row in map(json.loads, (DATA / "example.jsonl").read_text().splitlines())}
    cases = []
    for rollout in map(json.loads, (DATA / "example_rollouts.jsonl").read_text().splitlines()):
        row, code = rows[_prompt(rollout)], rollout["extracted_model_code"]
        cases.append(("rollout", row, code))
        if rollout["reward"] == 1.0:
            cases += [
                ("trailing spaces", row, code.replace("print(", "print(' ', end='')\nprint(", 1)),
                ("runtime error after output", row, code + "\nraise SystemError('late')\n"),
                ("wrong answer", row, code.replace("max_water", "max_water + 1", 1)),
                ("prints nothing", row, "pass"),
            ]
    return cases


async def test_agreement_with_gym_code_gen_verifier() -> None:
    cases = _cases()
    ours = await grade_programs([(problem_from_row(row), code) for _, row, code in cases], GradingSettings(timeout_s=10))
    disagreements = []
    for (what, _, _), evaluation, gyms in zip(cases, ours, gyms_rewards(cases)):
        if evaluation.reward != gyms:
            disagreements.append((what, evaluation.reward, gyms, evaluation.details))
    print(f"\ncode agreement with Gym's code_gen verifier: {len(cases) - len(disagreements)}/{len(cases)}")
    for what, mine, gyms, details in disagreements:
        print(f"  differs: {what}: ours {mine}, Gym {gyms} ({details.get('reason')})")
    assert not disagreements


async def test_agreement_with_gym_bigcodebench_verdicts(scientific_rootfs: Path) -> None:
    """Gym's bigcodebench verifier cannot run here: its server builds a Python 3.10 venv with uv and installs
    BigCodeBench's requirements from a URL. Its example rollouts carry the verdicts it gave (three pass, two fail
    on a test); ours grade the same model outputs, their code taken from the answer our way, in the scientific image."""
    folder = Path(bigcodebench.__path__[0]) / "data"
    rows = {row["verifier_metadata"]["task_id"]: row for row in map(json.loads, (folder / "example.jsonl").open())}
    rollouts = [json.loads(line) for line in (folder / "example_rollouts.jsonl").open()]
    submissions = [(problem_from_row(rows[r["task_id"]]), final_code_block(r["extracted_model_output"]))
                   for r in rollouts]  # fmt: skip
    ours = await grade_programs(submissions, GradingSettings(timeout_s=240), image=str(scientific_rootfs))
    differs = [(r["task_id"], e.reward, r["reward"], e.details)
               for r, e in zip(rollouts, ours) if e.reward != r["reward"]]  # fmt: skip
    print(f"\nbigcodebench agreement with Gym's verdicts: {len(rollouts) - len(differs)}/{len(rollouts)}")
    assert sorted(r["reward"] for r in rollouts) == [0.0, 0.0, 1.0, 1.0, 1.0] and not differs, differs
