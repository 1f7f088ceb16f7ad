"""The stem task type: multiple choice in Gym's mcqa schema, numbers with units, symbolic answers."""

from __future__ import annotations

import pytest

from nemo_gym_prorl.contracts.task import TaskInstance, load_task
from nemo_gym_prorl.envs import make_environment
from nemo_gym_prorl.envs.dataset import load_instances
from nemo_gym_prorl.envs.stem.env import final_answer, grade_value
from nemo_gym_prorl.envs.stem.mcqa import read_choice
from nemo_gym_prorl.envs.stem.units import UnitParseError, parse_quantity

ROW = {
    "options": [{"A": "Karyotyping"}, {"B": "Polymerase Chain Reaction (PCR)"}, {"C": "Southern blotting"},
                {"D": "Microarray analysis"}],
    "expected_answer": "B",
}


@pytest.mark.parametrize(
    ("mode", "reply", "choice"),
    [
        ("strict_single_letter_boxed", "so \\boxed{B}", "B"),
        ("strict_single_letter_boxed", "\\boxed{\\text{(B)}}", "B"),
        ("strict_single_letter_boxed", "\\boxed{B: Polymerase Chain Reaction (PCR)}", "B"),
        ("strict_single_letter_boxed", "\\boxed{A} at first, finally \\boxed{C}", "C"),
        ("strict_single_letter_boxed", "\\boxed{Polymerase Chain Reaction (PCR)}", None),
        ("strict_single_letter_boxed", "\\boxed{E}", None),  # not an option
        ("strict_single_letter_boxed", "Answer: B", None),
        ("lenient_boxed", "\\boxed{Polymerase Chain Reaction (PCR)}", "B"),
        ("lenient_boxed", "\\boxed{\\text{it is southern blotting}}", "C"),
        ("lenient_answer_colon", "Answer: B\nthen Answer: C", "B"),  # the first, as Gym reads it
        ("lenient_answer_colon", "Answer: Microarray analysis", "D"),
        ("lenient_answer_colon", "\\boxed{B}", None),
        ("lenient_answer_colon_md", "Reasoning...\n**Answer:** D", "D"),
        ("lenient_answer_colon_md", "Answer: A\nAnswer: B because PCR", "B"),
        ("lenient_answer_colon_md", "Answer: A or B", None),
        ("boxed_or_answer_colon", "\\boxed{C}", "C"),
        ("boxed_or_answer_colon", "The answer is C.\nAnswer: D", "D"),
    ],
)
def test_every_grading_mode_reads_the_choice(mode: str, reply: str, choice: str | None) -> None:
    assert read_choice(reply, ROW, mode) == choice


def test_template_regex_comes_first_and_any_number_of_options_works() -> None:
    twelve = {"options": [{chr(65 + i): f"option {i}"} for i in range(12)], "expected_answer": "L",
              "template_metadata": {"output_regex": "Final Choice:\\s*([A-Za-z])"}}
    assert read_choice("\\boxed{A}\nFinal Choice: l", twelve, "strict_single_letter_boxed") == "L"
    assert read_choice("\\boxed{K}", twelve, "strict_single_letter_boxed") == "K"
    assert read_choice("\\boxed{M}", twelve, "strict_single_letter_boxed") is None


@pytest.mark.parametrize(
    ("reply", "expected", "correct"),
    [
        ("\\boxed{16.67 m/s}", "16.6667 m/s", True),
        ("\\boxed{60 km/h}", "16.6667 m/s", True),  # converted
        ("\\boxed{16.67 kg}", "16.6667 m/s", False),  # wrong unit: math-verify would call it right
        ("\\boxed{16.67}", "16.6667 m/s", False),  # no unit where one is expected
        ("\\boxed{3.0\\times10^{8}\\,\\text{m/s}}", "3e8 m/s", True),
        ("\\boxed{3 \\cdot 10^8 \\mathrm{m\\,s^{-1}}}", "3e8 m/s", True),
        ("Answer: 6.67e-11 N m^2/kg^2", "6.674 \\times 10^{-11} \\text{N m^2 kg^{-2}}", True),
        ("\\boxed{6.67e-11}", "6.67 \\times 10^{-11}", True),  # not 6.67, as math-verify reads it
        ("\\boxed{25 ^\\circ C}", "298.15 K", True),
        ("\\boxed{110 kJ}", "110000 J", True),
        ("\\boxed{0.11 MJ}", "110 kJ", True),
        ("\\boxed{\\frac{1}{2}}", "0.5", True),  # a unitless reply the unit parser cannot read: math-verify
        ("\\boxed{\\frac{\\sqrt{3}}{2}}", "\\frac{\\sqrt{3}}{2}", True),  # symbolic gold: math-verify
        ("\\boxed{\\frac{\\sqrt{2}}{2}}", "\\frac{\\sqrt{3}}{2}", False),
        ("1.two to-two ideas that won'nt be found", "3", False),  # free text pint's tokenizer chokes on: graded 0
        ("12 m/s'", "12 m/s", False),
    ],
)
def test_numeric_answers_with_units(reply: str, expected: str, correct: bool) -> None:
    evaluation = grade_value(reply, expected, rel_tol=1e-2)
    assert evaluation.resolved is correct, evaluation.details


@pytest.mark.parametrize(
    ("reply", "expected", "correct"),
    [
        ("\\boxed{10 + 1}", "10", False),  # was read as 10 with the "unit" + 1
        ("\\boxed{10+1}", "10", False),
        ("\\boxed{-3 + 1}", "-3", False),
        ("\\boxed{2494.2 + 1 J}", "2494.2 J", False),
        ("\\boxed{10 + 1}", "11", True),  # an expression: math-verify evaluates it
        ("\\boxed{10 (1)}", "10", False),
    ],
)
def test_a_number_then_arithmetic_is_never_that_number(reply: str, expected: str, correct: bool) -> None:
    evaluation = grade_value(reply, expected, rel_tol=1e-2)
    assert evaluation.resolved is correct, evaluation.details


@pytest.mark.parametrize("text", ["10 + 1", "10+1", "-3 + 1", "2494.2 + 1 J", "10 (1)", "5 m + 2", "4 2"])
def test_a_unit_is_no_arithmetic_continuation(text: str) -> None:
    with pytest.raises(UnitParseError):
        parse_quantity(text)


@pytest.mark.parametrize(
    ("text", "unit"),
    [("5 \\frac{1}{s}", "1 / s"), ("5 m**-1", "1 / m"), ("2 m^2 s^{-1}", "m ** 2 / s"),
     ("6.674 \\times 10^{-11} \\text{N m^2 kg^{-2}}", "m ** 2 * N / kg ** 2"), ("3 m^{+2}", "m ** 2"),
     ("-3 \\, ^\\circ C", "°C")],
)
def test_units_with_exponents_still_parse(text: str, unit: str) -> None:
    assert f"{parse_quantity(text).units:~}" == unit


def test_wrong_unit_says_so_and_tolerance_edges_hold() -> None:
    wrong = grade_value("\\boxed{9.8 kg}", "9.8 m/s", 1e-2)
    assert wrong.details["reason"].startswith("wrong unit: kg")
    assert grade_value("\\boxed{100.9 N}", "100 N", 1e-2).resolved
    assert not grade_value("\\boxed{101.1 N}", "100 N", 1e-2).resolved
    assert grade_value("\\boxed{99.95 N}", "100 N", 1e-3).resolved
    assert not grade_value("\\boxed{99.8 N}", "100 N", 1e-3).resolved


def test_final_answer_is_the_last_box_else_the_last_answer_line() -> None:
    assert final_answer("\\boxed{1} then \\boxed{2 m}") == "2 m"
    assert final_answer("work...\nAnswer: 5 kg") == "5 kg"
    assert final_answer("42") == "42"


@pytest.mark.parametrize(
    ("reply", "expected", "correct"),
    [
        ("<think>brief reasoning</think>8", "8", True),
        ("<think>8</think>7", "8", False),
        ("<think>8", "8", False),  # cut off inside its trace: no answer
        ("<think>\\boxed{5 m/s}</think>Answer: 3 m/s", "3 m/s", True),
        ("<think>so 3 m/s</think>\nI give up", "3 m/s", False),
        ("the template opened it: 3 m/s</think>\\boxed{3 m/s}", "3 m/s", True),
    ],
)
def test_a_reasoning_trace_is_not_graded(reply: str, expected: str, correct: bool) -> None:
    evaluation = grade_value(reply, expected, rel_tol=1e-2)
    assert evaluation.resolved is correct, evaluation.details


@pytest.mark.parametrize(
    ("mode", "reply", "choice"),
    [
        ("strict_single_letter_boxed", "<think>maybe \\boxed{B}</think>I am not sure.", None),
        ("strict_single_letter_boxed", "<think>\\boxed{A}</think>\\boxed{B}", "B"),
        ("strict_single_letter_boxed", "<think>so \\boxed{B}", None),
        ("lenient_answer_colon", "<think>Answer: A?</think>Answer: B", "B"),
        ("boxed_or_answer_colon", "<think>Answer: B</think>no idea", None),
    ],
)
def test_a_choice_inside_the_reasoning_trace_is_not_read(mode: str, reply: str, choice: str | None) -> None:
    assert read_choice(reply, ROW, mode) == choice


CHEMISTRY = {"options": [{"A": "CO"}, {"B": "Co"}, {"C": "CO2"}, {"D": "H2O"}], "expected_answer": "B"}


@pytest.mark.parametrize(
    ("reply", "choice"),
    [
        ("<choice>B</choice>", "B"),
        ("<choice>Co</choice>", "B"),
        ("<choice>CO</choice>", "A"),
        ("<choice>co</choice>", None),  # case names the formula: neither CO nor Co
        ("<answer>CO₂</answer>", "C"),
        ("Reasoning.\nAnswer: B", "B"),
        ("Cobalt is the metal here.\nCo", "B"),  # the option's text alone on the last line
        ("The answer is D.", "D"),
        ("\\boxed{\\text{B}}", "B"),
        ("<choice>H2O</choice>\nOn reflection:\nAnswer: B", "B"),  # the last answer wins
        ("Answer: A or B", None),
        ("<choices><choice>CO</choice><choice>Co</choice></choices>", None),  # the prompt's list echoed
        ("I think it is cobalt.", None),
    ],
)
def test_bunsenbench_reading(reply: str, choice: str | None) -> None:
    assert read_choice(reply, CHEMISTRY, "choice_tag_or_answer") == choice


async def test_a_task_reads_bunsenbench_rows_when_its_verifier_says_so() -> None:
    config = load_task("stem/gym_mcqa_example").model_copy(update={"verifier": {"grading_mode": "choice_tag_or_answer"}})
    env = make_environment(config, "bwrap")
    instance = TaskInstance(instance_id="bunsen:1", data={"question": "Cobalt?", **CHEMISTRY})
    assert (await env.grade(instance, {"answer": "<think>CO?</think><choice>Co</choice>"})).reward == 1.0
    assert (await env.grade(instance, {"answer": "<choice>CO</choice>"})).reward == 0.0


@pytest.mark.parametrize(
    ("mode", "reply", "choice"),
    [
        ("lenient_answer_colon", "Answer: Co", "B"),
        ("lenient_answer_colon", "Answer: co", None),
        ("lenient_answer_colon", "Answer: h2o", "D"),  # case ignored where it tells no options apart
        ("lenient_boxed", "\\boxed{Co}", "B"),
        ("lenient_boxed", "\\boxed{co}", None),
    ],
)
def test_option_text_keeps_the_case_that_tells_options_apart(mode: str, reply: str, choice: str | None) -> None:
    assert read_choice(reply, CHEMISTRY, mode) == choice


def test_a_custom_regex_capture_keeps_its_case() -> None:
    row = {**CHEMISTRY, "template_metadata": {"output_regex": "Final:\\s*(\\w+)"}}
    assert read_choice("Final: Co", row, "strict_single_letter_boxed") == "B"
    assert read_choice("Final: CO", row, "strict_single_letter_boxed") == "A"


@pytest.mark.parametrize(
    ("task", "full", "zero", "malformed"),
    [
        ("stem/gym_mcqa_example", "\\boxed{{{gold}}}", "\\boxed{{Z}}", "I am not sure."),
        ("stem/gym_gpqa_diamond_example", "Answer: {gold}", "Answer: Z", "no idea"),
        ("stem/units", "\\boxed{{{gold}}}", "\\boxed{{{gold_wrong_unit}}}", "\\boxed{{fast}}"),
        ("stem/algebra", "\\boxed{{{gold}}}", "\\boxed{{{gold}1}}", "\\boxed{{}}"),
    ],
)
async def test_stem_verifier_fixtures(task: str, full: str, zero: str, malformed: str) -> None:
    """NeMo Gym's verifier-fixture cases: full reward, zero, malformed answer, the same reward ten times."""
    config = load_task(task)
    env = make_environment(config, "bwrap")
    instance = load_instances(config.dataset, limit=1)[0]
    gold = instance.data.get("expected_answer") or instance.data["answer"]
    fill = {"gold": gold, "gold_wrong_unit": str(gold).split()[0] + " kg"}
    rewards = [(await env.grade(instance, {"answer": reply.format(**fill)})).reward for reply in (full, zero, malformed)]
    assert rewards == [1.0, 0.0, 0.0]
    again = {(await env.grade(instance, {"answer": full.format(**fill)})).reward for _ in range(10)}
    assert again == {1.0}


async def test_stem_episode_stages_the_problem() -> None:
    env = make_environment(load_task("stem/units"), "bwrap")
    instance = TaskInstance(instance_id="u", data={"question": "How fast?", "answer": "3 m/s"})
    episode = await env.init(instance)
    try:
        assert (await episode.sandbox.read_file("problem.md")) == b"How fast?"
        episode.answer = "\\boxed{10.8 km/h}"
        evaluation = await env.eval(episode)
    finally:
        await env.close(episode)
    assert evaluation.reward == 1.0


async def test_a_row_without_an_answer_is_named() -> None:
    env = make_environment(load_task("stem/algebra"), "bwrap")
    with pytest.raises(ValueError, match="neither options"):
        await env.grade(TaskInstance(instance_id="x", data={"question": "?"}), {"answer": "1"})


@pytest.mark.parametrize(
    ("reply", "reward"),
    [
        ("\\boxed{B}", 1.0),
        ("B: -157", 1.0),  # opening with a choice as the options are listed
        ("(B) because -96 - 61 is -157", 1.0),
        ("A: -158", 0.0),
        ("A: -158\nB: -157", 0.0),  # a list of options is read by its first line
        ("It is -157.", 0.0),  # no letter: no choice
        ("B: wrong\n\\boxed{C}", 0.0),  # a boxed letter comes first
    ],
)
async def test_arithmetic_choice_reads_a_boxed_letter_or_a_reply_opening_with_one(reply: str, reward: float) -> None:
    config = load_task("stem/arithmetic_choice")
    instance = load_instances(config.dataset, limit=2)[1]
    assert instance.data["expected_answer"] == "B" and {"B": "-157"} in instance.data["options"]
    evaluation = await make_environment(config, "bwrap").grade(instance, {"answer": reply})
    assert evaluation.reward == reward, evaluation.details
