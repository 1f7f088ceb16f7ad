"""Regenerate tasks/math/data/arithmetic.jsonl and arithmetic_train.jsonl with reasoning-gym (offline,
deterministic; the first 64 training rows are arithmetic's).

    .venv/bin/python tasks/math/generate_arithmetic.py
"""

from __future__ import annotations

import json
from pathlib import Path

import reasoning_gym

DATA = Path(__file__).parent / "data"
SIZE = 64
TRAIN_SIZE = 640  # arithmetic_train: enough held-out rows (15%) for an interval that can exclude zero
SEED = 2026


def write_rows(path: Path, size: int) -> None:
    dataset = reasoning_gym.create_dataset(
        "basic_arithmetic", size=size, seed=SEED, min_terms=2, max_terms=4, min_digits=1, max_digits=3
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for i, item in enumerate(dataset):
            row = {"id": f"arith-{i:03d}", "question": item["question"], "answer": item["answer"]}
            f.write(json.dumps(row) + "\n")
    print(f"wrote {size} problems to {path}")


def main() -> None:
    write_rows(DATA / "arithmetic.jsonl", SIZE)
    write_rows(DATA / "arithmetic_train.jsonl", TRAIN_SIZE)


if __name__ == "__main__":
    main()
