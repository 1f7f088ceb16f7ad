"""Math: the problem is staged in the workspace; the answer is graded with math-verify.

Gold answers are read the way NeMo Gym's ``math_with_judge`` reads them: outer ``\\( \\)`` or ``$ $`` taken off,
the rest parsed as the content of a ``\\boxed{}`` (so raw LaTeX such as ``2\\sqrt{3}`` is math, not text). The
reply, its reasoning trace taken off (`strip_reasoning`), is parsed as Gym parses it (expressions and LaTeX); unlike
Gym, a reply need not box its answer: the ``finish`` tool's plain ``-6`` is an answer here.

math-verify bounds its parsing and comparing with SIGALRM, which only a process's main thread can use. On the main
thread it runs here; anywhere else (a service's worker threads) it runs in a worker process's main thread, and a
worker that does not come back in time is killed and replaced.
"""

from __future__ import annotations

import atexit
import multiprocessing
import queue
import re
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify
from pydantic import BaseModel, ConfigDict, Field

from nemo_gym_prorl.contracts.task import TaskInstance
from nemo_gym_prorl.envs.base import Environment, Episode, Evaluation, Probe, RowError, Submission

TIMEOUT_S = 5
_GOLD_CONFIG = [LatexExtractionConfig()]
_ANSWER_CONFIG = [ExprExtractionConfig(), LatexExtractionConfig()]
_WORKERS = 2
_TRACE_BLOCKS = [re.compile(r"<think>.*?</think>", re.DOTALL), re.compile(r"<thinking>.*?</thinking>", re.DOTALL)]
_TRACE_OPENED_BY_TEMPLATE = [re.compile(r"^.*?</think>", re.DOTALL), re.compile(r"^.*?</thinking>", re.DOTALL)]
_TRACE_LEFT_OPEN = re.compile(r"<think>|<thinking>")
# A bare \gamma or \Gamma: not a longer command, no subscript, no call (`\Gamma(5)` stays the gamma function).
_BARE_GAMMA = re.compile(r"\\(?:gamma|Gamma)(?![A-Za-z])(?!\s*(?:[_(]|\\left\b))")


class GoldNotMath(ValueError):
    """The gold answer is no math that math-verify reads (free text, as in Gym's equivalence rows). The row is
    refused, never scored 0: its rollout fails at eval with this error, where a silent 0 would look like the
    policy's fault and teach it nothing."""


def _excerpt(text: str, limit: int = 60) -> str:
    line = " ".join(text.split())
    return repr(line if len(line) <= limit else line[: limit - 3] + "...")


@contextmanager
def gold_named(task: str, instance_id: str, column: str) -> Iterator[None]:
    """A GoldNotMath raised inside names its row: met mid-run, the error says which row and column to fix."""
    try:
        yield
    except GoldNotMath as error:
        raise GoldNotMath(f"task {task!r}, instance {instance_id!r}, column {column!r}: {error}") from None


def strip_reasoning(reply: str) -> str:
    """The reply without its reasoning trace, which is never graded: Gym's graders take off ``<think>...</think>``
    and ``<thinking>...</thinking>`` blocks, then everything up to a closing tag whose opening tag was the chat
    template's. A trace still open at the end (the reply was cut off while reasoning) goes too, as Gym's arena
    drops it: a number inside it is no answer."""
    for pattern in _TRACE_BLOCKS + _TRACE_OPENED_BY_TEMPLATE:
        reply = pattern.sub("", reply)
    left_open = _TRACE_LEFT_OPEN.search(reply)
    return reply[: left_open.start() if left_open else None].strip()


def _gamma_as_value(latex: str) -> str:
    """`latex` with each bare \\gamma/\\Gamma braced with a space, the one form math-verify's LaTeX parser reads as a
    value (Euler's constant, the same symbol on both sides): bare, it reads the gamma function applied to what
    follows, so \\gamma-1 is gamma(-1), infinite, 2\\gamma is 2, \\gamma= and \\gamma^2 do not parse, where physics
    means the Lorentz factor or an adiabatic index (Gym's physics judge leaves those to its LLM judge)."""
    return _BARE_GAMMA.sub(lambda bare: "{" + bare.group(0) + " }", latex)


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
    gold = parse(_gamma_as_value(gold_as_boxed(expected)), _GOLD_CONFIG, parsing_timeout=timeout)
    if not any(not isinstance(g, str) for g in gold):  # only math-verify's raw-string fallback
        raise GoldNotMath(f"gold answer {_excerpt(expected)} is not parseable by math-verify")
    answer = strip_reasoning(answer)
    if not answer:
        return {"reward": 0.0, "resolved": False, "details": {"reason": "only a reasoning trace"}}
    predicted = parse(_gamma_as_value(answer), _ANSWER_CONFIG, parsing_timeout=timeout)
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


def _serve(connection: Connection) -> None:
    """A worker's loop: grade each (answer, expected) it is sent until its caller hangs up; what a grade raises
    (a gold that is not math) goes back to be raised in the caller."""
    while True:
        try:
            answer, expected = connection.recv()
        except EOFError:
            return
        try:
            connection.send(_grade(answer, expected, TIMEOUT_S))
        except Exception as error:
            connection.send(error)


class _WorkerPool:
    """Processes whose main thread runs math-verify, for callers off the main thread.

    A worker is started only when a grade needs one, and one that dies or wedges is killed, never replaced behind
    the caller's back: ``multiprocessing.Pool`` refills itself from a helper thread, so a service stopped by a signal
    that reached its workers first started new ones (and a new forkserver) while it went down, which outlived it."""

    def __init__(self, size: int) -> None:
        self._slots = threading.BoundedSemaphore(size)
        self._idle: queue.SimpleQueue[tuple[BaseProcess, Connection]] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._live: set[BaseProcess] = set()
        atexit.register(self.close)

    def run(self, answer: str | None, expected: str) -> dict[str, Any]:
        with self._slots:
            process, connection = self._take()
            try:
                connection.send((answer, expected))
                if connection.poll(3 * TIMEOUT_S + 10):  # parse gold, parse answer, verify; then it is wedged
                    result = connection.recv()
                    self._idle.put((process, connection))
                    if isinstance(result, Exception):
                        raise result
                    return result
            except (EOFError, OSError) as error:
                self._kill(process, connection)
                raise RuntimeError(f"math grading worker {process.pid} died: {error!r}") from error
            self._kill(process, connection)
            return {"reward": 0.0, "resolved": False,
                    "details": {"reason": "grading timed out", "answer": answer, "expected": expected}}

    def _take(self) -> tuple[BaseProcess, Connection]:
        try:
            return self._idle.get_nowait()
        except queue.Empty:
            pass
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload([__name__])  # workers fork with math-verify already imported
        connection, child = context.Pipe()
        process = context.Process(target=_serve, args=(child,), name="prorl-math-grader", daemon=True)
        with self._lock:
            process.start()
            self._live.add(process)
        child.close()
        return process, connection

    def _kill(self, process: BaseProcess, connection: Connection) -> None:
        connection.close()
        process.kill()
        process.join()
        with self._lock:
            self._live.discard(process)

    def close(self) -> None:
        """Stop the workers (at exit: left to the garbage collector they err during interpreter shutdown)."""
        with self._lock:
            live, self._live = self._live, set()
        for process in live:
            process.kill()
            process.join()


_WORKER_POOL = _WorkerPool(_WORKERS)


def grade_answer(answer: str | None, expected: str) -> Evaluation:
    """Right, wrong or unparseable, with the parses that decided it; math-verify's time limits hold on any thread.
    GoldNotMath (a ValueError) when the expected answer itself is not math."""
    if threading.current_thread() is threading.main_thread():
        return Evaluation.model_validate(_grade(answer, expected, TIMEOUT_S))
    return Evaluation.model_validate(_WORKER_POOL.run(answer, expected))


class MathSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")
    answer_key: str = Field("answer", description="the column of the gold answer")


def answer_probes(gold: str) -> list[Probe]:
    """The gold answer boxed (1), nothing (0) and the gold plus one, an expression that is never it (0)."""
    return [Probe("gold", {"answer": f"\\boxed{{{gold}}}"}, 1.0), Probe("empty", {"answer": ""}, 0.0),
            Probe("gold + 1", {"answer": f"\\boxed{{{gold} + 1}}"}, 0.0)]  # fmt: skip


class MathEnvironment(Environment):
    Settings = MathSettings

    def check_columns(self, instance: TaskInstance) -> None:
        if instance.data.get(self.settings.answer_key) is None:
            raise RowError("verifier.answer_key", f"no column {self.settings.answer_key!r} in the row")

    def probes(self, instance: TaskInstance) -> list[Probe]:
        return answer_probes(str(instance.data[self.settings.answer_key]))

    async def stage(self, episode: Episode) -> None:
        problem = self.first_prompt(episode.instance)[-1]["content"]
        await episode.sandbox.write_file("problem.txt", problem.encode())

    async def grade(self, instance: TaskInstance, submission: Submission) -> Evaluation:
        column = self.settings.answer_key
        # On the event loop's thread: its main thread in our services, where math-verify's own limits hold.
        with gold_named(self.task.name, instance.instance_id, column):
            return grade_answer(submission.get("answer"), str(instance.data[column]))
