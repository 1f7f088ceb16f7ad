"""OpenAI's Codex CLI, installed from npm into a cached layer (its static native binary: the image has no node) and
run unmodified in a bubblewrap sandbox, solves an offline SWE instance against the stand-in model through the
per-rollout proxy's Responses API, in the service's rollout pipeline: Codex's own apply_patch, sent as an
exec_command function call, leaves a patch the SWE env grades; both of Codex's calls are in the trajectory, one
contiguous segment with token ids and log-probs; the proxy's turn limit ends Codex as the policy's doing; no Codex
process outlives its rollout."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import pytest
from standin_helpers import running_standin

from nemo_gym_prorl.agent.turns import http_poster
from nemo_gym_prorl.contracts.sampling import SamplingParams
from nemo_gym_prorl.contracts.task import load_task
from nemo_gym_prorl.contracts.trajectory import (
    TOKEN_FIELDS,
    Trajectory,
    contiguity_violation,
)
from nemo_gym_prorl.envs import make_environment
from nemo_gym_prorl.envs.dataset import load_instances
from nemo_gym_prorl.envs.swe.env import SweEnvironment
from nemo_gym_prorl.harness.calls import ModelCalls
from nemo_gym_prorl.harness.runner import HarnessRunner
from nemo_gym_prorl.json_http import JsonHttp
from nemo_gym_prorl.models.tokenizer import Tokenizer
from nemo_gym_prorl.service.pipeline import PipelineConfig, Rollout, run_rollouts

TASK = "swe/offline_codex_harness"
SAMPLING = SamplingParams(temperature=0.7, max_tokens=256, seed=3)
PATCH = "*** Begin Patch\n*** Add File: harness_was_here.txt\n+fixed\n*** End Patch"
# The model's replies in the chat template's tool-call form (Hermes), which the proxy turns into a Responses
# function_call: Codex's shell tool running its apply_patch command, then a final message that ends `codex exec`.
SCRIPT = [
    "<tool_call>\n"
    + json.dumps({"name": "exec_command", "arguments": {"cmd": f"apply_patch <<'EOF'\n{PATCH}\nEOF"}})
    + "\n</tool_call>",
    "Done: harness_was_here.txt is added.",
]


@pytest.fixture(scope="module")
def codex_model() -> Iterator[str]:
    yield from running_standin(SCRIPT)


def codex_processes() -> list[int]:
    """The host's processes running `codex exec` (a sandbox's processes are the host's too)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError):
            if Path(f"/proc/{pid}/cmdline").read_bytes().startswith(b"codex\0exec\0"):
                found.append(int(pid))
    return found


class CodexRollout(NamedTuple):
    trajectory: Trajectory
    calls: ModelCalls
    prompt: str  # the task's prompt, as our own loop would send it


async def codex_rollout(model: str, tokenizer: Tokenizer, max_turns: int | None = None) -> CodexRollout:
    """One rollout of the suite's first instance by Codex (`max_turns`: the task's, unless given)."""
    task = load_task(TASK)
    assert task.harness is not None
    harness = task.harness.model_copy(update={"max_turns": max_turns or task.harness.max_turns})
    env = make_environment(task.model_copy(update={"harness": harness}), "bwrap")
    assert isinstance(env, SweEnvironment)
    instance = load_instances(task.dataset, limit=1)[0]
    http = JsonHttp()
    calls = ModelCalls(http_poster(http, model), "standin", tokenizer, SAMPLING)
    try:
        rollout = Rollout(env=env, agent=HarnessRunner(harness, calls), instance=instance)
        (trajectory,) = await run_rollouts([rollout], PipelineConfig())
    finally:
        await http.aclose()
    assert not codex_processes()
    return CodexRollout(trajectory, calls, env.first_prompt(instance)[-1]["content"])


async def test_codex_finishes_an_offline_swe_rollout_with_every_call_in_the_trajectory(
    rootfs: Path, codex_model: str, tokenizer: Tokenizer
) -> None:
    trajectory, calls, prompt = await codex_rollout(codex_model, tokenizer)
    assert trajectory.critical_error is None, trajectory.error
    assert trajectory.finish == "finish"
    patch = (trajectory.submission or {}).get("patch", "")
    assert "+++ b/harness_was_here.txt" in patch and "+fixed" in patch  # apply_patch's file, in the graded patch
    assert trajectory.evaluation and trajectory.evaluation.get("patch_bytes") == len(patch.encode())
    first, second = calls.calls
    assert {first.api, second.api} == {"responses"}
    assert first.reply["tool_calls"][0]["function"]["name"] == "exec_command"
    assert any(m["role"] == "user" and m["content"] == prompt for m in first.messages)  # after Codex's own context
    assert second.messages[-1]["role"] == "tool" and second.continues == first.index  # its output, appended
    assert first.harness_params.get("unserved_tools") is None  # the config leaves only tools the proxy serves
    (segment,) = trajectory.segments
    assert contiguity_violation(segment) is None and trajectory.mask_reason() is None
    for turn, call in zip(segment, calls.calls, strict=True):
        assert all(turn[field] for field in TOKEN_FIELDS)
        assert turn["generation_token_ids"] == call.turn.generation_token_ids
        assert len(turn["generation_log_probs"]) == len(turn["generation_token_ids"])


async def test_codex_stopped_by_the_proxys_turn_limit_is_the_policys_max_turns_not_a_masked_failure(
    rootfs: Path, codex_model: str, tokenizer: Tokenizer
) -> None:
    trajectory, calls, _ = await codex_rollout(codex_model, tokenizer, max_turns=1)
    assert (len(calls.calls), [r.reason for r in calls.refused]) == (1, ["max_calls"])  # it asked again, then stopped
    assert (trajectory.critical_error, trajectory.finish) == (None, "max_turns") and trajectory.mask_reason() is None
    assert "harness_was_here.txt" in (trajectory.submission or {}).get("patch", "")  # graded all the same
