"""`prorl bench train`: does a policy trained through the service get better? A full `prorl train` run (GRPO with
TRL, the live policy generating every turn, the task's own verifier), with the held-out rows evaluated before the
first step and after the last: the same rows, the same k seeds per row, only the weights differ.

The last line: held-out mean reward before -> after, the paired difference with its 95% interval over rows, steps,
wall time, and the mean absolute difference per generated token between the log-probs the service returned and the
trainer's own recomputation. Extra arguments are `prorl train` overrides (e.g. trainer.max_steps=10).
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import time
from pathlib import Path

from nemo_gym_prorl.train.grpo import held_out_results
from nemo_gym_prorl.train.heldout import paired_difference
from nemo_gym_prorl.train.plot import read_metrics

# What the measured run used (docs/training.md); each can be overridden on the command line.
DEFAULTS = [
    "task=math/arithmetic_train",
    "trainer.max_steps=16",
    "trainer.learning_rate=5e-5",
    "max_tokens=64",
    "heldout.limit=48",
    "heldout.k=2",
]
GOAL_RISE = 0.15
GOAL_MINUTES = 60
GOAL_MISMATCH = 1e-3


def _args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="prorl bench train", description=__doc__.split("\n\n")[0])
    parser.add_argument("--run-dir", type=Path, default=None, help="default: outputs/bench/train/<time>")
    parser.add_argument("overrides", nargs="*", help="prorl train overrides, after the defaults: " + " ".join(DEFAULTS))
    return parser.parse_args(argv)


def main(argv: list[str]) -> None:
    args = _args(argv)
    run_dir = args.run_dir or Path("outputs/bench/train") / time.strftime("%Y-%m-%d_%H-%M-%S")
    command = [sys.executable, "-m", "nemo_gym_prorl.cli", "train", *DEFAULTS, *args.overrides,
               f"hydra.run.dir={run_dir}"]  # fmt: skip
    print("running:", " ".join(command[2:]), flush=True)
    started = time.perf_counter()
    child = subprocess.Popen(command)
    try:
        status = child.wait()
    except BaseException:  # Ctrl-C or SIGTERM: the training stops its sandboxes and servers on its way out
        child.send_signal(signal.SIGTERM)
        child.wait()
        raise
    wall_s = time.perf_counter() - started
    if status != 0:
        raise SystemExit(f"prorl bench train: the training run failed (exit {status}); its folder: {run_dir}")
    report(run_dir, wall_s)


def report(run_dir: Path, wall_s: float) -> None:
    metrics = read_metrics(run_dir / "metrics.jsonl")
    heldout = held_out_results(run_dir)
    if len(heldout) < 2:
        raise SystemExit(f"prorl bench train: {run_dir} holds fewer than two held-out evaluations (heldout.limit=0?)")
    first, last = heldout[0], heldout[-1]
    d = paired_difference(first, last)
    steps = max((m["step"] for m in metrics if "reward" in m), default=0)
    mismatch = [m["prorl/logprob_mismatch"] for m in metrics if m.get("prorl/logprob_mismatch") is not None]
    multi = [m["prorl/multi_turn"] for m in metrics if m.get("prorl/multi_turn") is not None]
    excluded = [m["prorl/excluded"] for m in metrics if m.get("prorl/excluded") is not None]
    mean_mismatch = sum(mismatch) / len(mismatch) if mismatch else float("nan")
    print(f"run folder: {run_dir} (reward.png, metrics.jsonl, rollouts/, heldout/)")
    print(f"train reward per step: {' '.join(f'{m["reward"]:.2f}' for m in metrics if 'reward' in m)}")
    print(f"samples with more than one model turn: {sum(multi) / max(len(multi), 1):.0%} (mean over steps); "
          f"excluded (masked or failed): {sum(excluded) / max(len(excluded), 1):.1%}")  # fmt: skip
    print(f"held-out: {d.rows} rows x {sum(len(r) for r in first.rows.values()) // max(len(first.rows), 1)} samples, "
          f"before {d.before:.3f} ± {first.ci95:.3f}, after {d.after:.3f} ± {last.ci95:.3f}")  # fmt: skip
    met = d.mean >= GOAL_RISE and d.low > 0 and wall_s <= GOAL_MINUTES * 60 and mean_mismatch <= GOAL_MISMATCH
    print(
        f"held-out mean reward {d.before:.3f} -> {d.after:.3f} ({d.mean:+.3f}, 95% CI [{d.low:+.3f}, {d.high:+.3f}]), "
        f"{steps} steps, {wall_s / 60:.1f} min wall, log-prob mismatch {mean_mismatch:.1e} per generated token "
        f"(goal: >= +{GOAL_RISE} with the interval above 0, <= {GOAL_MINUTES} min, <= {GOAL_MISMATCH:g}: "
        f"{'met' if met else 'not met'})"
    )
