"""A task file is checked whole before anything runs (its keys, its settings, every row against what the task
reads), and every shipped task's grader scores its rows' gold answers 1 and empty or wrong ones 0."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from nemo_gym_prorl.contracts.task import TaskConfigError, TaskInstance, known_tasks, load_task
from nemo_gym_prorl.envs import make_environment
from nemo_gym_prorl.envs.task_check import check_rows, probe_rows

ROWS = [{"id": "u-0", "question": "How fast?", "answer": "3 m/s", "rel_tol": 0.01},
        {"id": "u-1", "question": "How heavy?", "answer": "2 kg"}]  # fmt: skip
CHOICE_ROW = {"id": "c-0", "question": "Pick", "options": [{"A": "one"}, {"B": "two"}], "expected_answer": "B"}


def write_task(folder: Path, rows: list[dict], **fields) -> Path:
    (folder / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    task = {"name": "mine", "type": "stem", "dataset": {"path": "rows.jsonl", "id_key": "id"},
            "prompt_template": "{question}", "tools": ["python", "finish"]} | fields  # fmt: skip
    (folder / "task.yaml").write_text(yaml.safe_dump(task))
    return folder / "task.yaml"


def checked(path: Path) -> list[TaskInstance]:
    return check_rows(make_environment(load_task(str(path)), "bwrap"))


@pytest.mark.parametrize(
    ("fields", "rows", "message"),
    [
        ({"verifier": {"rel_tl": 0.02}}, ROWS, "field 'verifier.rel_tl': unknown key; known: grading_mode, answer_key"),
        ({"verifier": {"answer_key": "solution"}}, ROWS, "field 'verifier.answer_key': no column 'solution'"),
        ({"dataset": {"path": "rows.jsonl", "id_key": "ident"}}, ROWS, "field 'dataset.id_key': no column 'ident'"),
        ({"verifier": {"rel_tol": "lots"}}, ROWS, "field 'verifier.rel_tol': Input should be a valid number"),
        ({"verifier": {"grading_mode": "vibes"}}, ROWS, "field 'verifier.grading_mode': Input should be"),
        ({"tools": ["python", "pyhton"]}, ROWS, "field 'tools': unknown tool 'pyhton'; known: bash, python"),
        ({"prompt_template": "{question} in {unit}"}, ROWS, "field 'prompt_template': needs column 'unit'"),
        ({"limits": {"wall_clok_s": 5}}, ROWS, "field 'limits.wall_clok_s': unknown key; known: wall_clock_s"),
        ({}, [*ROWS, ROWS[0]], "field 'dataset.id_key': id 'u-0' is in rows 1 and 3"),
        ({}, [ROWS[0] | {"rel_tol": "lots"}], "column 'rel_tol': expected a positive number, got 'lots' (row 1"),
        ({}, [CHOICE_ROW | {"expected_answer": "E"}], "column 'expected_answer': 'E' is none of the options' letters"),
        ({}, [CHOICE_ROW | {"grading_mode": "vibes"}], "column 'grading_mode': expected one of"),
        ({"type": "math", "verifier": {"tolerance": 1}}, ROWS, "field 'verifier.tolerance': unknown key; known: "),
        ({"type": "code"}, ROWS, "the row has no tests"),
    ],
)
def test_a_bad_task_file_is_one_line_naming_the_file_and_field(fields, rows, message, tmp_path: Path) -> None:
    path = write_task(tmp_path, rows, **fields)
    with pytest.raises(TaskConfigError) as error:
        checked(path)
    line = str(error.value)
    assert "\n" not in line and f"task file {path}" in line and message in line, line


def test_every_row_of_every_shipped_task_holds_what_its_task_reads() -> None:
    for name in known_tasks():
        task = load_task(name)
        rows = check_rows(make_environment(task, "bwrap"))
        assert len({r.instance_id for r in rows}) == len(rows) > 0, name


# Shipped tasks whose graders run sandboxes are checked on their first rows: all 164 HumanEval solutions are
# graded in test_code_env, the SWE suite's gold patches in tests/envs/swe.
# A harness task of the suite grades as swe/offline does: one row checks its file wires the same grader.
LIMITS = {"code/humaneval": 24, "swe/offline": 4, "swe/offline_mini_swe_agent_harness": 1,
          "swe/offline_codex_harness": 1}
# Gym's code_gen rows carry no reference program (test_code_gym_agreement grades Gym's own rollouts of them).
WITHOUT_GOLD = {"code/gym_code_gen_example"}


@pytest.mark.parametrize("name", known_tasks())
async def test_every_shipped_task_grades_gold_answers_1_and_wrong_ones_0(name: str, installed: str) -> None:
    """(`installed`: the image tools, for a task whose named image is built on first use.)"""
    env = make_environment(load_task(name), "bwrap")
    instances = check_rows(env)[: LIMITS.get(name)]
    try:
        failures = await probe_rows(env, instances)
    finally:
        await env.aclose()
    assert failures == [], "\n".join(f"{f.instance_id} {f.probe}: {f.got} ({f.reason})" for f in failures)
    has_gold = [any(p.reward == 1.0 for p in env.probes(i)) for i in instances]
    assert all(has_gold) if name not in WITHOUT_GOLD else not any(has_gold), name


async def test_a_gold_the_grader_cannot_read_is_a_failing_row_not_a_crash(tmp_path: Path) -> None:
    prose = "Danny Casey played football for Ireland, and later coached in the League of Ireland. " * 20
    rows = [{"id": "ok", "question": "1 + 1?", "answer": "2"}, {"id": "prose", "question": "Who?", "answer": prose}]
    env = make_environment(load_task(str(write_task(tmp_path, rows, type="math"))), "bwrap")
    failures = await probe_rows(env, check_rows(env))
    assert {f.instance_id for f in failures} == {"prose"}
    gold = next(f for f in failures if f.probe == "gold")
    assert gold.got is None and "not parseable by math-verify" in gold.reason


async def test_a_grader_that_reads_a_wrong_answer_as_right_fails_the_check(tmp_path: Path) -> None:
    """The probe that catches a unit parser reading `10 + 1` as 10: gold plus one must score 0."""
    env = make_environment(load_task(str(write_task(tmp_path, [{"id": "n", "question": "?", "answer": "10"}]))), "bwrap")
    (instance,) = check_rows(env)
    probes = {p.label: p for p in env.probes(instance)}
    assert probes["gold + 1"].submission == {"answer": "\\boxed{10 + 1}"}
    assert (await env.grade(instance, probes["gold + 1"].submission)).reward == 0.0
