"""`prorl swe generate` run as a user runs it, on a tiny src-layout sdist built here: the project is installed where
it is staged (generation, rollout and evaluation alike), its instances come out graded by the SWE environment, and a
project that cannot give what its suite asks for fails the run with one line saying why. Real bubblewrap sandboxes
on the default image, real pip, git and pytest.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import yaml

from nemo_gym_prorl.contracts.task import TaskInstance, load_task
from nemo_gym_prorl.envs.swe.env import SweEnvironment
from nemo_gym_prorl.envs.swe.repo import CACHE_ENV
from nemo_gym_prorl.envs.swe.rows import patch_files
from nemo_gym_prorl.tool_calls import ToolCall

PRORL = str(Path(sys.executable).with_name("prorl"))
PYPROJECT = """[build-system]
requires = ["setuptools"]
build-backend = "{backend}"

[project]
name = "{name}"
version = "0.1"
"""
CALC = '''def clamp(value, low, high):
    if value < low:
        return low
    if value > high:
        return high
    return value


def total(values):
    result = 0
    for value in values:
        result += value
    return result
'''
UNTESTED = "def double(x):\n    return x * 2\n"
TESTS = """from tinycalc import clamp, total


def test_clamp_low():
    assert clamp(-5, 0, 10) == 0


def test_clamp_high():
    assert clamp(50, 0, 10) == 10


def test_clamp_inside():
    assert clamp(5, 0, 10) == 5


def test_total():
    assert total([1, 2, 3]) == 6
"""


def sdist(folder: Path, name: str, backend: str = "setuptools.build_meta") -> str:
    """Write `name`-0.1.tar.gz, a src layout (its tests import it only once it is installed); its sha256."""
    files = {"pyproject.toml": PYPROJECT.format(name=name, backend=backend), "src/tinycalc/__init__.py": CALC,
             "src/tinycalc/untested.py": UNTESTED, "tests/test_tinycalc.py": TESTS}  # fmt: skip
    archive = folder / f"{name}-0.1.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        for path, text in files.items():
            info = tarfile.TarInfo(f"{name}-0.1/{path}")
            info.size = len(text.encode())
            tar.addfile(info, io.BytesIO(text.encode()))
    return hashlib.sha256(archive.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def sdists(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    """A folder of local sdists (no network in tests) and each one's sha256 by name."""
    folder = tmp_path_factory.mktemp("sdists")
    return folder, {"tinycalc": sdist(folder, "tinycalc"), "brokenpkg": sdist(folder, "brokenpkg", "no_such_backend")}


def generate(  # type: ignore[no-untyped-def]
    tmp_path: Path, sdists: tuple[Path, dict[str, str]], name: str, module: str, tests: str = "tests/test_tinycalc.py"
):
    """`prorl swe generate` on a suite of one project asking for one instance, its sdist taken from `sdists`."""
    folder, shas = sdists
    project = {"name": name, "version": "0.1", "sha256": shas[name], "modules": [module], "tests": [tests],
               "instances": 1}  # fmt: skip
    suite = tmp_path / "suite.yaml"
    suite.write_text(yaml.safe_dump({"seed": 0, "image": "default-rootfs", "projects": [project]}))
    argv = [PRORL, "swe", "generate", "--suite", str(suite), "--output", str(tmp_path / "out.jsonl"),
            "--sdists", str(folder)]  # fmt: skip
    env = os.environ | {CACHE_ENV: str(tmp_path / "cache")}
    return subprocess.run(argv, capture_output=True, text=True, timeout=300, env=env, check=False)


async def test_a_src_layout_project_gives_instances_its_gold_patch_resolves(
    tmp_path: Path, sdists: tuple[Path, dict[str, str]], rootfs: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = generate(tmp_path, sdists, "tinycalc", "src/tinycalc/__init__.py")
    assert run.returncode == 0, run.stderr
    assert "tinycalc: 4 tests pass twice" in run.stderr and "1 instances from 1 projects" in run.stdout
    (row,) = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert row["instance_id"] == "pypi__tinycalc-0001" and row["repo_source"].startswith("sdist:tinycalc==0.1#")
    assert patch_files(row["patch"]) == patch_files(row["base_patch"]) == ["src/tinycalc/__init__.py"]

    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))  # where the generator put the sdist
    task = load_task("swe/offline")
    task.verifier = task.verifier | {"skip_empty_patch": False}
    env = SweEnvironment(task, "bwrap")
    instance = TaskInstance(instance_id=row["instance_id"], data=row)
    episode = await env.init(instance)
    try:
        command = f"git status --porcelain; cd /tmp && python3 -c 'import tinycalc; print(tinycalc.__file__)'; " \
                  f"cd /testbed && git apply <<'EOF'\n{row['patch']}EOF\n"  # fmt: skip
        seen = (await env.call_tool(episode, ToolCall(name="bash", arguments={"command": command}))).text
        submission = await env.collect(episode)
    finally:
        await env.close(episode)
    assert seen.split()[0] == "/testbed/src/tinycalc/__init__.py", seen  # installed; nothing untracked or changed
    assert patch_files(submission["patch"]) == ["src/tinycalc/__init__.py"], submission  # no egg-info, no .local
    gold = await env.grade(instance, submission)
    assert gold.resolved, gold.details
    empty = await env.grade(instance, {"patch": ""})
    assert not empty.resolved and empty.details["failing_tests"] == json.loads(row["FAIL_TO_PASS"]), empty.details


@pytest.mark.parametrize(
    ("module", "tests", "why"),
    [("src/tinycalc/untested.py", "tests/test_tinycalc.py", "no mutation made a test fail (2 tried)"),  # no test calls it
     ("src/tinycalc/__init__.py", "tests/test_gone.py",
      "0 of its tests pass twice (ERROR: file or directory not found: tests/test_gone.py)")],
    ids=["no-mutation-caught", "no-test-passes"],
)  # fmt: skip
def test_a_project_that_yields_fewer_instances_than_asked_fails_the_run(
    tmp_path: Path, sdists: tuple[Path, dict[str, str]], rootfs: Path, module: str, tests: str, why: str
) -> None:
    run = generate(tmp_path, sdists, "tinycalc", module, tests)
    assert run.returncode == 1, run.stderr
    assert run.stderr.splitlines()[-1] == \
        f"prorl swe generate (nothing written): project tinycalc 0.1: asked for 1 instances, made 0: {why}"  # fmt: skip
    assert not (tmp_path / "out.jsonl").exists()


def test_a_project_whose_install_fails_names_itself_and_pips_last_lines(
    tmp_path: Path, sdists: tuple[Path, dict[str, str]], rootfs: Path
) -> None:
    run = generate(tmp_path, sdists, "brokenpkg", "src/tinycalc/__init__.py")
    assert run.returncode == 1, run.stderr
    assert "prorl swe generate (nothing written): project brokenpkg 0.1: installing the project failed" in run.stderr
    assert "no_such_backend" in run.stderr.split("pip's last lines:", 1)[1], run.stderr
