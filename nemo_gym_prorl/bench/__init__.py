"""`prorl bench NAME`: benchmarks that print ratios against a baseline measured in the same run."""

from __future__ import annotations

from collections.abc import Callable


def _model(args: list[str]) -> None:
    from nemo_gym_prorl.bench.model import main

    main(args)


BENCHMARKS: dict[str, Callable[[list[str]], None]] = {"model": _model}


def run_benchmark(name: str, args: list[str]) -> None:
    if name not in BENCHMARKS:
        raise ValueError(f"unknown benchmark {name!r}; known: {', '.join(BENCHMARKS)}")
    BENCHMARKS[name](args)
