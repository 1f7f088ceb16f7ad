"""`prorl bench viewer`: how long `prorl view` takes to show the first page of a file of 10,000 trajectories.

The file is generated (GRPO groups of 4 samples of a 3-turn math rollout with tool calls, each turn's prompt
extending the last, ~120 generated tokens a turn with their log-probs, shaped as `prorl rollout` writes them).
Measured, in one run on the same file:

- baseline: reading the file with `json` (each line `json.loads`ed): the least any viewer must do to list it;
- viewer: `prorl view FILE` started as a process, until its server answers the first page of the list
  (`/api/trajectories`), with the facets the filters offer, and the page's HTML and script;
- in the browser (when Debian's chromium and chromedriver are installed): the page loaded until the first row is
  drawn, against a viewer already serving.

    prorl bench viewer [--trajectories 10000] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

SYSTEM = "You solve math problems by running Python. Reply with one ```python code block that prints the result."


def _turn(rng: random.Random, prompt: list[int], text: str) -> dict[str, Any]:
    generated = [rng.randrange(100, 49000) for _ in range(rng.randrange(80, 160))]
    return {
        "role": "assistant",
        "content": text,
        "prompt_token_ids": prompt,
        "generation_token_ids": generated,
        "generation_log_probs": [round(-rng.expovariate(3.0), 6) for _ in generated],
        "finish_reason": "stop",
    }


def trajectory(rng: random.Random, group: int, sample: int) -> dict[str, Any]:
    """One rollout of instance `group`, sample `sample`: a code turn, its observation, a second turn, an answer."""
    a, b = group % 97, group % 13 + 1
    answer = a * b if rng.random() < 0.6 else a * b + 1
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": f"Calculate {a} * {b}."},
    ]
    prompt = [rng.randrange(100, 49000) for _ in range(rng.randrange(90, 130))]
    for text, observation in ((f"```python\nprint({a} * {b})\n```", f"{a * b}\n"),
                              (f"```python\nprint({a} * {b} == {answer})\n```", f"{answer == a * b}\n")):
        turn = _turn(rng, prompt, text)
        turn["tool_calls"] = [{"id": f"call_{len(messages)}", "type": "function",
                               "function": {"name": "python", "arguments": json.dumps({"code": text[10:-4]})}}]
        messages += [turn, {"role": "user", "content": f"Observation (python):\n{observation}"}]
        prompt = prompt + turn["generation_token_ids"] + [rng.randrange(100, 49000) for _ in range(12)]
    messages.append(_turn(rng, prompt, f"\\boxed{{{answer}}}"))
    reward = 1.0 if answer == a * b else 0.0
    return {
        "instance_id": f"arith-{group:05d}", "trajectory_id": f"job{group:05d}:{sample}", "messages": messages,
        "tools": [], "reward": reward, "resolved": reward == 1.0, "finish": "answer", "critical_error": None,
        "error": None, "evaluation": {"reason": "correct" if reward else "wrong answer", "parsed_answer": str(answer),
                                      "expected": str(a * b)},
        "timing": {"init": 0.09, "run": rng.uniform(1, 20), "eval": 0.15, "queued": rng.uniform(0, 2)},
        "num_tool_calls": 2, "num_format_errors": 0,
    }


def write_file(path: Path, count: int, samples: int = 4, seed: int = 0) -> None:
    rng = random.Random(seed)
    with path.open("w") as file:
        for i in range(count):
            file.write(json.dumps(trajectory(rng, i // samples, i % samples)) + "\n")


def _json_baseline(path: Path) -> float:
    started = time.perf_counter()
    with path.open() as file:
        rows = [json.loads(line) for line in file]
    assert rows
    return time.perf_counter() - started


def _first_page_served(path: Path) -> tuple[float, float]:
    """Seconds from `prorl view` starting to the first page, its facets and the page's assets answered; and
    after that, a filtered, sorted page."""
    started = time.perf_counter()
    process = subprocess.Popen([sys.executable, "-m", "nemo_gym_prorl.cli", "view", str(path), "--port", "0"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert process.stdout is not None
        line = process.stdout.readline()
        if not line.startswith("prorl view: "):
            raise RuntimeError(f"prorl view did not start: {line}{process.stderr.read() if process.stderr else ''}")
        url = line.split()[-1]
        with httpx.Client(base_url=url, timeout=60) as client:
            for route in ("/", "/static/viewer.js", "/api/facets", "/api/trajectories?limit=50"):
                client.get(route).raise_for_status()
            first = time.perf_counter() - started
            begun = time.perf_counter()
            client.get("/api/trajectories", params={"resolved": "false", "sort": "reward", "desc": "true"}
                       ).raise_for_status()
            return first, time.perf_counter() - begun
    finally:
        process.terminate()
        process.wait(timeout=30)


def _first_page_drawn(path: Path) -> float | None:
    """In chromium: the page loaded until the list shows its first row, against `prorl view` already serving."""
    from nemo_gym_prorl.viewer.browser import chromium_available, headless_chromium

    if not chromium_available():
        return None
    process = subprocess.Popen([sys.executable, "-m", "nemo_gym_prorl.cli", "view", str(path), "--port", "0"],
                               stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert process.stdout is not None
        url = process.stdout.readline().split()[-1]
        with headless_chromium() as browser:
            browser.get("about:blank")
            started = time.perf_counter()
            browser.get(url)
            browser.find_element("css selector", "#rows tr[data-index]")  # implicit wait: until it is drawn
            return time.perf_counter() - started
    finally:
        process.terminate()
        process.wait(timeout=30)


def main(args: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="prorl bench viewer")
    parser.add_argument("--trajectories", type=int, default=10_000)
    parser.add_argument("--repeats", type=int, default=3)
    options = parser.parse_args(args)
    folder = Path(tempfile.mkdtemp(prefix="prorl-bench-viewer-"))
    try:
        path = folder / "rollouts.jsonl"
        write_file(path, options.trajectories)
        size_mb = path.stat().st_size / 1e6
        print(f"file: {options.trajectories} trajectories, {size_mb:.0f} MB")
        baseline = min(_json_baseline(path) for _ in range(options.repeats))
        served = [_first_page_served(path) for _ in range(options.repeats)]
        first = min(s[0] for s in served)
        query = min(s[1] for s in served)
        drawn = _first_page_drawn(path)
        print(f"baseline, the file read with json.loads per line: {baseline:.3f} s")
        print(f"a filtered and sorted page afterwards: {query * 1000:.0f} ms")
        if drawn is not None:
            print(f"in chromium, page load until the first row is drawn (viewer serving): {drawn:.3f} s")
        print(f"prorl view: first page served {first:.3f} s after start ({first / baseline:.2f}x the json read)")
    finally:
        shutil.rmtree(folder, ignore_errors=True)
