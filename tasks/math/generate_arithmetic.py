"""Regenerate tasks/math/data/arithmetic.jsonl with reasoning-gym (offline, deterministic).

    .venv/bin/python tasks/math/generate_arithmetic.py
"""

from __future__ import annotations

import json
from pathlib import Path

import reasoning_gym

OUT = Path(__file__).parent / "data" / "arithmetic.jsonl"


def main(size: int = 64, seed: int = 2026) -> None:
    dataset = reasoning_gym.create_dataset(
        "basic_arithmetic", size=size, seed=seed, min_terms=2, max_terms=4, min_digits=1, max_digits=3
    )
    OUT.parent.mkdir(parents=True, exist_ok=True)
    with OUT.open("w") as f:
        for i, item in enumerate(dataset):
            row = {"id": f"arith-{i:03d}", "question": item["question"], "answer": item["answer"]}
            f.write(json.dumps(row) + "\n")
    print(f"wrote {size} problems to {OUT}")


if __name__ == "__main__":
    main()
