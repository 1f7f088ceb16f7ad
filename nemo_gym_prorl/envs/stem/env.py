"""STEM: multiple choice (NeMo Gym's ``mcqa`` rows), numbers with units, and symbolic answers.

A row with ``options`` and an ``expected_answer`` letter is multiple choice, read with the row's ``grading_mode``
(or the task's ``verifier.grading_mode``, which wins, as Gym's server config does; `mcqa_grading`). Any other row
has its gold answer in ``verifier.answer_key`` (default ``answer``): when that is a number with an optional unit,
the reply's final answer (its last ``\\boxed{}``, else its last ``Answer:``, else the whole reply) must be one
too, of the same dimension, equal after conversion within the row's ``rel_tol`` (or ``verifier.rel_tol``); a gold
that is no such number (``\\frac{\\sqrt3}{2}``, ``x^2+1``) is graded by math-verify as the math type grades, and
so is a unitless reply the unit parser cannot read (``\\frac{1}{2}`` for 0.5). Every reading starts past the
reply's reasoning trace (``<think>...</think>``, `strip_reasoning`): nothing inside it is graded.
"""

from __future__ import annotations

import re
from typing import Any, get_args

from pydantic import BaseModel, ConfigDict, Field

from nemo_gym_prorl.contracts.task import TaskInstance
from nemo_gym_prorl.envs.base import Episode, Evaluation, Probe, RowError, Submission
from nemo_gym_prorl.envs.math.env import answer_probes, gold_named, grade_answer, strip_reasoning
from nemo_gym_prorl.envs.row_prompt import GymRowPrompt
from nemo_gym_prorl.envs.stem.mcqa import GradingMode, last_boxed, option_letters, read_choice
from nemo_gym_prorl.envs.stem.units import UnitParseError, compare_quantities, parse_quantity

_ANSWER_LINE = re.compile(r"answer\s*(?:is)?\s*:?\s*(.+)", re.IGNORECASE)


class StemVerifierSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")
    grading_mode: GradingMode | None = Field(None, description="multiple choice: overrides each row's grading_mode")
    answer_key: str = Field("answer", description="column of the gold answer of non-multiple-choice rows")
    rel_tol: float = Field(1e-2, gt=0, description="relative tolerance of numeric answers; a row's rel_tol wins")


def is_choice_row(row: dict[str, Any]) -> bool:
    return bool(row.get("options") and row.get("expected_answer"))


def choice_reply(letter: str) -> str:
    """A reply choosing `letter` in every form the grading modes read (`prorl task check`'s probes)."""
    return f"<choice>{letter}</choice>\nAnswer: {letter}\n\\boxed{{{letter}}}"


def _positive_number(value: Any) -> bool:
    try:
        return float(value) > 0
    except (TypeError, ValueError):
        return False


def final_answer(text: str) -> str:
    """The last \\boxed{} of a reply, else what follows its last 'Answer:', else the reply itself."""
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed.strip()
    lines = _ANSWER_LINE.findall(text)
    return lines[-1].strip() if lines else text.strip()


def grade_choice(text: str, row: dict[str, Any], mode: GradingMode) -> Evaluation:
    expected = str(row.get("expected_answer") or "").strip().upper()
    chosen = read_choice(text, row, mode)
    correct = chosen is not None and chosen == expected
    reason = "correct" if correct else ("no choice read" if chosen is None else "wrong choice")
    return Evaluation(
        reward=1.0 if correct else 0.0,
        resolved=correct,
        details={"reason": reason, "extracted_answer": chosen, "expected_answer": expected, "grading_mode": mode},
    )


def grade_value(text: str, expected: str, rel_tol: float) -> Evaluation:
    """A numeric answer with units against `expected`; symbolic ones through math-verify."""
    try:
        gold = parse_quantity(expected)
    except UnitParseError:
        return _symbolic(text, expected)
    answer = final_answer(strip_reasoning(text))
    try:
        got = parse_quantity(answer)
    except UnitParseError:
        if gold.dimensionless:
            return _symbolic(text, expected)
        return Evaluation(reward=0.0, resolved=False, details={
            "reason": "unparseable answer", "answer": answer, "expected": expected,
            "note": "expected a number with a unit"})  # fmt: skip
    why = compare_quantities(gold, got, rel_tol)
    return Evaluation(
        reward=1.0 if why is None else 0.0,
        resolved=why is None,
        details={"reason": "correct" if why is None else why, "answer": answer, "parsed_answer": f"{got:~}",
                 "expected": expected, "rel_tol": rel_tol},
    )


def _symbolic(text: str, expected: str) -> Evaluation:
    evaluation = grade_answer(text, expected)
    evaluation.details["grader"] = "math-verify"
    return evaluation


class StemEnvironment(GymRowPrompt):
    # Gym's mcqa rows are answered by a plain reply; so is ours (a tool call is needed only to compute).
    plain_reply_ends_episode = True

    Settings = StemVerifierSettings

    def check_columns(self, instance: TaskInstance) -> None:
        row = instance.data
        if is_choice_row(row):
            letters = option_letters(row["options"])
            if str(row["expected_answer"]).strip().upper() not in letters:
                raise RowError(None, f"column 'expected_answer': {row['expected_answer']!r} is none of the options' "
                               f"letters ({', '.join(letters)})")  # fmt: skip
            mode = self.settings.grading_mode or row.get("grading_mode")
            if mode is not None and mode not in get_args(GradingMode):
                raise RowError(None, f"column 'grading_mode': expected one of {', '.join(get_args(GradingMode))}, "
                               f"got {mode!r}")  # fmt: skip
            return
        if row.get(self.settings.answer_key) is None:
            raise RowError("verifier.answer_key", f"no column {self.settings.answer_key!r} in the row (nor options "
                           "with an expected_answer)")  # fmt: skip
        if row.get("rel_tol") is not None and not _positive_number(row["rel_tol"]):
            raise RowError(None, f"column 'rel_tol': expected a positive number, got {row['rel_tol']!r}")

    def probes(self, instance: TaskInstance) -> list[Probe]:
        row = instance.data
        if is_choice_row(row):
            expected = str(row["expected_answer"]).strip().upper()
            other = next(letter for letter in option_letters(row["options"]) if letter != expected)
            return [Probe("gold", {"answer": choice_reply(expected)}, 1.0), Probe("empty", {"answer": ""}, 0.0),
                    Probe(f"option {other}", {"answer": choice_reply(other)}, 0.0)]  # fmt: skip
        gold = str(row[self.settings.answer_key])
        try:
            quantity = parse_quantity(gold)
        except UnitParseError:
            return answer_probes(gold)
        off = quantity + (abs(quantity) if quantity.magnitude else 1 * quantity.units)  # 2x, or 0 for a negative
        return [*answer_probes(gold), Probe("off by 100%", {"answer": f"\\boxed{{{off:~}}}"}, 0.0)]

    async def stage(self, episode: Episode) -> None:
        assert episode.sandbox is not None
        problem = self.first_prompt(episode.instance)[-1]["content"]
        await episode.sandbox.write_file("problem.md", str(problem).encode())

    async def grade(self, instance: TaskInstance, submission: Submission) -> Evaluation:
        row, text = instance.data, submission.get("answer")
        if text is None or not str(text).strip():
            return Evaluation(reward=0.0, resolved=False, details={"reason": "no answer submitted"})
        text = str(text)
        if is_choice_row(row):
            mode = self.settings.grading_mode or row.get("grading_mode") or "strict_single_letter_boxed"
            return grade_choice(text, row, mode)
        if self.settings.answer_key not in row:
            raise ValueError(f"task {self.task.name!r}, instance {instance.instance_id}: the row has neither options "
                             f"with an expected_answer nor a {self.settings.answer_key!r} column")
        rel_tol = float(row.get("rel_tol") or self.settings.rel_tol)
        with gold_named(self.task.name, instance.instance_id, self.settings.answer_key):
            return grade_value(text, str(row[self.settings.answer_key]), rel_tol)
