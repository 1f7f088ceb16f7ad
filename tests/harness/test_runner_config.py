"""A task file's `harness:` section: the shipped mini-swe-agent task loads, and a bad section is refused with one
line naming the file and the field; a harness layer pip cannot build is an ImageError naming what failed."""

from __future__ import annotations

from pathlib import Path

import pytest

from nemo_gym_prorl.contracts.task import TASKS_DIR, TaskConfigError, load_task
from nemo_gym_prorl.sandbox.images import ImageError
from nemo_gym_prorl.sandbox.layers import build_pip_layer


def test_the_mini_swe_agent_task_names_its_harness_and_no_tools() -> None:
    task = load_task("swe/offline_mini_swe_agent_harness")
    assert task.type == "swe" and task.tools == []
    harness = task.harness
    assert harness is not None and harness.name == "mini-swe-agent"
    assert harness.install.pip == ["mini-swe-agent==2.4.6"]
    assert harness.config_file == (TASKS_DIR / "swe" / "mini_swe_agent.yaml").resolve()
    assert harness.config_file.is_file() and harness.collect == "workspace_patch"
    assert task.dataset.path == load_task("swe/offline").dataset.path  # the suite it extends
    assert load_task("swe/offline").harness is None


def write_task(tmp_path: Path, harness: str, tools: str = "[]") -> Path:
    (tmp_path / "rows.jsonl").write_text('{"question": "q"}\n')
    (tmp_path / "agent.yaml").write_text("agent: {}\n")
    path = tmp_path / "t.yaml"
    path.write_text(
        f"name: t\ntype: math\ndataset: {{path: rows.jsonl}}\ntools: {tools}\nharness:\n"
        + "".join(f"  {line}\n" for line in harness.strip().splitlines())
    )
    return path


BASE = "name: h\ninstall: {pip: [pkg==1.0]}\ncommand: [run, '{prompt}']\n"
ANSWERED = BASE + "collect: answer_file\nanswer_file: answer.txt\n"  # how a math task collects what a harness did


@pytest.mark.parametrize(
    ("harness", "tools", "error"),
    [
        (BASE, "[bash]", "field 'harness': Value error, a harness brings its own tools: expected tools: [] beside it"),
        (BASE.replace("pkg==1.0", "pkg"), "[]", "field 'harness.install.pip': Value error, expected a pinned "
         "name==version, got 'pkg'"),
        (BASE.replace("pkg==1.0", "pkg>=1.0"), "[]", "expected a pinned name==version, got 'pkg>=1.0'"),
        (BASE.replace("pip: [pkg==1.0]", "npm: ['@openai/codex']"), "[]", "field 'harness.install.npm': Value "
         "error, expected a pinned name@version, got '@openai/codex'"),
        (BASE.replace("pip: [pkg==1.0]", "npm: ['codex==1.0']"), "[]", "expected a pinned name@version"),
        (BASE + "comand: [x]\n", "[]", "field 'harness.comand': unknown key; known: name, install, command, "
         "config_file, env, max_turns, timeout_s, collect, answer_file"),
        (BASE.replace("command: [run, '{prompt}']", "command: []"), "[]", "field 'harness.command'"),
        (BASE + "collect: answer_file\n", "[]", "field 'harness.answer_file': Value error, expected a path exactly "
         "when collect is answer_file"),
        (BASE + "answer_file: out.txt\n", "[]", "expected a path exactly when collect is answer_file"),
        (BASE + "timeout_s: 0\n", "[]", "field 'harness.timeout_s': Input should be greater than 0"),
        (ANSWERED + "config_file: missing.yaml\n", "[]", "field 'harness.config_file': no file"),
        (BASE, "[]", "field 'harness': Value error, collect: workspace_patch is the swe env's patch; a math task "
         "collects its answer from a file: expected collect: answer_file"),
        (BASE + "collect: answer_file\nanswer_file: ../answer.txt\n", "[]", "field 'harness.answer_file': Value "
         "error, expected a path inside the workspace, relative to it, got '../answer.txt'"),
        (BASE + "collect: answer_file\nanswer_file: /tmp/answer.txt\n", "[]", "expected a path inside the workspace"),
    ],
)
def test_a_bad_harness_section_is_refused_naming_file_and_field(
    tmp_path: Path, harness: str, tools: str, error: str
) -> None:
    path = write_task(tmp_path, harness, tools)
    with pytest.raises(TaskConfigError) as refused:
        load_task(str(path))
    message = str(refused.value)
    assert message.startswith(f"task file {path}: ") and error in message and "\n" not in message


def test_a_good_harness_section_resolves_its_config_beside_the_task_file(tmp_path: Path) -> None:
    path = write_task(
        tmp_path, BASE.replace("pip: [pkg==1.0]", "pip: [pkg==1.0], npm: ['@openai/codex@0.1.2']")
        + "config_file: agent.yaml\ncollect: answer_file\nanswer_file: answer.txt\n",
    )  # fmt: skip
    harness = load_task(str(path)).harness
    assert harness is not None and harness.config_file == (tmp_path / "agent.yaml").resolve()
    assert harness.install.npm == ["@openai/codex@0.1.2"] and harness.answer_file == "answer.txt"


def test_a_layer_pip_cannot_build_is_an_image_error_naming_the_package(rootfs: Path, tmp_path: Path) -> None:
    with pytest.raises(ImageError, match=r"^pip install mini-swe-agent==0\.0\.0\.1 failed \(exit 1\):"):
        build_pip_layer(["mini-swe-agent==0.0.0.1"], rootfs, cache=tmp_path)
    assert not list((tmp_path / "layers").glob("pip-*"))  # nothing half-built is left to be taken for a layer
