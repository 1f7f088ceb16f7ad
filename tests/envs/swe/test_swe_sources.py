"""Where SWE rows come from, run for real on a small local repository: a `git:PATH` source, a row with its own
SWE-bench-style `eval_script`, and an R2E-Gym row whose image holds the repository at /testbed, graded by the exact
test map. Real bubblewrap, git, pytest and the swebench harness.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from sandbox_helpers import reachable_temp_dir

from nemo_gym_prorl.contracts.task import TaskInstance, load_task
from nemo_gym_prorl.envs.swe.env import SweEnvironment
from nemo_gym_prorl.envs.swe.repo import CACHE_ENV
from nemo_gym_prorl.tool_calls import ToolCall

BUGGY = "def add(a, b):\n    return a - b\n\n\ndef mul(a, b):\n    return a * b\n"
TESTS_BEFORE = "from calc import add, mul\n\n\ndef test_mul():\n    assert mul(2, 3) == 6\n"
TESTS_AFTER = TESTS_BEFORE + "\n\ndef test_add():\n    assert add(2, 3) == 5\n"
F2P, P2P = "tests/test_calc.py::test_add", "tests/test_calc.py::test_mul"


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True).stdout


class LocalRepo:
    """A two-file package with a bug at `base`; `gold` fixes it and `test_patch` adds the test that shows it."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.mkdir()
        git(path, "init", "-q", "-b", "main")
        git(path, "config", "user.email", "t@localhost")
        git(path, "config", "user.name", "t")
        self._commit({"calc/__init__.py": BUGGY, "tests/test_calc.py": TESTS_BEFORE}, "base")
        self.base = git(path, "rev-parse", "HEAD").strip()
        self._commit({"calc/__init__.py": BUGGY.replace("a - b", "a + b")}, "the fix")
        self.gold = git(path, "diff", self.base, "HEAD")
        git(path, "checkout", "-q", self.base, "--", ".")
        self._commit({"tests/test_calc.py": TESTS_AFTER}, "the tests")
        self.test_patch = git(path, "diff", "HEAD~1", "HEAD", "--", "tests")

    def _commit(self, files: dict[str, str], message: str) -> None:
        for name, text in files.items():
            (self.path / name).parent.mkdir(parents=True, exist_ok=True)
            (self.path / name).write_text(text)
        git(self.path, "add", "-A")
        git(self.path, "commit", "-qm", message)

    def swebench_row(self, **extra: object) -> dict[str, object]:
        return {"instance_id": "local__calc-1", "repo": "local/calc", "base_commit": self.base, "version": "0.1",
                "problem_statement": "add(2, 3) is -1", "FAIL_TO_PASS": [F2P], "PASS_TO_PASS": [P2P],
                "patch": self.gold, "test_patch": self.test_patch, "repo_source": f"git:{self.path}", **extra}  # fmt: skip


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> LocalRepo:
    return LocalRepo(tmp_path_factory.mktemp("src") / "calc")


def environment(**verifier: object) -> SweEnvironment:
    task = load_task("swe/offline")
    task.verifier = task.verifier | {"skip_empty_patch": False} | verifier
    return SweEnvironment(task, "bwrap")


async def bash_in_an_episode(env: SweEnvironment, instance_id: str, row: dict[str, object], command: str) -> str:
    """What `command` prints in a freshly staged episode of `row` (closed after)."""
    episode = await env.init(TaskInstance(instance_id=instance_id, data=row))
    try:
        return (await env.call_tool(episode, ToolCall(name="bash", arguments={"command": command}))).text
    finally:
        await env.close(episode)


async def grade(env: SweEnvironment, row: dict[str, object], patch: str) -> tuple[float, dict]:
    instance = TaskInstance(instance_id=str(row.get("instance_id", "r2e-0")), data=row)
    evaluation = await env.grade(instance, {"patch": patch})
    return evaluation.reward, evaluation.details


async def test_a_git_source_is_staged_at_its_base_and_graded(repo: LocalRepo, rootfs: Path) -> None:
    env = environment()
    row = repo.swebench_row()
    seen = await bash_in_an_episode(env, "local__calc-1", row, "pwd; git log --format=%s; grep -c 'a - b' calc/__init__.py")
    assert seen.split() == ["/testbed", "base", "1"], seen  # one squashed commit, on the buggy base
    reward, details = await grade(env, row, repo.gold)
    assert reward == 1.0 and details["fail_to_pass"] == "1/1" and details["pass_to_pass"] == "1/1", details
    reward, details = await grade(env, row, "")
    assert reward == 0.0 and details["failing_tests"] == [F2P], details


async def test_a_swebench_eval_script_runs_as_is_at_testbed(repo: LocalRepo, rootfs: Path) -> None:
    script = f"""#!/bin/bash
set -uxo pipefail
cd /testbed
git checkout {repo.base} tests/test_calc.py
git apply -v - <<'EOF_114329324912'
{repo.test_patch}
EOF_114329324912
: '>>>>> Start Test Output'
python3 -m pytest -rA -p no:cacheprovider tests/test_calc.py
: '>>>>> End Test Output'
git checkout {repo.base} tests/test_calc.py
"""
    env = environment(test_command="false")  # the script, not the task's test command, runs the tests
    row = repo.swebench_row(eval_script=script)
    reward, details = await grade(env, row, repo.gold)
    assert reward == 1.0 and details["fail_to_pass"] == "1/1", details
    tampered = repo.gold + "diff --git a/tests/test_calc.py b/tests/test_calc.py\n--- a/tests/test_calc.py\n" \
        "+++ b/tests/test_calc.py\n@@ -4,2 +4,2 @@ from calc import add, mul\n def test_mul():\n" \
        "-    assert mul(2, 3) == 6\n+    assert True\n"  # fmt: skip
    reward, details = await grade(env, row, tampered)  # the script puts the test file back to the base first
    assert reward == 1.0 and details["patch_applied"], details
    reward, details = await grade(env, row, "")
    assert reward == 0.0 and details["failing_tests"] == [F2P], details


@pytest.fixture(scope="module")
def r2e_images(repo: LocalRepo, rootfs: Path) -> Iterator[Path]:
    """A directory of images named as R2E-Gym's `docker_image`s: the default rootfs (hard links) with the repository
    at /testbed, its history and the tests included, and R2E-Gym's `run_tests.sh`."""
    with reachable_temp_dir() as images:
        image = images / "local_calc_r2e"
        subprocess.run(["cp", "-al", str(rootfs), str(image)], check=True)
        testbed = image / "testbed"
        shutil.rmtree(testbed, ignore_errors=True)
        subprocess.run(["git", "clone", "-q", str(repo.path), str(testbed)], check=True)
        git(testbed, "checkout", "-q", repo.base)
        (testbed / "tests/test_calc.py").write_text(TESTS_AFTER)
        (testbed / "run_tests.sh").write_text("python3 -m pytest -rA -p no:cacheprovider tests\n")
        for path in [testbed, *testbed.rglob("*")]:
            os.chmod(path, 0o755 if path.is_dir() else 0o644)
        yield images


async def test_an_r2egym_row_is_resolved_only_by_the_exact_test_map(
    repo: LocalRepo, r2e_images: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    env = environment(image=str(r2e_images / "{docker_image_name}"))
    row = {"docker_image": "local/calc:r2e", "repo_name": "calc", "commit_hash": repo.base, "patch": repo.gold,
           "problem_statement": "add(2, 3) is -1", "expected_output_json": json.dumps({F2P: "PASSED", P2P: "PASSED"})}  # fmt: skip
    seen = await bash_in_an_episode(env, "r2e-0", row, "pwd; git log --oneline | wc -l")
    assert seen.split() == ["/testbed", "1"]  # the image's /testbed, its history squashed
    assert list((tmp_path / "cache/images").iterdir())  # taken out of the image once

    assert (await grade(env, row, repo.gold))[0] == 1.0
    reward, details = await grade(env, row, "")
    assert reward == 0.0 and details["failing_tests"] == [F2P], details
    extra = "diff --git a/tests/test_extra.py b/tests/test_extra.py\nnew file mode 100644\n--- /dev/null\n" \
            "+++ b/tests/test_extra.py\n@@ -0,0 +1,2 @@\n+def test_more():\n+    pass\n"  # fmt: skip
    reward, details = await grade(env, row, repo.gold + extra)  # all expected tests pass, one more runs: not equal
    assert reward == 0.0 and details["failing_tests"] == ["tests/test_extra.py::test_more"], details
