"""What a rollout run shows and keeps: one JSON line per trajectory as it finishes, a progress bar, a summary.

The summary ends with the output path and the command that opens it, printed whole: rich cuts a table to 80
columns when stdout is not a terminal (make, CI, logs), and a cut path cannot be copied. Runs of GRPO groups say
how many groups have a reward spread, since GRPO learns nothing from a group whose rewards are all equal. The bar
shows the turns and tokens/s generated so far beside the rollouts finished: a SWE rollout can take minutes.
"""

from __future__ import annotations

import shlex
import statistics
import time
from collections import Counter
from pathlib import Path
from types import TracebackType
from typing import IO, Any

import yaml
from rich.console import Console
from rich.table import Table
from tqdm import tqdm

from nemo_gym_prorl.contracts.progress import Generated
from nemo_gym_prorl.contracts.trajectory import Trajectory, grpo_group

_STAGES = ("init", "run", "eval")


def config_record_path(output: Path) -> Path:
    """Where the resolved config that made `output` is kept: `<stem>.config.yaml` beside it."""
    return output.with_suffix(".config.yaml")


def read_config_record(output: Path) -> dict[str, Any]:
    """The config record beside `output` as a mapping; {} when there is none, or it is not a YAML mapping."""
    record = config_record_path(output)
    if not record.is_file():
        return {}
    try:
        loaded = yaml.safe_load(record.read_text())
    except yaml.YAMLError:
        return {}
    return loaded if isinstance(loaded, dict) else {}


class RolloutReport:
    """`config_record`, when given, is written beside `output` (`<stem>.config.yaml`) as the run's results begin."""

    def __init__(self, output: Path, title: str, config_record: str | None = None) -> None:
        self.output = output
        self.title = title
        self.config_record = config_record
        self.trajectories: list[Trajectory] = []
        self._file: IO[str] | None = None
        self._bar: tqdm | None = None
        self._started = 0.0
        self._rollouts_began = 0.0
        self.generated: Generated | None = None  # None: the service keeps no counts (Ray)
        self.wall_s = 0.0

    def __enter__(self) -> RolloutReport:
        self._started = time.perf_counter()
        return self

    def expect(self, total: int) -> None:
        """The rollouts begin: only now are the files written and the bar drawn (with its total), so a run that
        cannot start leaves neither an empty output nor a bar on the terminal."""
        self.output.parent.mkdir(parents=True, exist_ok=True)
        if self.config_record is not None:
            config_record_path(self.output).write_text(self.config_record)
        self._file = self.output.open("w")
        self._bar = tqdm(total=total, desc="rollouts", unit="rollout", dynamic_ncols=True)
        self._rollouts_began = time.perf_counter()

    def live(self, generated: Generated) -> None:
        assert self._bar is not None
        self.generated = generated
        self._bar.set_postfix(self._postfix())  # redraws: no rollout may finish for minutes

    def add(self, trajectory: Trajectory) -> None:
        assert self._file is not None and self._bar is not None
        self._file.write(trajectory.model_dump_json() + "\n")
        self._file.flush()
        self.trajectories.append(trajectory)
        self._bar.set_postfix(self._postfix(), refresh=False)
        self._bar.update(1)

    def _postfix(self) -> dict[str, str]:
        shown = {"reward": f"{self.mean('reward'):.2f}"} if self.trajectories else {}
        if self.generated is not None:
            elapsed = time.perf_counter() - self._rollouts_began
            shown["turns"] = str(self.generated.answers)
            shown["tok/s"] = f"{self.generated.completion_tokens / elapsed:.1f}" if elapsed > 0 else "-"
        return shown

    def mean(self, attribute: str) -> float:
        values = [float(getattr(t, attribute)) for t in self.trajectories]
        return sum(values) / len(values) if values else 0.0

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.wall_s = time.perf_counter() - self._started
        if self._bar is not None:
            self._bar.close()
        if self._file is not None:
            self._file.close()

    def summary_rows(self) -> list[tuple[str, str]]:
        trajectories = self.trajectories
        turns = [len(t.assistant_turns()) for t in trajectories]
        generated = sum(len(m["generation_token_ids"]) for t in trajectories for m in t.assistant_turns())
        errors = [t.critical_error for t in trajectories if t.critical_error]
        finishes: dict[str, int] = {}
        for t in trajectories:
            finishes[str(t.finish)] = finishes.get(str(t.finish), 0) + 1
        n = len(trajectories) or 1
        return [
            ("rollouts", str(len(trajectories))),
            ("mean reward", f"{self.mean('reward'):.3f}"),
            *self._group_rows(),
            ("resolved", f"{sum(t.resolved for t in trajectories)} ({sum(t.resolved for t in trajectories) / n:.0%})"),
            *self._patch_rows(),
            ("mean turns", f"{sum(turns) / n:.2f}"),
            ("tool calls run", str(sum(t.num_tool_calls for t in trajectories))),
            ("format errors", str(sum(t.num_format_errors for t in trajectories))),
            ("finish", ", ".join(f"{k}={v}" for k, v in sorted(finishes.items()))),
            ("critical errors", str(len(errors)) + (f" ({', '.join(sorted(set(errors)))})" if errors else "")),
            ("generated tokens", str(generated)),
            ("tokens/s", f"{generated / self.wall_s:.1f}" if self.wall_s else "-"),
            ("wall time", f"{self.wall_s:.1f} s"),
        ]

    def roll_up_row(self) -> dict[str, str]:
        """This run as one row of a sweep's roll-up table."""
        n = len(self.trajectories) or 1
        return {"rollouts run": str(len(self.trajectories)), "mean reward": f"{self.mean('reward'):.3f}",
                "with tool calls": f"{sum(t.num_tool_calls > 0 for t in self.trajectories) / n:.0%}",
                "rollouts": str(self.output.absolute())}  # fmt: skip

    def _group_rows(self) -> list[tuple[str, str]]:
        """Only when some group holds more than one sample: the groups' sizes, how many have a reward spread, and
        the mean over groups of the group's mean reward ± the mean within-group (population) std."""
        groups: dict[str, list[float]] = {}
        for t in self.trajectories:
            groups.setdefault(grpo_group(t.trajectory_id, t.instance_id)[0], []).append(t.reward)
        if all(len(rewards) < 2 for rewards in groups.values()):
            return []
        rewards = list(groups.values())
        sizes = Counter(len(r) for r in rewards)
        if len(sizes) == 1:
            shape = f"{len(rewards)} × {next(iter(sizes))}"
        else:
            shape = f"{len(rewards)} ({', '.join(f'{n} × {size}' for size, n in sorted(sizes.items(), reverse=True))})"
        spread = sum(max(r) != min(r) for r in rewards)
        mean = statistics.fmean(statistics.fmean(r) for r in rewards)
        std = statistics.fmean(statistics.pstdev(r) for r in rewards)
        return [
            ("GRPO groups", shape),
            ("groups with reward spread", f"{spread} of {len(rewards)} ({spread / len(rewards):.0%})"),
            ("group mean reward ± mean group std", f"{mean:.3f} ± {std:.3f}"),
        ]

    def _patch_rows(self) -> list[tuple[str, str]]:
        """Tasks graded on a patch (swe) say whether it applied; every run shows its per-stage times (p50)."""
        trajectories, rows = self.trajectories, []
        graded = [t for t in trajectories if "patch_applied" in t.evaluation]
        if graded:
            applied = sum(bool(t.evaluation["patch_applied"]) for t in graded)
            rows.append(("patch applied", f"{applied} ({applied / len(graded):.0%})"))
        if trajectories:
            p50 = {stage: statistics.median(getattr(t.timing, stage) for t in trajectories) for stage in _STAGES}
            rows.append(("p50 init / run / eval", " / ".join(f"{p50[s]:.2f} s" for s in _STAGES)))
        return rows

    def print_summary(self, console: Console | None = None) -> None:
        """The table, then where the rollouts are and how to open them, on lines of their own never wrapped or cut."""
        console = console or Console()
        table = Table(title=f"prorl rollout: {self.title}")
        table.add_column("metric")
        table.add_column("value", justify="right")
        for name, value in self.summary_rows():
            table.add_row(name, value)
        console.print(table)
        output = self.output.absolute()
        for line in (f"rollouts: {output}", f"view them: prorl view {shlex.quote(str(output))}"):
            console.print(line, soft_wrap=True, markup=False, highlight=False)
