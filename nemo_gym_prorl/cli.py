"""`prorl`: rollout | serve | bench | image.

`rollout` and `serve` are Hydra apps over `conf/` (`config.yaml`, `serve.yaml`; groups task/, model/, sandbox/,
service/) with all of Hydra's command line: `--help`, `--cfg job`, `-m` sweeps, `--config-dir`, `hydra.searchpath`,
a folder per run holding Hydra's record of it and the resolved config beside the results. Whatever stops a command
(bad input, or something it needs that cannot start) is one line on stderr and a non-zero exit: 2 for what the user
asked, 1 for what failed. `HYDRA_FULL_ERROR=1`, as for any Hydra app, shows the traceback instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.resources
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import hydra
import yaml
from hydra.core.hydra_config import HydraConfig
from hydra.errors import HydraException, MissingConfigException
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException
from pydantic import BaseModel, ValidationError

from nemo_gym_prorl.envs.task import TASKS_DIR, TaskConfig, TaskConfigError, load_task, task_path

# In a checkout nemo_gym_prorl/conf links to the top-level conf/; a wheel carries a copy.
CONF_DIR = Path(str(importlib.resources.files("nemo_gym_prorl") / "conf"))
FULL_ERROR_ENV = "HYDRA_FULL_ERROR"

USAGE = """usage: prorl COMMAND [options] [key=value ...]

commands:
  rollout   run rollouts with the configured task, model and sandbox, e.g.
            prorl rollout task=math model=local sandbox=bwrap n_samples=4 limit=8
            (service.url=http://host:8100 sends the jobs to a running `prorl serve` instead)
  reverify  grade stored rollouts again with the current graders and print what changed, e.g.
            prorl reverify outputs/rollout/.../rollouts.jsonl [task=math] [+verifier.KEY=VALUE] [output=PATH]
  serve     the rollout service over HTTP (conf/serve.yaml), e.g. prorl serve service.port=8100
  bench     benchmarks: prorl bench model | pipeline | scale | throughput | tools | sandbox
  image     sandbox images: prorl image build [--sif]  (a Debian rootfs from the host's apt sources, cached)
  view      the rollout viewer in the browser: prorl view outputs/rollout/.../rollouts.jsonl [--port 8300]
  data      NeMo RL datasets: prorl data export task=math/arithmetic split=train|validation output=FILE.jsonl

`prorl rollout --help` / `prorl serve --help`: config groups and options (Hydra: --cfg job, -m, --config-dir).
Errors are one line; HYDRA_FULL_ERROR=1 shows the traceback.
"""

Config = TypeVar("Config", bound=BaseModel)


class UsageError(Exception):
    """What the user asked for cannot be run; the message is the one line shown."""


def _config_error_line(error: Exception) -> str:
    """One line for Hydra's and OmegaConf's errors about the configuration asked for."""
    if isinstance(error, MissingConfigException) and error.missing_cfg_file:
        group, _, name = error.missing_cfg_file.partition("/")
        known = f"; known: {', '.join(error.options)}" if error.options else ""
        return f"unknown {group} {name!r}{known}"
    lines = [" ".join(line.split()) for line in str(error).splitlines() if line.strip()]
    return " ".join(lines[:2]) if lines else type(error).__name__  # Hydra's second line is its hint (+key=value)


def _validated(model: type[Config], cfg: DictConfig) -> Config:
    try:
        return model.model_validate(OmegaConf.to_container(cfg, resolve=True))
    except OmegaConfBaseException as e:
        raise UsageError(_config_error_line(e)) from None
    except ValidationError as e:
        first = e.errors()[0]
        field = ".".join(str(p) for p in first["loc"])
        raise UsageError(f"invalid {field}={first.get('input')!r}: {first['msg']}") from None


def user_task_dirs() -> list[Path]:
    """`DIR/tasks` of each folder the user put on Hydra's config search path (`--config-dir`, `hydra.searchpath`)."""
    folders = []
    for source in HydraConfig.get().runtime.config_sources:
        if source.schema == "file" and source.provider not in ("main", "hydra"):
            tasks = Path(source.path) / "tasks"
            if tasks.is_dir():
                folders.append(tasks)
    return folders


def locate_task(name: str, search_dirs: list[Path]) -> tuple[str, TaskConfig]:
    """The name to run `name` by anywhere (a user's task: its YAML's path) and the task, checked."""
    path = task_path(name, search_dirs)
    task = load_task(name, search_dirs)
    return (name if path.is_relative_to(TASKS_DIR) else str(path.resolve())), task


def resolved_config(command: str, config: BaseModel, tasks: list[TaskConfig]) -> str:
    """What made a run, resolved, as YAML: the command line, the composed config after interpolation and defaults,
    and each task YAML as loaded (so the record holds even if the task file changes later)."""
    hydra_config = HydraConfig.get()
    record = {
        "command": " ".join(["prorl", command, *hydra_config.overrides.task]),
        "config": config.model_dump(mode="json"),
        "tasks": [task.model_dump(mode="json") for task in tasks],
    }
    header = f"# the resolved configuration of a run (Hydra's record of it: {hydra_config.runtime.output_dir}/.hydra)\n"
    return header + yaml.safe_dump(record, sort_keys=False, allow_unicode=True)


def _in_own_folder(output: Path) -> None:
    """In a sweep every run writes its own file: an output outside the run's folder would be overwritten."""
    hydra_config = HydraConfig.get()
    if hydra_config.mode == RunMode.MULTIRUN and not output.resolve().is_relative_to(
        Path(hydra_config.runtime.output_dir).resolve()
    ):
        raise UsageError(
            f"output={output}: in a sweep (-m) each run writes into its own folder; leave output unset "
            "or start it with ${hydra:runtime.output_dir}/"
        )


def rollout(cfg: DictConfig) -> None:
    from nemo_gym_prorl.models.llama_log import route_llama_logs
    from nemo_gym_prorl.service.job import RolloutJobConfig, run_job
    from nemo_gym_prorl.service.report import RolloutReport
    from nemo_gym_prorl.startup import check_service_can_start

    config = _validated(RolloutJobConfig, cfg)
    config.task.name, task = locate_task(config.task.name, user_task_dirs())
    _in_own_folder(config.output)
    route_llama_logs()
    if config.service.url is None:  # the service runs in this process
        check_service_can_start(config.model, config.sandbox.backend, [task])
    report = RolloutReport(config.output, task.name, resolved_config("rollout", config, [task]))
    with report:
        asyncio.run(run_job(config, report))
    report.print_summary()


def serve(cfg: DictConfig) -> None:
    from nemo_gym_prorl.models.llama_log import route_llama_logs
    from nemo_gym_prorl.service.runtime import ServiceConfig
    from nemo_gym_prorl.service.serve import serve as serve_forever
    from nemo_gym_prorl.startup import check_port_free, check_service_can_start

    config = _validated(ServiceConfig, cfg)
    located = [locate_task(name, user_task_dirs()) for name in config.service.tasks]
    config.service.tasks = [name for name, _ in located]
    tasks = [task for _, task in located]
    route_llama_logs()
    check_port_free(config.service.host, config.service.port, "service.port")
    check_service_can_start(config.model, config.sandbox.backend, tasks)
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    (run_dir / "serve.config.yaml").write_text(resolved_config("serve", config, tasks))
    serve_forever(config)


class _RunFailed(BaseException):
    """Carries an error out of a Hydra run past Hydra, which would first print a line of its own about the run
    ("Error executing job with overrides: ..."); in a sweep the first failing run ends the sweep."""

    def __init__(self, error: Exception) -> None:
        super().__init__(error)
        self.error = error


def hydra_command(name: str, config_name: str, app: Callable[[DictConfig], None]) -> Callable[[list[str]], None]:
    """`prorl NAME ARGS...` as a Hydra app over conf/CONFIG_NAME.yaml: Hydra parses ARGS as its own command line."""

    def run(cfg: DictConfig) -> None:
        try:
            app(cfg)
        except Exception as e:
            raise _RunFailed(e) from e

    hydra_main = hydra.main(config_path=str(CONF_DIR), config_name=config_name, version_base="1.3")(run)

    def command(args: list[str]) -> None:
        with _hydra_argv([f"prorl {name}", *args]), _hydra_raises():
            try:
                hydra_main()
            except _RunFailed as failed:
                raise failed.error from None

    return command


@contextlib.contextmanager
def _hydra_argv(argv: list[str]) -> Iterator[None]:
    saved, sys.argv = sys.argv, argv
    try:
        yield
    finally:
        sys.argv = saved


@contextlib.contextmanager
def _hydra_raises() -> Iterator[None]:
    """Hydra prints an error it catches with a stack trace and a hint; told HYDRA_FULL_ERROR, it raises it instead,
    so `main` can show it as one line (or, when the user set the variable, as the full traceback)."""
    saved = os.environ.get(FULL_ERROR_ENV)
    os.environ[FULL_ERROR_ENV] = "1"
    try:
        yield
    finally:
        if saved is None:
            del os.environ[FULL_ERROR_ENV]
        else:
            os.environ[FULL_ERROR_ENV] = saved


def reverify(cfg: DictConfig) -> None:
    from nemo_gym_prorl.reverify import ReverifyConfig, ReverifyError, reverify_file, task_name, with_verifier
    from nemo_gym_prorl.service.job import TaskChoice

    config = _validated(ReverifyConfig, cfg)
    try:
        name = task_name(config)
        _in_own_folder(config.output)
        located, task = locate_task(name, user_task_dirs())
        config.task = TaskChoice(name=located)
        task = with_verifier(task, config.verifier)
        reverify_file(config, task, resolved_config("reverify", config, [task]))
    except ReverifyError as e:
        raise UsageError(str(e)) from None


rollout_command = hydra_command("rollout", "config", rollout)
serve_command = hydra_command("serve", "serve", serve)
_reverify_app = hydra_command("reverify", "reverify", reverify)


def reverify_command(args: list[str]) -> None:
    """`prorl reverify ROLLOUTS.jsonl [key=value ...]`: the file, first, is Hydra's `input=`."""
    if args and "=" not in args[0] and not args[0].startswith("-"):
        args = ["input='" + args[0].replace("'", "\\'") + "'", *args[1:]]
    _reverify_app(args)


def bench_command(args: list[str]) -> None:
    from nemo_gym_prorl.bench import BENCHMARKS, run_benchmark

    if not args or args[0] not in BENCHMARKS:
        raise UsageError(f"bench needs a benchmark name: {', '.join(BENCHMARKS)}")
    run_benchmark(args[0], args[1:])


def image_command(args: list[str]) -> None:
    from nemo_gym_prorl.sandbox import images

    if not args or args[0] != "build":
        raise UsageError("image needs a subcommand: build")
    images.main(args[1:])


def swe_command(args: list[str]) -> None:
    from nemo_gym_prorl.swe.command import swe_command as run

    run(args)


def data_command(args: list[str]) -> None:
    from nemo_gym_prorl.data_export import data_command as run

    run(args)


def view_command(args: list[str]) -> None:
    from nemo_gym_prorl.viewer.command import view
    from nemo_gym_prorl.viewer.sources import RolloutFileError

    try:
        view(args)
    except RolloutFileError as e:
        raise UsageError(str(e)) from None


COMMANDS = {"rollout": rollout_command, "serve": serve_command, "bench": bench_command, "image": image_command,
            "swe": swe_command, "data": data_command, "reverify": reverify_command, "view": view_command}


def error_line(error: Exception) -> tuple[str, int]:
    """The one line shown for `error`, and the exit status: 2 for what the user asked, 1 for what failed."""
    from nemo_gym_prorl.models.launcher import ModelServerError
    from nemo_gym_prorl.startup import StartupError

    if isinstance(error, (UsageError, TaskConfigError)):
        return str(error), 2
    if isinstance(error, (HydraException, OmegaConfBaseException)):
        return _config_error_line(error), 2
    if isinstance(error, (StartupError, ModelServerError)):
        return str(error), 1
    lines = [line for line in str(error).splitlines() if line.strip()]
    detail = f"{type(error).__name__}: {' '.join(lines[0].split())}" if lines else type(error).__name__
    return f"{detail} ({FULL_ERROR_ENV}=1 shows the traceback)", 1


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
    except KeyboardInterrupt:
        print("prorl: interrupted", file=sys.stderr)
        raise SystemExit(130) from None
    except Exception as e:
        if os.environ.get(FULL_ERROR_ENV) == "1":
            raise
        line, status = error_line(e)
        print(f"prorl: error: {line}", file=sys.stderr)
        raise SystemExit(status) from None


if __name__ == "__main__":
    main()
