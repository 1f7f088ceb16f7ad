"""`prorl bench NAME`: benchmarks that print ratios against a baseline measured in the same run."""

from __future__ import annotations

import signal
from collections.abc import Callable


def _lazy(module: str) -> Callable[[list[str]], None]:
    """Benchmarks import heavy things; only the one asked for is loaded."""

    def run(args: list[str]) -> None:
        import importlib

        importlib.import_module(f"nemo_gym_prorl.bench.{module}").main(args)

    return run


_MODULES = {name: name for name in ("model", "pipeline", "scale", "tools", "sandbox", "throughput", "swe", "code", "harness")}
BENCHMARKS: dict[str, Callable[[list[str]], None]] = {
    name: _lazy(module) for name, module in (_MODULES | {"viewer": "viewer", "train": "train", "async": "async_rl"}).items()
}


def _interrupt(signum: int, frame: object) -> None:
    signal.raise_signal(signal.SIGINT)


def run_benchmark(name: str, args: list[str]) -> None:
    if name not in BENCHMARKS:
        raise ValueError(f"unknown benchmark {name!r}; known: {', '.join(BENCHMARKS)}")
    # SIGTERM stops a benchmark as Ctrl-C does: asyncio cancels it, and the servers, model processes and sandboxes
    # it started (each in a session of its own, out of reach of the terminal's signals) are stopped on the way out.
    signal.signal(signal.SIGTERM, _interrupt)
    BENCHMARKS[name](args)
