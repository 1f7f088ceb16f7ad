"""BigCodeBench rows graded in real sandboxes: the `scientific` image is what lets a row whose tests import pandas,
scikit-learn and matplotlib pass (a wrong program still fails there; under the default root the same gold fails on
the import), the task grades a model's fenced answer through its named image, and a task file naming an image
that does not exist is refused when it loads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from nemo_gym_prorl.contracts.task import TaskConfigError, TaskInstance, load_task
from nemo_gym_prorl.envs import make_environment
from nemo_gym_prorl.envs.code.cases import problem_from_row
from nemo_gym_prorl.envs.code.grading import GradingSettings, grade_programs

TASK = load_task("code/bigcodebench")
ROWS = {row["task_id"]: row for row in map(json.loads, TASK.dataset.path.read_text().splitlines())}
SETTINGS = GradingSettings(timeout_s=60)


async def test_a_pandas_row_passes_its_gold_in_the_scientific_image_and_not_without_it(
    scientific_rootfs: Path,
) -> None:
    row = ROWS["BigCodeBench/37"]  # pandas, scikit-learn, seaborn, matplotlib
    problem, gold = problem_from_row(row), row["canonical_solution"]
    wrong = gold.replace("ascending=False", "ascending=True")  # the bars in the wrong order
    assert wrong != gold and problem.kind == "bigcodebench"
    passed, failed = await grade_programs([(problem, gold), (problem, wrong)], SETTINGS, image=str(scientific_rootfs))
    assert passed.reward == 1.0 and passed.details["reason"] == "all tests passed", passed.details
    assert failed.reward == 0.0 and failed.details["reason"] == "wrong_answer", failed.details
    summary, first = failed.details["failure"].splitlines()[:2]
    assert summary.startswith("4 of 5 tests failed: test_case_1, ") and first.startswith("FAIL test_case_1: ...")
    (host,) = await grade_programs([(problem, gold)], SETTINGS)  # bubblewrap's default root: the host's Python
    assert host.reward == 0.0 and host.details["reason"] == "runtime_error"
    assert "ModuleNotFoundError: No module named 'pandas'" in host.details["failure"]


async def test_the_task_grades_a_fenced_answer_in_its_named_image(scientific_rootfs: Path) -> None:
    env = make_environment(TASK, "bwrap")
    assert await env.sandbox_image() == str(scientific_rootfs)
    row = ROWS["BigCodeBench/17"]  # psutil
    instance = TaskInstance(instance_id=row["task_id"], data=row)
    answer = "Here it is:\n```python\n" + row["canonical_solution"] + "```\n"
    right = await env.grade(instance, {"answer": answer})
    assert right.reward == 1.0 and right.details["code_source"] == "answer code block", right.details
    body_only = await env.grade(instance, {"answer": "```python\n    return 'Process found.'\n```"})
    assert body_only.reward == 0.0 and body_only.details["reason"] == "wrong_answer"  # calibrated: it still runs


async def test_the_agent_tries_its_code_in_the_image_its_tests_run_in(scientific_rootfs: Path) -> None:
    env = make_environment(TASK, "bwrap")
    row = ROWS["BigCodeBench/37"]
    episode = await env.init(TaskInstance(instance_id=row["task_id"], data=row))
    try:
        result = await episode.sandbox.exec(["python3", "-c", "import pandas, sklearn, matplotlib; print('ok')"], 60)
    finally:
        await env.close(episode)
    assert result.exit_code == 0 and result.output.strip() == "ok", result


@pytest.mark.parametrize(
    ("image", "message"),
    [
        ("scientfic", ("field 'verifier.image': Value error, expected an image name (default, scientific) or an "
                       "existing absolute path, got 'scientfic'")),
        ("/no/such/rootfs", "field 'verifier.image': Value error, expected an image name"),
    ],
)  # fmt: skip
def test_a_task_naming_an_unknown_image_is_refused_in_one_line(image: str, message: str, tmp_path: Path) -> None:
    raw = yaml.safe_load(Path(TASK.dataset.path).parent.parent.joinpath("bigcodebench.yaml").read_text())
    raw["dataset"]["path"] = str(TASK.dataset.path)
    raw["verifier"]["image"] = image
    path = tmp_path / "task.yaml"
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(TaskConfigError) as error:
        make_environment(load_task(str(path)), "bwrap")
    line = str(error.value)
    assert "\n" not in line and line.startswith(f"task file {path}: ") and message in line, line
