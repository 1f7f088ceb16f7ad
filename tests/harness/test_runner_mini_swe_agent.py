"""mini-swe-agent, installed from PyPI into a cached layer and run unmodified in a bubblewrap sandbox, solves an
offline SWE instance against the stand-in model (mini-swe-agent's action format, deterministically) through the
per-rollout proxy, in the service's rollout pipeline (init, run, eval as for our loop): every call it made is in
the trajectory with token ids and log-probs, the patch it left is graded by the SWE env, and a harness that crashes
or hangs is a critical_error with its reason; its proxy is gone with its sandbox."""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from standin_helpers import MINI_SWE_AGENT_SCRIPT, running_standin

from nemo_gym_prorl.agent.loop import AgentLoop
from nemo_gym_prorl.agent.turns import http_poster, turn_generator
from nemo_gym_prorl.contracts.sampling import SamplingParams
from nemo_gym_prorl.contracts.task import TaskConfig, load_task
from nemo_gym_prorl.contracts.trajectory import TOKEN_FIELDS, Trajectory, contiguity_violation
from nemo_gym_prorl.envs import make_environment
from nemo_gym_prorl.envs.dataset import load_instances
from nemo_gym_prorl.envs.swe.env import SweEnvironment
from nemo_gym_prorl.harness.calls import ModelCalls
from nemo_gym_prorl.harness.proxy import ModelProxy, ProxyConfig
from nemo_gym_prorl.harness.runner import HarnessRunner
from nemo_gym_prorl.json_http import JsonHttp
from nemo_gym_prorl.models.tokenizer import Tokenizer
from nemo_gym_prorl.service.pipeline import PipelineConfig, Rollout, run_rollouts
from nemo_gym_prorl.tool_calls import tool_call_format

TASK = "swe/offline_mini_swe_agent_harness"
SAMPLING = SamplingParams(temperature=0.7, max_tokens=256, seed=3)


@pytest.fixture(scope="module")
def mini_model() -> Iterator[str]:
    yield from running_standin(MINI_SWE_AGENT_SCRIPT)


@pytest.fixture(scope="module")
def env(rootfs: Path) -> SweEnvironment:
    env = make_environment(load_task(TASK), "bwrap")
    assert isinstance(env, SweEnvironment)
    return env


@pytest.fixture
async def http() -> AsyncIterator[JsonHttp]:
    client = JsonHttp()
    try:
        yield client
    finally:
        await client.aclose()


def runner(env: SweEnvironment, base_url: str, http: JsonHttp, tokenizer: Tokenizer) -> HarnessRunner:
    assert env.task.harness is not None
    return HarnessRunner(env.task.harness, ModelCalls(http_poster(http, base_url), "standin", tokenizer, SAMPLING))


async def rollout(env: SweEnvironment, harness: HarnessRunner, **deadlines: float) -> Trajectory:
    """One rollout of the suite's first instance through a pipeline of its own; no proxy is left once it ends."""
    sockets: list[Path] = []
    start = ModelProxy.start

    async def started(proxy: ModelProxy) -> None:
        await start(proxy)
        sockets.append(proxy.socket_path)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ModelProxy, "start", started)
        (trajectory,) = await run_rollouts(
            [Rollout(env=env, agent=harness, instance=load_instances(env.task.dataset, limit=1)[0],
                     stage_deadlines_s=deadlines)],  # fmt: skip
            PipelineConfig(),
        )
    assert len(sockets) == 1 and not sockets[0].parent.parent.exists()
    return trajectory


@pytest.mark.parametrize("backend", ["bwrap", "apptainer"])
async def test_mini_swe_agent_finishes_an_offline_swe_rollout_with_every_call_in_the_trajectory(
    backend: str, request: pytest.FixtureRequest, mini_model: str, http: JsonHttp, tokenizer: Tokenizer
) -> None:
    task = load_task(TASK)
    if backend == "apptainer":  # the episode and its grading on the SIF of the same image
        request.getfixturevalue("sif")
        task.verifier = task.verifier | {"image": "default-sif"}
    env = make_environment(task, backend)
    assert isinstance(env, SweEnvironment)
    instance = load_instances(env.task.dataset, limit=1)[0]
    run = runner(env, mini_model, http, tokenizer)
    trajectory = await rollout(env, run)
    assert trajectory.critical_error is None, trajectory.error
    assert trajectory.finish == "finish"
    assert "harness_was_here.txt" in (trajectory.submission or {}).get("patch", "")
    recorded = run.calls.calls
    assert len(recorded) == 2  # mini's two actions, each one model call
    turns = [turn for segment in trajectory.segments for turn in segment]
    assert len(turns) == 2 and all(contiguity_violation(s) is None for s in trajectory.segments)
    for turn, call in zip(turns, recorded, strict=True):
        assert all(turn[field] for field in TOKEN_FIELDS)
        assert turn["generation_token_ids"] == call.turn.generation_token_ids
        assert len(turn["generation_log_probs"]) == len(turn["generation_token_ids"])
    assert recorded[0].messages[-1]["content"].startswith(env.first_prompt(instance)[-1]["content"][:40])
    assert trajectory.mask_reason() is None


def broken(task: TaskConfig, command: list[str], timeout_s: float) -> SweEnvironment:
    assert task.harness is not None
    harness = task.harness.model_copy(update={"command": command, "timeout_s": timeout_s})
    env = make_environment(task.model_copy(update={"harness": harness}), "bwrap")
    assert isinstance(env, SweEnvironment)
    return env


@pytest.mark.parametrize(
    ("command", "timeout_s", "critical", "reason"),
    [
        (
            ["python3", "-c", "import sys; print('boom'); sys.exit(3)"],
            60.0,
            "run",
            "exited 3; output ends: 'boom",
        ),
        (["sleep", "600"], 2.0, "timeout", "no exit within 2 s (it was stopped)"),
    ],
)
async def test_a_harness_that_crashes_or_hangs_is_a_masked_critical_error_with_its_reason(
    env: SweEnvironment, mini_model: str, http: JsonHttp, tokenizer: Tokenizer,
    command: list[str], timeout_s: float, critical: str, reason: str,
) -> None:  # fmt: skip
    failing = broken(env.task, command, timeout_s)
    trajectory = await rollout(failing, runner(failing, mini_model, http, tokenizer))
    assert trajectory.critical_error == critical
    assert (trajectory.error or "").startswith(f"harness mini-swe-agent: {reason}"), trajectory.error
    assert trajectory.mask_reason() is not None
    assert trajectory.reward == 0.0
    assert not running(command)  # no harness process outlives its rollout


async def test_a_harness_the_pipeline_stops_at_its_run_deadline_leaves_no_process_and_no_proxy(
    env: SweEnvironment, mini_model: str, http: JsonHttp, tokenizer: Tokenizer
) -> None:
    command = ["sleep", "601"]
    hanging = broken(env.task, command, 600.0)  # its own limit far off: the pipeline's cancel stops it
    trajectory = await rollout(hanging, runner(hanging, mini_model, http, tokenizer), run=2.0)
    assert trajectory.critical_error == "timeout"
    assert trajectory.error == "the run stage ran past its deadline of 2 s"
    assert not running(command)


async def test_a_harness_whose_init_fails_gets_a_masked_first_turn_alone_for_nemo_rl(
    env: SweEnvironment, mini_model: str, http: JsonHttp, tokenizer: Tokenizer
) -> None:
    """NeMo RL ends a training step on a result without generated tokens: a harness rollout that never started
    (its forwarder could not run) comes back as an init failure with our loop's first turn alone, masked."""
    assert env.task.harness is not None
    calls = ModelCalls(http_poster(http, mini_model), "standin", tokenizer, SAMPLING)
    harness = HarnessRunner(env.task.harness, calls, ProxyConfig(python="no-such-python3", forwarder_start_s=5))
    generator = turn_generator("tokens", http_poster(http, mini_model), "standin", SAMPLING, tokenizer)
    first = AgentLoop(generator, tool_call_format("codeact"), 1)
    instance = load_instances(env.task.dataset, limit=1)[0]
    rollout = Rollout(env=env, agent=harness, instance=instance, first_turn_agent=first)
    (trajectory,) = await run_rollouts([rollout], PipelineConfig())
    assert trajectory.critical_error == "init" and "forwarder" in (trajectory.error or ""), trajectory.error
    (turn,) = trajectory.assistant_turns()
    assert turn["mask"] and turn["first_turn_only"] and turn["generation_token_ids"]
    assert trajectory.mask_reason() is not None and harness._proxy is None


def running(command: list[str]) -> list[int]:
    """The host's processes running `command` (a sandbox's processes are the host's too, in their own namespace)."""
    wanted = "\0".join(command).encode()
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError):
            if Path(f"/proc/{pid}/cmdline").read_bytes().rstrip(b"\0") == wanted:
                found.append(int(pid))
    return found


# Run as the harness: the host's loopback listener is out of reach, the proxy (and through it the model) is not,
# and of the task's folder (the suite's rows and their gold patches) only the harness's config is bound in.
PROBE = """
import json, os, socket, sys, urllib.request
if os.listdir("/.prorl-harness-config") != ["mini_swe_agent.yaml"]:  # its config alone, not the task's folder
    sys.exit("the harness sees %s beside its config" % os.listdir("/.prorl-harness-config"))
try:
    socket.create_connection(("127.0.0.1", int(sys.argv[1])), timeout=5).close()
    sys.exit("reached the host's loopback listener")
except ConnectionRefusedError:
    pass
with urllib.request.urlopen(os.environ["OPENAI_BASE_URL"] + "/models", timeout=10) as answer:
    print(json.dumps([m["id"] for m in json.load(answer)["data"]]))
"""


async def test_the_harness_reaches_its_proxy_and_not_the_hosts_loopback(
    env: SweEnvironment, mini_model: str, http: JsonHttp, tokenizer: Tokenizer
) -> None:
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]
        probing = broken(env.task, ["python3", "-c", PROBE, str(port)], 60.0)
        trajectory = await rollout(probing, runner(probing, mini_model, http, tokenizer))
    assert (trajectory.critical_error, trajectory.error, trajectory.finish) == (None, None, "finish")
