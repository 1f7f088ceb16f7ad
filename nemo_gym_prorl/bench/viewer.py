"""`prorl bench viewer`: how long `prorl view` takes to show the first page of a file of 10,000 trajectories.

The file is generated (GRPO groups of 4 samples of a 3-turn math rollout with tool calls, each turn's prompt
extending the last, ~120 generated tokens a turn with their log-probs, shaped as `prorl rollout` writes them).
Measured, in one run on the same file:

- baseline: reading the whole file with `json` (each line `json.loads`ed): the least a viewer that parses every
  row before showing any must pay;
- the viewer opening the file (as `prorl view` does once its imports are done) until the first page is drawn in a
  headless chromium already running (Debian's; without it: until the page, its script, the facets and the rows are
  answered); then until every row is read, and a filtered, sorted page after that;
- `prorl view FILE` as a process, from its start until the first page of rows is answered (imports included).

    prorl bench viewer [--trajectories 10000] [--repeats 3]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

from nemo_gym_prorl.viewer.app import create_viewer_app
from nemo_gym_prorl.viewer.browser import chromium_available, headless_chromium
from nemo_gym_prorl.viewer.serving import serving_in_thread
from nemo_gym_prorl.viewer.sources import FileSource

if TYPE_CHECKING:
    from selenium.webdriver import Chrome

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


def _open_and_show(path: Path, browser: Chrome | None) -> tuple[float, float, float]:
    """The viewer opens `path` (in this process, as `prorl view` does after its imports) and the first page is
    shown: drawn in the browser (its first row there), or without one, the page, its script, the facets and the
    first page of rows answered. Seconds to that, to every row read, and for a filtered, sorted page after."""
    started = time.perf_counter()
    source = FileSource(path)
    with serving_in_thread(create_viewer_app(source)) as url:
        if browser is not None:
            browser.get(url)
            browser.find_element("css selector", "#rows tr[data-index]")  # waits (implicitly) until it is drawn
        else:
            with httpx.Client(base_url=url, timeout=60) as client:
                for route in ("/", "/static/viewer.js", "/api/facets", "/api/trajectories?limit=50"):
                    client.get(route).raise_for_status()
        shown = time.perf_counter() - started
        source.complete.wait()
        whole = time.perf_counter() - started
        with httpx.Client(base_url=url, timeout=60) as client:
            begun = time.perf_counter()
            client.get("/api/trajectories", params={"resolved": "false", "sort": "reward", "desc": "true"}
                       ).raise_for_status()
            query = time.perf_counter() - begun
    return shown, whole, query


def _command_ready(path: Path) -> float:
    """`prorl view FILE` as a user runs it: from the process's start until the first page of rows is answered
    (Python and the `prorl` command's imports included)."""
    started = time.perf_counter()
    process = subprocess.Popen([sys.executable, "-m", "nemo_gym_prorl.cli", "view", str(path), "--port", "0"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert process.stdout is not None
        line = process.stdout.readline()
        if not line.startswith("prorl view: "):
            raise RuntimeError(f"prorl view did not start: {line}{process.stderr.read() if process.stderr else ''}")
        httpx.get(line.split()[-1] + "api/trajectories?limit=50", timeout=60).raise_for_status()
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
        print(f"file: {options.trajectories} trajectories, {path.stat().st_size / 1e6:.0f} MB")
        baseline = min(_json_baseline(path) for _ in range(options.repeats))
        print(f"baseline, the whole file read with json.loads per line: {baseline:.3f} s")
        with contextlib.ExitStack() as stack:
            browser = stack.enter_context(headless_chromium()) if chromium_available() else None
            where = "drawn in chromium" if browser is not None else "answered (no chromium: page, script, rows)"
            runs = [_open_and_show(path, browser) for _ in range(options.repeats)]
        shown, whole, query = (min(run[i] for run in runs) for i in range(3))
        print(f"every row read (in the background): {whole:.3f} s; then a filtered, sorted page: {query * 1000:.0f} ms")
        print(f"prorl view process start to first page answered (Python + prorl imports): {_command_ready(path):.3f} s")
        print(f"prorl view: first page {where} {shown:.3f} s after opening the file "
              f"({shown / baseline:.2f}x the json read of it, {baseline:.3f} s)")
    finally:
        shutil.rmtree(folder, ignore_errors=True)
