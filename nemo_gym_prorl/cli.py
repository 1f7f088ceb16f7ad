"""`prorl`: rollout | bench.

Configuration is composed by Hydra from `conf/` (groups `task/`, `model/`, `sandbox/`) plus `key=value`
overrides. Any problem with what the user asked for stops the command at once with one line naming it.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra.errors import HydraException, MissingConfigException
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException
from pydantic import ValidationError

from nemo_gym_prorl.envs.task import TaskConfigError, load_task
from nemo_gym_prorl.swe.command import swe_command

CONF_DIR = Path(__file__).resolve().parents[1] / "conf"

USAGE = """usage: prorl COMMAND [key=value ...]

commands:
  rollout   run rollouts with the configured task, model and sandbox, e.g.
            prorl rollout task=math model=local sandbox=bwrap n_samples=4 limit=8 output=rollouts.jsonl
            (service.url=http://host:8100 sends the jobs to a running `prorl serve` instead)
  serve     the rollout service over HTTP (conf/serve.yaml), e.g. prorl serve service.port=8100
  bench     benchmarks: prorl bench model | pipeline | scale | throughput | tools | sandbox
  image     sandbox images: prorl image build [--sif]  (a Debian rootfs from the host's apt sources, cached)
"""


class UsageError(Exception):
    """What the user asked for cannot be run; the message is the one line shown."""


def compose_config(overrides: list[str], config_name: str = "config") -> dict:
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            cfg = compose(config_name=config_name, overrides=overrides)
        return OmegaConf.to_container(cfg, resolve=True)  # type: ignore[return-value]
    except MissingConfigException as e:
        group, _, name = (e.missing_cfg_file or "").partition("/")
        known = f"; known: {', '.join(e.options)}" if e.options else ""
        raise UsageError(f"unknown {group} {name!r}{known}") from None
    except (HydraException, OmegaConfBaseException) as e:
        raise UsageError(" ".join(str(e).split("\n")[0].split())) from None


def _validation_line(error: ValidationError) -> str:
    first = error.errors()[0]
    field = ".".join(str(p) for p in first["loc"])
    return f"invalid {field}={first.get('input')!r}: {first['msg']}"


def rollout_command(overrides: list[str]) -> None:
    from nemo_gym_prorl.service.job import RolloutJobConfig, run_job
    from nemo_gym_prorl.service.report import RolloutReport

    try:
        config = RolloutJobConfig.model_validate(compose_config(overrides))
    except ValidationError as e:
        raise UsageError(_validation_line(e)) from None
    task = load_task(config.task.name)  # fail on a bad task file before starting anything
    report = RolloutReport(config.output, task.name)
    with report:
        asyncio.run(run_job(config, report))
    report.print_summary()


def serve_command(overrides: list[str]) -> None:
    from nemo_gym_prorl.service.serve import serve
    from nemo_gym_prorl.service.runtime import ServiceConfig

    try:
        config = ServiceConfig.model_validate(compose_config(overrides, "serve"))
    except ValidationError as e:
        raise UsageError(_validation_line(e)) from None
    for name in config.service.tasks:
        load_task(name)  # fail on a bad task before starting anything
    serve(config)


def bench_command(args: list[str]) -> None:
    from nemo_gym_prorl.bench import run_benchmark

    from nemo_gym_prorl.bench import BENCHMARKS

    if not args or args[0] not in BENCHMARKS:
        raise UsageError(f"bench needs a benchmark name: {', '.join(BENCHMARKS)}")
    run_benchmark(args[0], args[1:])


def image_command(args: list[str]) -> None:
    from nemo_gym_prorl.sandbox import images

    if not args or args[0] != "build":
        raise UsageError("image needs a subcommand: build")
    images.main(args[1:])


COMMANDS = {"rollout": rollout_command, "serve": serve_command, "bench": bench_command, "image": image_command,
            "swe": swe_command}


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE)
        return
    command = COMMANDS.get(argv[0])
    try:
        if command is None:
            raise UsageError(f"unknown command {argv[0]!r}; commands: {', '.join(COMMANDS)}")
        command(argv[1:])
    except (UsageError, TaskConfigError, FileNotFoundError) as e:
        print(f"prorl: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
