"""The math verifier grades with math-verify: right, wrong, unparseable, missing."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import psutil
import pytest

from nemo_gym_prorl.contracts.task import TaskInstance, load_task
from nemo_gym_prorl.envs import make_environment
from nemo_gym_prorl.envs.math.env import grade_answer


@pytest.mark.parametrize("answer", ["\\boxed{-6}", "The answer is $-6$.", "-6", "so x = \\boxed{-6.0}"])
def test_right_answers_get_reward_one(answer: str) -> None:
    grade = grade_answer(answer, "-6")
    assert grade.reward == 1.0 and grade.resolved and grade.details["reason"] == "correct"


def test_equivalent_forms_are_right() -> None:
    assert grade_answer("\\boxed{\\frac{1}{2}}", "0.5").resolved


def test_wrong_answer_gets_zero_and_says_why() -> None:
    grade = grade_answer("\\boxed{7}", "-6")
    assert grade.reward == 0.0 and not grade.resolved
    assert grade.details["reason"] == "wrong answer" and grade.details["parsed_answer"] == "7"


@pytest.mark.parametrize("answer", ["I don't know", "", None])
def test_unparseable_or_missing_answers_get_zero_with_a_reason(answer: str | None) -> None:
    grade = grade_answer(answer, "-6")
    assert grade.reward == 0.0 and grade.details["reason"] in ("unparseable answer", "no answer submitted")


def test_an_unparseable_expected_answer_is_an_error_not_a_zero() -> None:
    with pytest.raises(ValueError, match="not parseable"):
        grade_answer("\\boxed{1}", "@@@")


@pytest.mark.parametrize(
    ("answer", "correct"),
    [
        ("<think>brief reasoning</think>8", True),
        ("<think>brief reasoning</think>\n\\boxed{8}", True),
        ("the chat template opened the trace: 3 + 5</think>8", True),
        ("<think>8</think>7", False),
        ("<think>\\boxed{8}</think>\nno idea", False),
        ("<think>so x = 8</think>\nI give up", False),
        ("<thinking>so x = 8</thinking>\nI give up", False),
    ],
)
def test_a_reasoning_trace_is_not_graded(answer: str, correct: bool) -> None:
    """Gym's graders strip <think>...</think> (and a trace whose opening tag was the template's) first."""
    grade = grade_answer(answer, "8")
    assert grade.resolved is correct, grade.details


@pytest.mark.parametrize("answer", ["<think>8", "<think>so x = \\boxed{8}", "<think>a</think>b<think>x = 8"])
def test_a_reply_cut_off_inside_its_trace_has_no_answer(answer: str) -> None:
    grade = grade_answer(answer, "8")
    assert grade.reward == 0.0 and grade.details["reason"] in ("unparseable answer", "only a reasoning trace")


@pytest.mark.parametrize("task", ["math/arithmetic", "stem/algebra"])
async def test_a_gold_that_is_not_math_is_a_one_line_error_naming_the_row(task: str) -> None:
    """A free-text gold (Gym's equivalence rows) is refused, not scored 0: one line naming task, row and column."""
    env = make_environment(load_task(task), "bwrap")
    gold = "Danny Casey played football for Ireland,\nand later coached in the League of Ireland. " * 20
    instance = TaskInstance(instance_id="row-7", data={"question": "Who?", "answer": gold})
    with pytest.raises(ValueError) as error:
        await env.grade(instance, {"answer": "\\boxed{1}"})
    message = str(error.value)
    assert "\n" not in message and len(message) < 300, message
    assert task in message and "row-7" in message and "'answer'" in message, message
    assert "not parseable by math-verify" in message


def test_grading_works_off_the_main_thread() -> None:
    """Services grade in worker threads too; math-verify's SIGALRM timeout must not break that."""
    import threading

    results = []
    worker = threading.Thread(target=lambda: results.append(grade_answer("\\boxed{-6}", "-6")))
    worker.start()
    worker.join()
    assert results[0].resolved


@pytest.mark.parametrize(
    "expected", ["2\\sqrt{3}", "\\(2\\sqrt{3}\\)", "$2\\sqrt{3}$", "\\(\\sqrt{12}\\)"]
)
def test_gold_answers_written_as_gym_math_data_writes_them(expected: str) -> None:
    """Raw LaTeX and \\( \\)-wrapped gold answers are math (math_with_judge reads them as a \\boxed{} content)."""
    assert grade_answer("so \\boxed{2\\sqrt{3}}", expected).resolved
    assert not grade_answer("\\boxed{3\\sqrt{2}}", expected).resolved


def test_math_verify_time_limits_hold_off_the_main_thread() -> None:
    """Off the main thread the grading runs in a worker process's main thread: a wrong gold still raises there."""
    import threading

    errors: list[BaseException] = []

    def grade() -> None:
        try:
            grade_answer("\\boxed{1}", "@@@")
        except ValueError as e:
            errors.append(e)

    worker = threading.Thread(target=grade)
    worker.start()
    worker.join()
    assert len(errors) == 1 and "not parseable" in str(errors[0])


SERVICE = """
import signal, sys, threading, time
from nemo_gym_prorl.envs.math.env import grade_answer

def stop(signum, frame):  # a service's graceful stop: it takes a moment, as uvicorn's and Ray's do
    time.sleep(1)
    sys.exit(0)

signal.signal(signal.SIGTERM, stop)
grader = threading.Thread(target=grade_answer, args=("\\\\boxed{2}", "2"))
grader.start()
grader.join()
print("graded", flush=True)
time.sleep(600)
"""


def test_a_service_stopped_by_sigterm_leaves_no_grading_process_behind() -> None:
    """Slurm's scancel and systemd signal a service's whole process group: its grading workers die with it, and
    none is started while it goes down (a pool that refilled itself started a forkserver that outlived it)."""
    service = subprocess.Popen([sys.executable, "-c", SERVICE], stdout=subprocess.PIPE, text=True,
                               start_new_session=True)
    try:
        assert service.stdout.readline().strip() == "graded"
        group = [p for p in psutil.process_iter() if _group_of(p) == service.pid]
        assert len(group) > 2  # the service, its forkserver and a worker at least
        os.killpg(service.pid, signal.SIGTERM)
        _, alive = psutil.wait_procs(group, timeout=30)
        assert alive == []
        assert [p.cmdline() for p in psutil.process_iter() if _group_of(p) == service.pid] == []
    finally:
        for process in psutil.process_iter():
            if _group_of(process) == service.pid:
                process.kill()
        service.wait()


def _group_of(process: psutil.Process) -> int | None:
    try:
        return os.getpgid(process.pid)
    except OSError:
        return None
