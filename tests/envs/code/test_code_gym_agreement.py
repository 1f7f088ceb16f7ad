"""Our sandboxed code grading against NeMo Gym code_gen's own verifier (LiveCodeBench's check_correctness, run
in-process as Gym runs it) on Gym's example rows and rollouts and on programs made from them. Prints the figures;
docs/code-and-stem.md states them."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import resources_servers.code_gen as code_gen

from nemo_gym_prorl.envs.code.cases import problem_from_row
from nemo_gym_prorl.envs.code.grading import GradingSettings, grade_programs

DATA = Path(code_gen.__path__[0]) / "data"
# Gym's server imports its lcb_integration package from its own folder; that folder is on sys.path only while it is
# imported: it also holds a `tests` package, which would shadow ours for every test module collected after this one.
sys.path.insert(0, code_gen.__path__[0])
try:
    from lcb_integration.compute_code_generation_metrics import check_correctness
finally:
    sys.path.remove(code_gen.__path__[0])


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
    for (what, row, code), evaluation in zip(cases, ours):
        results, _ = check_correctness({"input_output": json.dumps(row["verifier_metadata"]["unit_tests"])}, code, 10,
                                       debug=False)
        gyms = 1.0 if all(r is True for r in results) else 0.0
        if evaluation.reward != gyms:
            disagreements.append((what, evaluation.reward, gyms, evaluation.details))
    print(f"\ncode agreement with Gym's code_gen verifier: {len(cases) - len(disagreements)}/{len(cases)}")
    for what, mine, gyms, details in disagreements:
        print(f"  differs: {what}: ours {mine}, Gym {gyms} ({details.get('reason')})")
    assert not disagreements
