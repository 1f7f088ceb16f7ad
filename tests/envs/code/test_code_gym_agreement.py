"""Our sandboxed code grading against NeMo Gym code_gen's own verifier (LiveCodeBench's check_correctness, run in
a process of its own as Gym's server runs it) on Gym's example rows and rollouts and on programs made from them,
and against the verdicts Gym's bigcodebench and evalplus verifiers gave their example rollouts. Prints the figures;
docs/code-and-stem.md states them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import resources_servers.bigcodebench as bigcodebench
import resources_servers.code_gen as code_gen
import resources_servers.evalplus as evalplus

from nemo_gym_prorl.contracts.task import load_task
from nemo_gym_prorl.envs.code.cases import final_code_block, problem_from_row
from nemo_gym_prorl.envs.code.grading import GradingSettings, grade_programs
from nemo_gym_prorl.envs.dataset import load_instances

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


def _evalplus_extraction():
    """evalplus's extract_code_strict, imported from Gym's server as its server imports it (the server folder on
    sys.path, for the package-less evalplus_integration its app.py imports)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(evalplus.__path__[0])
        from resources_servers.evalplus.app import extract_code_strict
    return extract_code_strict


def _drop_comment_lines(reply: str) -> str:
    return "\n".join(line for line in reply.split("\n") if not line.lstrip().startswith("#"))


# Replies made from each rollout's, where the two extractions may part: Gym's takes the last ```python block (a
# generic ``` one only when there is none), strict (a last python fence left open gives nothing), stripped.
EVALPLUS_REPLY_SHAPES = {
    "untagged fence": lambda reply: reply.replace("```python", "```"),
    "py tag": lambda reply: reply.replace("```python", "```py"),
    "usage block after the code": lambda reply: reply + "\n\nUsage:\n```\n>>> print(1)\n1\n```",
    "comment lines dropped": _drop_comment_lines,
    "cut off in a second block": lambda reply: reply + "\n\nA faster version:\n```python\ndef ",
}


async def test_agreement_with_gym_evalplus_verdicts() -> None:
    """Gym's evalplus verifier cannot run here: it needs the evalplus package and HumanEval+, which evalplus
    downloads. Its example rollouts carry its verdicts (`is_correct`, passing_base_tests: all five pass); ours grade
    the same replies on code/humaneval's rows (HumanEval's base tests), the code taken Gym's way and ours. On replies
    made from them, where the two extractions part, each extraction is graded by ours."""
    extract = _evalplus_extraction()
    humaneval = load_instances(load_task("code/humaneval").dataset)
    rows = {row.data["task_id"]: problem_from_row(row.data) for row in humaneval}
    folder = Path(evalplus.__path__[0]) / "data"
    rollouts = [json.loads(line) for line in (folder / "example_rollouts.jsonl").open()]
    assert [extract(r["extracted_model_output"]) for r in rollouts] == [r["extracted_model_code"] for r in rollouts]
    cases = [("rollout", r, r["extracted_model_output"]) for r in rollouts]
    cases += [(shape, r, make(r["extracted_model_output"])) for shape, make in EVALPLUS_REPLY_SHAPES.items()
              for r in rollouts]  # fmt: skip
    submissions = [(rows[r["verifier_metadata"]["task_id"]], code) for _, r, reply in cases
                   for code in (extract(reply), final_code_block(reply))]  # fmt: skip
    grades = [e.reward for e in await grade_programs(submissions, GradingSettings(timeout_s=10))]
    by_gyms_extraction, by_ours = grades[0::2], grades[1::2]
    rollout_verdicts = [float(r["is_correct"]) for r in rollouts]
    assert by_gyms_extraction[: len(rollouts)] == by_ours[: len(rollouts)] == rollout_verdicts == [1.0] * 5
    parted: dict[str, list[tuple[str, float, float]]] = {}
    for (shape, r, _), gyms, ours in zip(cases, by_gyms_extraction, by_ours):
        if gyms != ours:
            parted.setdefault(shape, []).append((r["verifier_metadata"]["task_id"], gyms, ours))
    print(f"\nevalplus agreement with Gym's verdicts: {len(rollouts)}/{len(rollouts)}; extractions part on "
          f"{sum(map(len, parted.values()))} of {len(cases) - len(rollouts)} made replies:")
    for shape, rows_parted in parted.items():
        print(f"  {shape}: {rows_parted} (task, graded from Gym's extraction, from ours)")
    # Gym's strict extraction reads no block tagged other than `python` (our humaneval task asks for an untagged
    # one) and strips a body's first indent (a body whose first line is a statement no longer compiles): ours is
    # right. A reply cut off in a later python block: Gym keeps nothing (Skills' rule), ours grades the complete
    # block before it. A usage block after the code: ours grades the last block, as Gym's code_gen does; evalplus's
    # preference for the python block is right there.
    verdicts = {shape: (len(found), {(gyms, ours) for _, gyms, ours in found}) for shape, found in parted.items()}
    assert verdicts == {
        "untagged fence": (5, {(0.0, 1.0)}), "py tag": (5, {(0.0, 1.0)}), "comment lines dropped": (1, {(0.0, 1.0)}),
        "cut off in a second block": (5, {(0.0, 1.0)}), "usage block after the code": (5, {(1.0, 0.0)}),
    }  # fmt: skip
