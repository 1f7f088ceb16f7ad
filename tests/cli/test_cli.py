"""`prorl` as a user runs it (the installed entry point): a real rollout end to end; Hydra's command line (--help,
--cfg job, -m sweeps, --config-dir with the user's own tasks, a folder per run with its resolved config); bad input
and anything that cannot start stopped at once with one clear line."""

from __future__ import annotations

import contextlib
import os
import re
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
import yaml
from standin_helpers import running_standin

from nemo_gym_prorl.contracts.trajectory import TOKEN_FIELDS, Trajectory, contiguity_violation

PRORL = [str(Path(sys.executable).with_name("prorl"))]  # the console script pip installed


def prorl(*args: str, timeout: float = 60, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*PRORL, *args], capture_output=True, text=True, timeout=timeout, cwd=cwd)


def test_rollout_writes_token_faithful_trajectories_graded_by_math_verify(tmp_path: Path) -> None:
    output = tmp_path / "rollouts.jsonl"
    result = prorl(
        "rollout", "task=math", "model=local", "sandbox=bwrap", "n_samples=2", "limit=2", "concurrency=4",
        "sampling.max_tokens=96", "model.n_ctx=4096", "progress_interval_s=0.2", f"output={output}", timeout=400,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "mean reward" in result.stdout and "tool calls run" in result.stdout
    trajectories = [Trajectory.model_validate_json(line) for line in output.read_text().splitlines()]
    assert len(trajectories) == 4
    assert sorted(t.instance_id for t in trajectories) == ["arith-000", "arith-000", "arith-001", "arith-001"]
    for t in trajectories:
        assert t.critical_error is None, t.error
        turns = t.assistant_turns()
        assert turns and contiguity_violation(turns) is None
        assert all(all(field in turn for field in TOKEN_FIELDS) for turn in turns)
        assert all(len(turn["generation_token_ids"]) <= 96 for turn in turns)
        assert t.reward in (0.0, 1.0) and t.evaluation["reason"] in (
            "correct", "wrong answer", "unparseable answer", "no answer submitted"
        )
        assert t.timing.init > 0 and t.timing.run > 0
    # the resolved config beside the results, and a terminal with nothing but the progress bar
    record = yaml.safe_load((tmp_path / "rollouts.config.yaml").read_text())
    assert record["config"]["n_samples"] == 2 and record["config"]["sampling"]["max_tokens"] == 96
    assert record["tasks"][0]["name"] == "math/arithmetic"
    assert all(line.startswith("rollouts:") for line in result.stderr.replace("\r", "\n").splitlines() if line)
    assert "rollouts: 0rollout" not in result.stderr  # the bar never draws before it knows its total
    # progress inside the rollouts, before any finished; the bar's last count is every turn of the run
    bar = result.stderr.replace("\r", "\n").splitlines()
    assert any(" 0/4 " in line and "turns=" in line and "tok/s=" in line for line in bar), bar[:10]
    last_turns = [line.split("turns=")[1].split(",")[0] for line in bar if "turns=" in line][-1]
    assert int(last_turns) == sum(len(t.assistant_turns()) for t in trajectories)
    # the two samples of an instance share their first prompt (GRPO groups need that) but not their seed
    first_prompts = {t.instance_id: [] for t in trajectories}
    for t in trajectories:
        first_prompts[t.instance_id].append(t.assistant_turns()[0]["prompt_token_ids"])
    assert all(a == b for a, b in first_prompts.values())


# The stand-in model answers every turn with the right answer to the user's task below (instant, deterministic).
@pytest.fixture(scope="module")
def standin_model() -> Iterator[list[str]]:
    for url in running_standin(["\\boxed{2}"]):
        model = ["model=remote", f"model.addresses=[{url}]", "model.served_model_name=standin"]
        yield [*model, "model.tool_call_format=codeact", "limit=1"]


@pytest.mark.parametrize(("command", "groups", "options"), [
    ("rollout", {"task": "math", "model": "remote", "sandbox": "apptainer"}, ["n_samples: 1", "max_tokens: 384"]),
    ("serve", {"model": "local", "sandbox": "bwrap", "service": "default"}, ["port: 8100", "recovery: requeue"]),
])  # fmt: skip
def test_help_lists_config_groups_and_options(command: str, groups: dict[str, str], options: list[str]) -> None:
    result = prorl(command, "--help")
    assert result.returncode == 0, result.stderr
    assert "== Configuration groups ==" in result.stdout and f"usage: prorl {command}" in result.stdout
    listed = dict(line.split(": ", 1) for line in result.stdout.split("== Config ==")[0].splitlines() if ": " in line)
    assert all(option in listed.get(group, "").split(", ") for group, option in groups.items()), result.stdout
    assert all(option in result.stdout for option in options), result.stdout
    assert "grpo" not in listed, result.stdout  # NeMo RL's recipes are not a config group of ours
    # a task folder's options are the task group's (task=code/humaneval), not a group inviting task/code=humaneval
    assert "code/humaneval" in listed["task"].split(", ") and not [g for g in listed if "/" in g], result.stdout


HEAVY = ["nemo_gym", "nemo_gym_prorl.envs.base", "nemo_gym_prorl.tools", "nemo_gym_prorl.launch.job", "swebench"]


@pytest.mark.parametrize("args", [["--help"], ["rollout", "--help"], ["rollout", "task=nope"], ["data", "--help"]])
def test_help_and_errors_import_only_what_they_need(args: list[str], tmp_path: Path) -> None:
    """Help and a bad override answer without importing the environments, tools, service or NeMo Gym (seconds)."""
    program = "import sys; sys.argv[0] = 'prorl'; from nemo_gym_prorl.cli import main; main()"
    result = subprocess.run([sys.executable, "-X", "importtime", "-c", program, *args], capture_output=True,
                            text=True, timeout=60, cwd=tmp_path)  # fmt: skip
    imported = {line.split("|")[-1].strip() for line in result.stderr.splitlines() if line.startswith("import time:")}
    assert result.returncode == (2 if "task=nope" in args else 0), result.stderr[-2000:]
    assert imported and [module for module in HEAVY if module in imported] == [], result.stderr[-2000:]


def test_cfg_job_prints_the_composed_config_and_runs_nothing(tmp_path: Path) -> None:
    result = prorl("rollout", "--cfg", "job", "model=remote", "n_samples=3", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    config = yaml.safe_load(result.stdout)
    assert config["n_samples"] == 3 and config["model"]["kind"] == "remote" and config["task"]["name"]
    assert not (tmp_path / "outputs").exists()


def test_sweep_writes_each_run_with_its_resolved_config(standin_model: list[str], tmp_path: Path) -> None:
    result = prorl("rollout", "-m", "seed=3,4", *standin_model, cwd=tmp_path, timeout=180)
    assert result.returncode == 0, result.stderr[-2000:]
    results = sorted((tmp_path / "outputs/rollout/multirun").glob("*/*/*/rollouts.jsonl"))
    assert len(results) == 2, result.stdout
    for rollouts in results:
        record = yaml.safe_load(rollouts.with_name("rollouts.config.yaml").read_text())
        assert record["config"]["output"] == str(rollouts.resolve())  # interpolations resolved
        seed = record["config"]["seed"]
        assert f" seed={seed} " in f"{record['command']} " and (rollouts.parent / ".hydra/config.yaml").is_file()
        [trajectory] = [Trajectory.model_validate_json(line) for line in rollouts.read_text().splitlines()]
        assert trajectory.critical_error is None, trajectory.error
    seeds = [yaml.safe_load(r.with_name("rollouts.config.yaml").read_text())["config"]["seed"] for r in results]
    assert sorted(seeds) == [3, 4]
    roll_up = result.stdout.split("prorl rollout -m: 2 runs")[1]  # after the sweep: a row per run, its file whole
    assert all(f"seed={seed}" in roll_up for seed in (3, 4)) and "mean reward" in roll_up, result.stdout
    assert all(f": {r.resolve()}\n" in roll_up for r in results), result.stdout


@pytest.mark.parametrize("how", ["--config-dir", "hydra.searchpath"])
def test_a_task_in_the_users_config_dir_runs(how: str, standin_model: list[str], tmp_path: Path) -> None:
    """`--config-dir DIR` or `hydra.searchpath=[file://DIR]`: DIR/task/mine.yaml picks the task,
    DIR/tasks/mine/easy.yaml is the task YAML, with data."""
    conf = tmp_path / "my_conf"
    (conf / "task").mkdir(parents=True)
    (conf / "task/mine.yaml").write_text("name: mine/easy\n")
    (conf / "tasks/mine").mkdir(parents=True)
    (conf / "tasks/mine/easy.jsonl").write_text('{"id": "easy-0", "question": "Calculate 1 + 1.", "answer": "2"}\n')
    (conf / "tasks/mine/easy.yaml").write_text(
        "name: mine/easy\ntype: math\ndataset: {path: easy.jsonl, id_key: id}\nprompt_template: '{question}'\n"
        "tools: [finish]\nmax_turns: 2\nverifier: {answer_key: answer}\n"
    )
    output = tmp_path / "mine.jsonl"
    user_dir = ["--config-dir", str(conf)] if how == "--config-dir" else [f"hydra.searchpath=[file://{conf}]"]
    result = prorl("rollout", *user_dir, "task=mine", *standin_model, f"output={output}", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    [trajectory] = [Trajectory.model_validate_json(line) for line in output.read_text().splitlines()]
    assert trajectory.instance_id == "easy-0" and trajectory.reward == 1.0, trajectory.evaluation
    record = yaml.safe_load((tmp_path / "mine.config.yaml").read_text())
    assert record["tasks"][0]["dataset"]["path"] == str((conf / "tasks/mine/easy.jsonl").resolve())


@pytest.fixture
def busy_port() -> Iterator[int]:
    with socket.create_server(("127.0.0.1", 0)) as sock:
        yield sock.getsockname()[1]


@pytest.mark.parametrize(
    ("command", "args", "message"),
    [
        ("rollout", ["model.gguf=/no/such/file.gguf"], "model.gguf=/no/such/file.gguf is not a file"),
        ("rollout", ["model.gguf={not_a_gguf}"], "the model server exited with code 1 before it was ready: "),
        ("serve", ["service.port={busy_port}"], "service.port={busy_port}: port {busy_port} on 127.0.0.1 is"),
        ("rollout", ["model.port={busy_port}"], "model.port={busy_port}: port {busy_port} on 127.0.0.1 is"),
        ("rollout", ["sandbox.backend=docker"], "unknown sandbox backend 'docker'"),
        ("serve", ["sandbox.backend=gym:nope"], "the gym:nope sandbox backend cannot start a sandbox: "),
        ("rollout", ["task.name={gym_task}"], "its NeMo Gym resources server http://127.0.0.1:{closed_port} does not"),
    ],
    ids=[
        "missing-gguf", "not-a-gguf", "service-port-busy", "model-port-busy", "unknown-backend", "unknown-gym-provider",
        "gym-server-down",
    ],
)
def test_what_cannot_start_is_one_line_naming_it(
    command: str, args: list[str], message: str, busy_port: int, tmp_path: Path
) -> None:
    with socket.create_server(("127.0.0.1", 0)) as sock:
        closed_port = sock.getsockname()[1]  # nothing listens there once closed
    (tmp_path / "junk.gguf").write_bytes(b"not a model")
    (tmp_path / "rows.jsonl").write_text('{"id": "r0", "responses_create_params": {"input": "Hi."}}\n')
    (tmp_path / "gym.yaml").write_text(
        f"name: down\ntype: gym\ndataset: {{path: rows.jsonl}}\nresources_server_url: http://127.0.0.1:{closed_port}\n"
    )
    values = {"busy_port": busy_port, "closed_port": closed_port, "not_a_gguf": tmp_path / "junk.gguf"}
    values["gym_task"] = tmp_path / "gym.yaml"
    cheap = "service.store=:memory:" if command == "serve" else "limit=1"
    result = prorl(command, *(a.format(**values) for a in args), cheap, cwd=tmp_path, timeout=120)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 1 and len(lines) == 1 and lines[0].startswith("prorl: error: "), result.stderr
    assert message.format(**values) in lines[0] and ("already in use" in lines[0]) == ("busy" in str(args))
    assert not list(tmp_path.glob("outputs/**/*.jsonl"))


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["task=nope"], "unknown task 'nope'; known: "),
        (["model=gpt5"], "unknown model 'gpt5'; known: local"),
        (["sandbox=docker"], "unknown sandbox 'docker'; known: apptainer, bwrap"),
        (["n_samples=four"], "invalid n_samples='four'"),
        (["limit=0"], "invalid limit=0"),
        (["-m", "seed=0,1"], "in a sweep (-m) each run writes into its own folder"),  # or runs overwrite each other
    ],
)
def test_bad_overrides_stop_at_once_with_one_line(args: list[str], message: str, tmp_path: Path) -> None:
    result = prorl("rollout", *args, f"output={tmp_path / 'out.jsonl'}", cwd=tmp_path)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and lines[0].startswith("prorl: error: ")
    assert message in lines[0]
    assert not (tmp_path / "out.jsonl").exists()


@pytest.mark.parametrize(
    ("yaml_text", "message"),
    [
        ("name: x\ntype: math\ndataset: {path: missing.jsonl}\nprompt_template: '{q}'\ntools: [bash]\n", "field 'dataset.path': no file"),
        ("name: x\ntype: stem\ndataset: {path: d.jsonl}\nverifier: {rel_tl: 0.02}\n", "field 'verifier.rel_tl': unknown key"),
        ("name: x\n  type: [math\n", "is not valid YAML at line 2"),
        ("name: x\ntype: chess\ndataset: {path: d.jsonl}\nprompt_template: q\ntools: []\n", "field 'type'"),
    ],
)
def test_bad_task_files_stop_at_once_naming_the_problem(yaml_text: str, message: str, tmp_path: Path) -> None:
    task = tmp_path / "task.yaml"
    task.write_text(yaml_text)
    (tmp_path / "d.jsonl").write_text('{"question": "Calculate 1 + 1.", "answer": "2"}\n')
    result = prorl("rollout", f"task.name={task}", f"output={tmp_path / 'out.jsonl'}", cwd=tmp_path)
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1
    assert message in result.stderr


def test_unknown_command_and_help() -> None:
    assert "usage: prorl" in prorl("--help").stdout
    result = prorl("fly")
    assert result.returncode == 2 and "unknown command 'fly'" in result.stderr


def test_pipeline_benchmark_runs_and_ends_with_its_ratio() -> None:
    result = prorl("bench", "pipeline", "--rollouts", "12", "--rounds", "1", timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().splitlines()[-1].startswith("ratio pipeline/naive: ")


def test_unknown_benchmark_names_the_known_ones() -> None:
    result = prorl("bench", "warp")
    assert result.returncode == 2 and "model, pipeline, scale" in result.stderr


def still_running(procs: list[psutil.Process], within_s: float) -> list[psutil.Process]:
    """Those of `procs` that have not exited within `within_s` (a zombie has exited: nobody here may reap it)."""
    deadline = time.monotonic() + within_s
    for proc in procs:
        with contextlib.suppress(ProcessLookupError), closing_fd(os.pidfd_open(proc.pid)) as pidfd:
            select.select([pidfd], [], [], max(0.0, deadline - time.monotonic()))  # readable once it has exited
    return [p for p in procs if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


@contextlib.contextmanager
def closing_fd(fd: int) -> Iterator[int]:
    try:
        yield fd
    finally:
        os.close(fd)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("stop", "within_s"),
    [
        (signal.SIGTERM, 0),  # the benchmark stops them itself before it exits
        (signal.SIGKILL, 60),  # no cleanup runs: the kernel tells each server its parent died, and they stop
    ],
    ids=["SIGTERM", "SIGKILL"],
)
def test_a_benchmark_stopped_or_killed_leaves_no_process_behind(stop: signal.Signals, within_s: float) -> None:
    """The throughput benchmark starts the most: a stand-in model, `gym env start` with its servers and Ray."""
    bench = subprocess.Popen(
        [*PRORL, "bench", "throughput", "--levels", "8", "--warmup", "0", "--min-rollouts", "8"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    assert bench.stdout is not None
    try:
        for line in bench.stdout:
            if line.startswith("gym env up"):
                break
        else:
            pytest.fail(f"the benchmark ended before its servers were up (exit {bench.wait()})")
        started = psutil.Process(bench.pid).children(recursive=True)
        assert len(started) >= 5  # the model, gym env start, its four servers
        bench.send_signal(stop)
        bench.communicate(timeout=120)
    finally:
        bench.kill()
    alive = still_running(started, within_s)
    assert not alive, [" ".join(p.cmdline())[:200] for p in alive]


def read_until(stream: int, pattern: str, proc: subprocess.Popen[bytes], limit_s: float) -> str:
    """What `proc` wrote on `stream` (a raw fd: tqdm redraws with \\r, not lines) up to the first match of `pattern`."""
    seen, deadline = "", time.monotonic() + limit_s
    while not re.search(pattern, seen):
        ready, _, _ = select.select([stream], [], [], max(0.0, deadline - time.monotonic()))
        chunk = os.read(stream, 65536) if ready else b""
        if not chunk:
            pytest.fail(f"no {pattern!r} within {limit_s} s (exit {proc.poll()}): {seen[-2000:]}")
        seen += chunk.decode(errors="replace")
    return seen


@pytest.mark.slow
@pytest.mark.parametrize(
    ("stop", "within_s"),
    [
        (signal.SIGTERM, 0),  # the command stops them itself before it exits
        (signal.SIGINT, 0),  # Ctrl-C: the same
        (signal.SIGKILL, 30),  # no cleanup runs: the kernel tells each child its parent died, and they stop
    ],
    ids=["SIGTERM", "SIGINT", "SIGKILL"],
)
def test_a_rollout_stopped_mid_generation_leaves_no_process_behind(
    tmp_path: Path, stop: signal.Signals, within_s: float
) -> None:
    """`prorl rollout` with the embedded model and bubblewrap, signalled (itself only, as `kill PID` does) once the
    model has answered a turn and is generating the next: the model server and every sandbox go with it, and
    where it had the chance to clean up, the sandboxes' folders too."""
    scratch = Path(tempfile.mkdtemp(prefix="prorl-test-tmpdir-"))  # not under tmp_path: the sandbox's uid reads it
    scratch.chmod(0o755)
    rollout = subprocess.Popen(
        [*PRORL, "rollout", "task=math", "model=local", "sandbox=bwrap", "n_samples=2", "limit=2", "concurrency=4",
         "sampling.max_tokens=512", "model.n_ctx=4096", "progress_interval_s=0.1", f"output={tmp_path / 'r.jsonl'}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=tmp_path, env={**os.environ, "TMPDIR": str(scratch)},
    )  # fmt: skip
    assert rollout.stderr is not None
    try:
        read_until(rollout.stderr.fileno(), r"turns=[1-9]", rollout, limit_s=300)
        assert list(scratch.glob("prorl-sbx-*"))
        started = psutil.Process(rollout.pid).children(recursive=True)
        commands = [" ".join(p.cmdline()) for p in started]
        assert any("bwrap" in c for c in commands), commands  # sandboxes are open
        assert any("nemo_gym_prorl.models.server" in c for c in commands), commands  # and the model server runs
        rollout.send_signal(stop)
        rollout.communicate(timeout=120)
    finally:
        rollout.kill()
    assert rollout.returncode != 0  # a stopped run does not claim success
    alive = still_running(started, within_s)
    assert not alive, [" ".join(p.cmdline())[:200] for p in alive]
    if stop != signal.SIGKILL:  # after a SIGKILL the next start sweeps them (test_sandbox_leaks)
        assert not list(scratch.glob("prorl-sbx-*"))
    shutil.rmtree(scratch)


def test_an_image_build_that_fails_exits_non_zero(tmp_path: Path) -> None:
    env = {**os.environ, "PRORL_IMAGE_CACHE": str(tmp_path)}
    result = subprocess.run([*PRORL, "image", "build", "--suite", "no-such-suite"], capture_output=True, text=True,
                            timeout=300, env=env)  # fmt: skip
    assert result.returncode == 1 and "error: " in result.stderr, result.stderr[-2000:]
