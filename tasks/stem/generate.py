"""Regenerate the STEM tasks' data offline and deterministically:

- algebra / geometry / decimals.jsonl: reasoning-gym's simple_equations, simple_geometry, decimal_arithmetic.
- one_step_equations.jsonl: simple_equations at its easiest (x + a = b, x - a = b, values 1..9).
- arithmetic_choice.jsonl: basic_arithmetic (two terms, one or two digits) as four-option multiple choice in Gym's
  mcqa row schema, the distractors near misses (off by one or ten, the sign flipped, the other operation), each
  letter right equally often; the choice is a boxed letter or a reply opening with one ("C: -157").
- units.jsonl: physics word problems with units (speed, force, kinetic energy), the gold answer a quantity and
  the question asking for other units than the data's, so the grader's conversion matters.
- gym_mcqa_example.jsonl, gym_mcqa_template_example.jsonl, gym_gpqa_diamond_example.jsonl: NeMo Gym's example
  rows for its mcqa and gpqa_diamond servers, unchanged.

    .venv/bin/python tasks/stem/generate.py
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import reasoning_gym
import resources_servers.gpqa_diamond
import resources_servers.mcqa

DATA = Path(__file__).parent / "data"
SIZE = 32
SEED = 2026


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows))
    print(f"wrote {len(rows)} rows to {path}")


def reasoning_gym_rows(name: str, prefix: str, rel_tol: float | None = None, **settings: object) -> list[dict]:
    rows = []
    for i, item in enumerate(reasoning_gym.create_dataset(name, size=SIZE, seed=SEED, **settings)):
        row = {"id": f"{prefix}-{i:03d}", "question": item["question"], "answer": item["answer"]}
        rows.append(row | ({"rel_tol": rel_tol} if rel_tol else {}))
    return rows


def _speed(rng: random.Random) -> tuple[str, str]:
    km, minutes = rng.randint(2, 90), rng.choice([10, 15, 20, 30, 45, 60, 90])
    return (f"A cyclist covers {km} km in {minutes} minutes at constant speed. What is the speed in m/s?",
            f"{km * 1000 / (minutes * 60):.6g} m/s")


def _force(rng: random.Random) -> tuple[str, str]:
    grams, accel = rng.randint(50, 5000), rng.randint(1, 30)
    return (f"What net force accelerates a {grams} g cart at {accel} m/s^2? Give it in newtons.",
            f"{grams / 1000 * accel:.6g} N")


def _energy(rng: random.Random) -> tuple[str, str]:
    tonnes, kmh = round(rng.uniform(0.8, 3.0), 1), rng.choice([36, 54, 72, 90, 108])
    joules = 0.5 * tonnes * 1000 * (kmh / 3.6) ** 2
    return (f"A car of {tonnes} t moves at {kmh} km/h. What is its kinetic energy in kJ?", f"{joules / 1000:.6g} kJ")


def _distractors(question: str, answer: int, rng: random.Random) -> list[int]:
    """Three wrong options a solver could plausibly reach: off by one or ten, the sign flipped, the other operation
    (a + b for a - b and back, where the question has one)."""
    near = [answer + 1, answer - 1, answer + 10, answer - 10, -answer]
    terms = [int(t) for t in re.findall(r"-?\d+", question)]
    if len(terms) == 2 and " - " in question:
        near.append(terms[0] + terms[1])
    if len(terms) == 2 and " + " in question:
        near.append(terms[0] - terms[1])
    candidates = sorted({n for n in near if n != answer})
    return rng.sample(candidates, 3)


# How the choice is read (Gym mcqa's template_metadata.output_regex, first pattern that matches): a boxed letter, else
# a reply that opens with one as the options are listed ("C: -157", "(C)", "C."); else lenient_boxed.
CHOICE_REGEX = [r"\\boxed\{\s*\(?([A-D])\)?\s*\}", r"\A\s*\(?([A-D])\)?\s*[:.)]"]


def choice_rows() -> list[dict]:
    rng = random.Random(SEED)
    items = reasoning_gym.create_dataset(
        "basic_arithmetic", size=SIZE, seed=SEED, min_terms=2, max_terms=2, min_digits=1, max_digits=2,
        operators=("+", "-"))
    rows = []
    for i, item in enumerate(items):
        answer = int(item["answer"])
        values = _distractors(item["question"], answer, rng)
        values.insert(i % 4, answer)  # each letter right equally often: no letter beats the others by chance
        letters = "ABCD"
        listing = "\n".join(f"{letter}: {value}" for letter, value in zip(letters, values))
        rows.append({
            "id": f"choice-{i:03d}", "question": f"{item['question']}\n{listing}",
            "options": [{letter: str(value)} for letter, value in zip(letters, values)],
            "expected_answer": letters[values.index(answer)], "grading_mode": "lenient_boxed",
            "template_metadata": {"output_regex": CHOICE_REGEX},
        })
    return rows


def unit_rows() -> list[dict]:
    rng = random.Random(SEED)
    makers = [_speed, _force, _energy]
    rows = []
    for i in range(SIZE):
        question, answer = makers[i % len(makers)](rng)
        rows.append({"id": f"units-{i:03d}", "question": question, "answer": answer, "rel_tol": 1e-3})
    return rows


def gym_rows(package: object, name: str) -> list[dict]:
    path = Path(package.__path__[0]) / "data" / name  # type: ignore[attr-defined]
    return [json.loads(line) for line in path.read_text().splitlines()]


def main() -> None:
    DATA.mkdir(parents=True, exist_ok=True)
    write_jsonl(DATA / "algebra.jsonl", reasoning_gym_rows("simple_equations", "algebra"))
    write_jsonl(DATA / "one_step_equations.jsonl", reasoning_gym_rows(
        "simple_equations", "one-step", min_terms=2, max_terms=2, min_value=1, max_value=9,
        operators=("+", "-"), operators_weights=[0.5, 0.5]))
    write_jsonl(DATA / "arithmetic_choice.jsonl", choice_rows())
    write_jsonl(DATA / "geometry.jsonl", reasoning_gym_rows("simple_geometry", "geometry"))
    write_jsonl(DATA / "decimals.jsonl", reasoning_gym_rows("decimal_arithmetic", "decimals", rel_tol=1e-6))
    write_jsonl(DATA / "units.jsonl", unit_rows())
    write_jsonl(DATA / "gym_mcqa_example.jsonl", gym_rows(resources_servers.mcqa, "example.jsonl"))
    write_jsonl(DATA / "gym_mcqa_template_example.jsonl",
                gym_rows(resources_servers.mcqa, "example_with_template_metadata.jsonl"))
    write_jsonl(DATA / "gym_gpqa_diamond_example.jsonl", gym_rows(resources_servers.gpqa_diamond, "example.jsonl"))


if __name__ == "__main__":
    main()
