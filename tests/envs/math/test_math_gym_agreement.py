"""Our math grader against NeMo Gym math_with_judge's library reward (math-verify, judge off), on the rows and
rollouts nemo-gym ships for it and on answers made from them, and against physics_judge (the same library first, an
LLM judge where it misses) on its rows and rollouts. Prints the figures; docs/code-and-stem.md states them."""

from __future__ import annotations

import json
from pathlib import Path

import resources_servers.math_with_judge as math_with_judge
import resources_servers.physics_judge as physics_judge
from math_verify.metric import math_metric
from math_verify.parser import ExprExtractionConfig, LatexExtractionConfig
from resources_servers.math_with_judge.app import _extract_last_boxed_answer, _run_math_verify

from nemo_gym_prorl.envs.math.env import grade_answer

DATA = Path(math_with_judge.__path__[0]) / "data"


def _gym_library_reward(expected: str, response: str) -> float:
    """math_with_judge's library reward, in-process: 0 without a non-empty \\boxed{}, else math-verify's."""
    boxed = _extract_last_boxed_answer(response)
    if boxed is None or not boxed.strip():
        return 0.0
    return _math_verify_reward(expected, response)


def _math_verify_reward(expected: str, response: str) -> float:
    """Gym's math-verify reward of a whole response (physics_judge asks it first, with no \\boxed{} required)."""
    verifier = math_metric(
        gold_extraction_target=(LatexExtractionConfig(),),
        pred_extraction_target=(ExprExtractionConfig(), LatexExtractionConfig()),
    )
    return _run_math_verify(verifier, expected, response)[0]


def _response_text(rollout: dict) -> str:
    return "".join(
        part["text"]
        for item in rollout["response"]["output"]
        if item["type"] == "message"
        for part in item["content"]
        if part["type"] == "output_text"
    )


def _cases() -> list[tuple[str, str, str]]:
    """(what, expected, response): the shipped rollouts, then per row the gold boxed, a wrong boxed answer and
    the gold unboxed."""
    cases = []
    for name in ("example_rollouts.jsonl", "example_rollouts_terminus_2.jsonl"):
        for line in (DATA / name).read_text().splitlines():
            rollout = json.loads(line)
            cases.append((f"{name} rollout", rollout["expected_answer"], _response_text(rollout)))
    for line in (DATA / "example.jsonl").read_text().splitlines():
        gold = json.loads(line)["expected_answer"]
        bare = gold.strip().removeprefix("\\(").removesuffix("\\)").strip()
        cases.append(("gold boxed", gold, f"The answer is \\boxed{{{bare}}}."))
        cases.append(("wrong boxed", gold, f"The answer is \\boxed{{{bare} + 1}}."))
        cases.append(("gold unboxed", gold, f"The answer is ${bare}$."))
    return cases


def test_agreement_with_math_with_judge_library_reward(monkeypatch) -> None:
    # Agreement is about what each grader decides, not about its time limit: one shipped gold answer, a power of
    # (2+sqrt 3) to 2016, takes math-verify seconds to compare, and on a loaded machine ours hit its 5 s limit.
    monkeypatch.setattr("nemo_gym_prorl.envs.math.env.TIMEOUT_S", 120)
    cases = _cases()
    disagreements = []
    for what, expected, response in cases:
        ours, gyms = grade_answer(response, expected).reward, _gym_library_reward(expected, response)
        if ours != gyms:
            disagreements.append((what, expected, ours, gyms))
    print(f"\nmath agreement with math_with_judge's library reward: {len(cases) - len(disagreements)}/{len(cases)}")
    for what, expected, ours, gyms in disagreements:
        print(f"  differs: {what} (gold {expected!r}): ours {ours}, Gym {gyms}")
    # The one intended difference: Gym scores an answer without \boxed{} 0; ours grades it (finish's "-6").
    assert {what for what, *_ in disagreements} <= {"gold unboxed"}
    assert len(disagreements) < len(cases) // 2


# A right answer written as plain text, per physics_judge example row (by its domain): what only a judge reads.
PLAIN_TEXT = {
    "mechanics": "a = g·sin θ",
    "thermodynamics": "W = nRT·ln(V₂/V₁)",
    "electromagnetism": "σ = q/(4π b²)",
    "quantum": "λ equals Planck's constant over the momentum",
    "relativity": "γ = 1/√(1 − v²/c²)",
}


def _physics_cases() -> tuple[list[dict], list[tuple[str, dict, str, float]]]:
    """physics_judge's rollouts, and (what, row, reply, the reward a right grader gives): each rollout on its row,
    then per row the gold boxed, a wrong boxed answer, the gold unboxed, the row's worked solution as the reply, and
    the answer in plain text."""
    folder = Path(physics_judge.__path__[0]) / "data"
    rows = [json.loads(line) for line in (folder / "example.jsonl").open()]
    rollouts = [json.loads(line) for line in (folder / "example_rollouts.jsonl").open()]
    cases = [("rollout", rows[r["_ng_task_index"]], _response_text(r), r["reward"]) for r in rollouts]
    for row in rows:
        bare = row["expected_answer"].removeprefix("\\boxed{").removesuffix("}")
        cases += [("gold boxed", row, f"So \\boxed{{{bare}}}.", 1.0),
                  ("wrong boxed", row, f"So \\boxed{{{bare} + 1}}.", 0.0),
                  ("gold unboxed", row, f"The answer is ${bare}$.", 1.0),
                  ("worked solution", row, row["solution"], 1.0),
                  ("plain text", row, f"The answer is {PLAIN_TEXT[row['domain']]}.", 1.0)]  # fmt: skip
    return rollouts, cases


def test_agreement_with_physics_judge() -> None:
    """physics_judge grades a reply with math-verify first (the whole reply, no \\boxed{} needed) and asks its LLM
    judge only where that misses. Its rollouts all passed on the library, the judge never asked; ours must agree.
    Where Gym's library misses on a made reply, Gym's reward is the judge's: ours is compared with the right one."""
    rollouts, cases = _physics_cases()
    assert [_math_verify_reward(r["expected_answer"], _response_text(r)) for r in rollouts] == [
        r["library_reward"] for r in rollouts] == [r["reward"] for r in rollouts] == [1.0] * 5  # fmt: skip
    library_decides, judge_decides = [], []
    for what, row, reply, right in cases:
        ours = grade_answer(reply, row["expected_answer"]).reward
        decides = library_decides if _math_verify_reward(row["expected_answer"], reply) > 0.5 else judge_decides
        decides.append((what, row["domain"], ours, right))
    differs = [case for case in library_decides if case[2] != 1.0]
    print(f"\nphysics_judge: its library decides {len(library_decides)} of {len(cases)}, ours agrees on "
          f"{len(library_decides) - len(differs)}; its judge decides {len(judge_decides)}, ours right on "
          f"{sum(ours == right for *_, ours, right in judge_decides)}:")
    for what, domain, ours, right in judge_decides:
        print(f"  judge decides: {what} ({domain}): ours {ours}, right {right}")
    assert not differs
    # Where only the judge decides, ours is right on the wrong answers (0) and on the relativity row's worked solution,
    # whose $\gamma=\frac{1}{...}$ math-verify alone misreads (ours reads it: 1); it is wrong on the answers in plain
    # text (0), which a judge can accept and math-verify cannot read: a difference we keep, with no judge to ask.
    assert sorted((what, domain) for what, domain, ours, right in judge_decides if ours != right) == [
        ("plain text", domain) for domain in sorted(PLAIN_TEXT)]  # fmt: skip
    assert ("worked solution", "relativity", 1.0, 1.0) in judge_decides
