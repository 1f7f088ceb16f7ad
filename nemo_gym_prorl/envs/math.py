"""Math: the problem is staged in the workspace; the answer is graded with math-verify.

Gold answers are read the way NeMo Gym's ``math_with_judge`` reads them: outer ``\\( \\)`` or ``$ $`` taken off,
the rest parsed as the content of a ``\\boxed{}`` (so raw LaTeX such as ``2\\sqrt{3}`` is math, not text). The
reply is parsed as Gym parses it (expressions and LaTeX); unlike Gym, a reply need not box its answer: the
``finish`` tool's plain ``-6`` is an answer here.

math-verify bounds its parsing and comparing with SIGALRM, which only a process's main thread can use. On the main
thread it runs here; anywhere else (a service's worker threads) it runs in a worker process's main thread, and a
worker that does not come back in time is killed and replaced.
"""

from __future__ import annotations

import atexit
import multiprocessing
import threading
from multiprocessing.pool import Pool
from typing import Any

from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

from nemo_gym_prorl.envs.base import Environment, Episode, Evaluation, Submission
from nemo_gym_prorl.envs.dataset import TaskInstance

TIMEOUT_S = 5
_GOLD_CONFIG = [LatexExtractionConfig()]
_ANSWER_CONFIG = [ExprExtractionConfig(), LatexExtractionConfig()]
_WORKERS = 2


def gold_as_boxed(expected: str) -> str:
    """The gold answer as the content of a \\boxed{}, its outer math delimiters taken off."""
    text = expected.strip()
    if text.startswith("\\(") and text.endswith("\\)"):
        text = text[2:-2].strip()
    if len(text) > 1 and text.startswith("$") and text.endswith("$"):
        text = text.strip("$").strip()
    return "\\boxed{" + text + "}"


def _grade(answer: str | None, expected: str, timeout: int | None) -> dict[str, Any]:
    if answer is None or not answer.strip():
        return {"reward": 0.0, "resolved": False, "details": {"reason": "no answer submitted"}}
    gold = parse(gold_as_boxed(expected), _GOLD_CONFIG, parsing_timeout=timeout)
    if not any(not isinstance(g, str) for g in gold):  # only math-verify's raw-string fallback
        raise ValueError(f"expected answer {expected!r} is not parseable by math-verify")
    predicted = parse(answer, _ANSWER_CONFIG, parsing_timeout=timeout)
    if not predicted:
        return {"reward": 0.0, "resolved": False, "details": {"reason": "unparseable answer", "answer": answer}}
    correct = verify(gold, predicted, timeout_seconds=timeout)
    details = {
        "reason": "correct" if correct else "wrong answer",
        "answer": answer,
        "parsed_answer": str(predicted[-1]),
        "expected": expected,
    }
    return {"reward": 1.0 if correct else 0.0, "resolved": correct, "details": details}


class _WorkerPool:
    """Processes whose main thread runs math-verify, for callers off the main thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pool: Pool | None = None

    def run(self, answer: str | None, expected: str) -> dict[str, Any]:
        with self._lock:
            if self._pool is None:
                context = multiprocessing.get_context("forkserver")
                context.set_forkserver_preload([__name__])  # workers fork with math-verify already imported
                self._pool = context.Pool(_WORKERS)
                atexit.register(self.close)
            pool = self._pool
        pending = pool.apply_async(_grade, (answer, expected, TIMEOUT_S))
        try:
            return pending.get(timeout=3 * TIMEOUT_S + 10)  # parse gold, parse answer, verify; then it is wedged
        except multiprocessing.TimeoutError:
            with self._lock:
                if self._pool is pool:
                    self._pool = None
            pool.terminate()
            return {"reward": 0.0, "resolved": False,
                    "details": {"reason": "grading timed out", "answer": answer, "expected": expected}}


    def close(self) -> None:
        """Stop the workers (at exit: a pool left to the garbage collector errs during interpreter shutdown)."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.terminate()
            pool.join()


_WORKER_POOL = _WorkerPool()


def grade_answer(answer: str | None, expected: str) -> Evaluation:
    """Right, wrong or unparseable, with the parses that decided it; math-verify's time limits hold on any thread.
    ValueError when the expected answer itself is not math."""
    if threading.current_thread() is threading.main_thread():
        return Evaluation.model_validate(_grade(answer, expected, TIMEOUT_S))
    return Evaluation.model_validate(_WORKER_POOL.run(answer, expected))


class MathEnvironment(Environment):
    async def stage(self, episode: Episode) -> None:
        problem = self.prompt_messages(episode.instance)[-1]["content"]
        await episode.sandbox.write_file("problem.txt", problem.encode())

    async def grade(self, instance: TaskInstance, submission: Submission) -> Evaluation:
        expected = str(instance.data[self.task.verifier.get("answer_key", "answer")])
        # On the event loop's thread: its main thread in our services, where math-verify's own limits hold.
        return grade_answer(submission.get("answer"), expected)
