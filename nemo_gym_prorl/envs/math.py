"""Math: the problem is staged in the workspace; the answer is graded with math-verify."""

from __future__ import annotations

import threading

from math_verify import parse, verify

from nemo_gym_prorl.envs.base import Environment, Episode, Evaluation, Submission
from nemo_gym_prorl.envs.dataset import TaskInstance


def _timeout_s() -> int | None:
    """math-verify times out with SIGALRM, which only the main thread can use; elsewhere it runs unbounded."""
    return 5 if threading.current_thread() is threading.main_thread() else None


def grade_answer(answer: str | None, expected: str) -> Evaluation:
    """Right, wrong or unparseable, with the parses that decided it."""
    if answer is None or not answer.strip():
        return Evaluation(reward=0.0, resolved=False, details={"reason": "no answer submitted"})
    timeout = _timeout_s()
    gold = parse(expected if "$" in expected or "\\" in expected else f"${expected}$", parsing_timeout=timeout)
    if not any(not isinstance(g, str) for g in gold):  # only math-verify's raw-string fallback
        raise ValueError(f"expected answer {expected!r} is not parseable by math-verify")
    predicted = parse(answer, parsing_timeout=timeout)
    if not predicted:
        return Evaluation(reward=0.0, resolved=False, details={"reason": "unparseable answer", "answer": answer})
    correct = verify(gold, predicted, timeout_seconds=timeout)
    return Evaluation(
        reward=1.0 if correct else 0.0,
        resolved=correct,
        details={
            "reason": "correct" if correct else "wrong answer",
            "answer": answer,
            "parsed_answer": str(predicted[-1]),
            "expected": expected,
        },
    )


class MathEnvironment(Environment):
    async def stage(self, episode: Episode) -> None:
        problem = self.prompt_messages(episode.instance)[-1]["content"]
        await episode.sandbox.write_file("problem.txt", problem.encode())

    async def grade(self, instance: TaskInstance, submission: Submission) -> Evaluation:
        expected = str(instance.data[self.task.verifier.get("answer_key", "answer")])
        return grade_answer(submission.get("answer"), expected)
