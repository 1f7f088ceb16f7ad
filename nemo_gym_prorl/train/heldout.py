"""Held-out evaluation: rows never trained on, each sampled k times with fixed seeds, so that an evaluation before
training and one after draw the same random numbers and differ only by the weights. Rows are the unit of the
interval: a row's k samples are not independent of each other (same question), rows are."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field

from scipy import stats

from nemo_gym_prorl.contracts.trajectory import Trajectory


@dataclass
class HeldOutResult:
    step: int
    rows: dict[str, list[float]] = field(default_factory=dict)  # instance id -> rewards of its usable samples
    excluded: int = 0  # samples not counted: `Trajectory.mask_reason`

    @classmethod
    def of(cls, step: int, trajectories: list[Trajectory]) -> HeldOutResult:
        result = cls(step)
        for trajectory in trajectories:
            if trajectory.mask_reason() is not None:
                result.excluded += 1
                continue
            result.rows.setdefault(trajectory.instance_id, []).append(trajectory.reward)
        return result

    def row_means(self) -> dict[str, float]:
        return {row: statistics.fmean(rewards) for row, rewards in self.rows.items()}

    @property
    def mean(self) -> float:
        means = list(self.row_means().values())
        return statistics.fmean(means) if means else math.nan

    @property
    def ci95(self) -> float:
        """Half-width of the 95% interval of the mean over rows (t distribution)."""
        return _half_width(list(self.row_means().values()))


def _half_width(values: list[float]) -> float:
    if len(values) < 2:
        return math.nan
    return float(stats.t.ppf(0.975, len(values) - 1) * statistics.stdev(values) / math.sqrt(len(values)))


@dataclass
class Difference:
    before: float
    after: float
    mean: float
    low: float
    high: float
    rows: int


def paired_difference(before: HeldOutResult, after: HeldOutResult) -> Difference:
    """after - before over the rows both measured, with the 95% interval of the paired mean difference."""
    b, a = before.row_means(), after.row_means()
    rows = sorted(set(a) & set(b))
    differences = [a[r] - b[r] for r in rows]
    mean = statistics.fmean(differences) if differences else math.nan
    half = _half_width(differences)
    return Difference(before.mean, after.mean, mean, mean - half, mean + half, len(rows))
