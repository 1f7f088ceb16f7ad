"""`prorl task show` prints a task as it loads; `prorl task check` fails on rows its grader cannot grade right."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from nemo_gym_prorl.contracts.task import TASKS_DIR

PRORL = [str(Path(sys.executable).with_name("prorl"))]


def prorl_task(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*PRORL, "task", *args], capture_output=True, text=True, timeout=120, cwd=cwd)


def test_show_prints_the_data_its_splits_the_settings_with_defaults_and_a_rendered_prompt() -> None:
    result = prorl_task("show", "stem/units")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "32 rows in" in out and "train 29, validation 3" in out and "tools: python, finish" in out
    assert "grading_mode: null" in out and "rel_tol: 0.01" in out  # a default filled in, the file's value
    first = json.loads((TASKS_DIR / "stem/data/units.jsonl").read_text().splitlines()[0])
    assert f"[user] {first['question']}" in out


def test_check_lists_the_rows_a_grader_gets_wrong_and_exits_1(tmp_path: Path) -> None:
    prose = "Danny Casey played football for Ireland, and later coached in the League of Ireland. " * 20
    rows = [{"id": "ok", "question": "1 + 1?", "answer": "2"}, {"id": "prose", "question": "Who?", "answer": prose}]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "task.yaml").write_text("extends: math/arithmetic\nname: mine\ndataset: {path: rows.jsonl, id_key: id}\n")
    result = prorl_task("check", str(tmp_path / "task.yaml"), cwd=tmp_path)
    assert result.returncode == 1, result.stderr
    assert "1 of 2 rows grade as known" in result.stdout and "failing rows: prose" in result.stdout
    assert "prose: FAILS gold scored an error, expected 1" in result.stdout


def test_a_bad_task_file_is_one_line_and_exit_2(tmp_path: Path) -> None:
    (tmp_path / "task.yaml").write_text("extends: math/arithmetic\nname: mine\nverifier: {answer_kee: answer}\n")
    result = prorl_task("check", str(tmp_path / "task.yaml"))
    assert result.returncode == 2 and result.stderr.count("\n") == 1
    assert "field 'verifier.answer_kee': unknown key; known: answer_key" in result.stderr
