"""A training run's reward curve as a PNG: the train reward of every step and the held-out reward where measured."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def read_metrics(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def plot_rewards(metrics: list[dict[str, Any]], out: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [(m["step"], m["reward"]) for m in metrics if m.get("reward") is not None and "heldout/reward" not in m]
    heldout = [(m["step"], m["heldout/reward"], m.get("heldout/ci95", 0.0)) for m in metrics if "heldout/reward" in m]
    figure, axes = plt.subplots(figsize=(7, 4), dpi=100)
    if train:
        axes.plot(*zip(*train), marker=".", linewidth=1, label="train reward (per step)")
    if heldout:
        steps, means, half = zip(*heldout)
        axes.errorbar(steps, means, yerr=half, fmt="o-", capsize=4, label="held-out reward (95% CI)")
    axes.set_xlabel("step")
    axes.set_ylabel("mean reward")
    axes.set_ylim(-0.02, 1.02)
    axes.set_title(title)
    axes.grid(alpha=0.3)
    axes.legend(loc="best")
    figure.tight_layout()
    tmp = out.with_suffix(".tmp.png")
    figure.savefig(tmp)
    plt.close(figure)
    tmp.replace(out)
