"""Task files: a worked example given as chat turns, and a task that extends another."""

from __future__ import annotations

from pathlib import Path

import pytest

from nemo_gym_prorl.contracts.task import TaskConfigError, load_task
from nemo_gym_prorl.envs.dataset import load_instances
from nemo_gym_prorl.envs.math.env import MathEnvironment


def test_the_worked_example_comes_as_turns_between_the_system_prompt_and_the_question() -> None:
    task = load_task("math/arithmetic")
    instance = load_instances(task.dataset)[0]
    messages = MathEnvironment(task).prompt_messages(instance)
    assert [m["role"] for m in messages] == ["system", *["user", "assistant"] * 6, "user"]
    assert messages[2] == {"role": "assistant", "content": "```python\nprint(12 * -3)\n```"}
    assert messages[-1] == {"role": "user", "content": instance.data["question"]}


def test_a_task_extends_another_and_overrides_only_what_it_names(tmp_path: Path) -> None:
    (tmp_path / "rows.jsonl").write_text('{"id": "mine-0", "question": "Calculate 1 + 1.", "answer": "2"}\n')
    (tmp_path / "mine.yaml").write_text(
        "extends: math/arithmetic\nname: mine\ndataset: {path: rows.jsonl, validation_fraction: 0.5}\nmax_turns: 2\n"
    )
    task, base = load_task(str(tmp_path / "mine.yaml")), load_task("math/arithmetic")
    assert task.dataset.path == tmp_path / "rows.jsonl"  # relative to the file that names it
    assert task.dataset.id_key == base.dataset.id_key and task.dataset.validation_fraction == 0.5
    assert task.examples == base.examples and task.system_prompt == base.system_prompt and task.max_turns == 2
    assert task.dataset.path != base.dataset.path and base.dataset.path.is_file()


def test_the_shipped_training_task_is_arithmetic_with_more_rows() -> None:
    train, base = load_task("math/arithmetic_train"), load_task("math/arithmetic")
    assert train.model_dump(exclude={"name", "dataset"}) == base.model_dump(exclude={"name", "dataset"})
    rows, base_rows = load_instances(train.dataset), load_instances(base.dataset)
    assert len(rows) == 640 and [r.data for r in rows[: len(base_rows)]] == [r.data for r in base_rows]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("extends: math/nope\nname: x\n", "field 'extends': expected the name of a task, got 'math/nope'"),
        ("extends: [math/arithmetic]\nname: x\n", "field 'extends'"),
        ("extends: {self}\nname: x\n", "field 'extends': '{self}' extends itself"),
        ("extends: math/arithmetic\nname: x\nexamples: [{role: assistant, content: hi}]\n",
         "field 'examples': Value error, examples must alternate user, assistant"),
        ("extends: math/arithmetic\nname: x\nexamples: [{role: user, content: hi, name: me}]\n",
         "field 'examples.0.name'"),
        ("extends: math/arithmetic\nname: x\nmax_turn: 3\n", "field 'max_turn': unknown key; known: name, type"),
        ("extends: math/arithmetic\nname: x\ndataset: {id_col: id}\n", "field 'dataset.id_col'"),
        ("extends: math/arithmetic\nname: x\nlimits: {memory_gb: 1}\n", "field 'limits.memory_gb'"),
    ],
)
def test_bad_extends_and_examples_name_the_file_and_field(text: str, message: str, tmp_path: Path) -> None:
    path = tmp_path / "task.yaml"
    path.write_text(text.replace("{self}", str(path)))
    with pytest.raises(TaskConfigError) as error:
        load_task(str(path))
    assert str(path) in str(error.value) and message.replace("{self}", str(path)) in str(error.value)
