"""`prorl swe generate`: the offline SWE suite, made deterministically from pinned PyPI sdists, no LLM.

For each project of the suite's YAML (name, version, sha256, the modules to mutate, the tests): the sdist's tree
(``swe_repo``) is staged in a real sandbox on the suite's image, its tests run twice (tests that differ between
the runs are flaky and never used), then seeded mutations (``mutations``) are tried one at a time: a mutation is
kept when the tests, run twice, agree that at least one test now fails (FAIL_TO_PASS) and at least one still
passes (PASS_TO_PASS). The files holding the failing tests become the hidden ``test_patch`` (files a ``test_patch``
creates are absent from a staged base; ``base_patch`` carries the bug); the gold ``patch`` undoes the bug. The problem statement says what
fails and where, not how to fix it. Every row is gated through the SWE environment itself: the gold patch must
resolve it and the empty patch must not. A project that yields fewer rows than its ``instances`` fails the run,
saying why (``GenerationError``); nothing is written then.

The same YAML, seed and Python give the same file, byte for byte.
"""

from __future__ import annotations

import argparse
import asyncio
import difflib
import io
import json
import random
import sys
import tarfile
from pathlib import Path

import yaml
from pydantic import BaseModel, Field

from nemo_gym_prorl.contracts.task import TASKS_DIR, DatasetConfig, TaskConfig, TaskInstance
from nemo_gym_prorl.envs.swe import repo as swe_repo
from nemo_gym_prorl.envs.swe.env import SweEnvironment
from nemo_gym_prorl.envs.swe.generator.check import check_instance
from nemo_gym_prorl.envs.swe.generator.mutations import Mutation, mutations
from nemo_gym_prorl.envs.swe.rows import parse_row
from nemo_gym_prorl.envs.swe.stage import WORKDIR, StagingError, stage_repository
from nemo_gym_prorl.sandbox import SandboxLimits, SandboxSpec, open_sandbox

_RUN_LOG = ".prorl-gen.log"
_STATEMENTS = (
    "{count} test(s) in `{files}` fail: {tests}.\nThe failures come from `{function}` in `{module}`. Fix the "
    "library so that these tests pass again, without breaking the other tests.",
    "After a recent change, `{function}` (in `{module}`) no longer behaves as its tests expect: {tests} in "
    "`{files}` fail. Find the defect and fix it; the rest of the test suite must keep passing.",
    "Bug report: calling `{function}` from `{module}` gives wrong results. These tests in `{files}` catch it: "
    "{tests}. Please fix the implementation.",
)


class GenerationError(RuntimeError):
    """A project the suite cannot be made from; the one-line message names it and says why."""


class Project(BaseModel):
    name: str
    version: str
    sha256: str
    modules: list[str] = Field(description="files whose functions are mutated")
    tests: list[str] = Field(description="pytest paths of the project's own suite")
    instances: int = Field(16, ge=1)


class Suite(BaseModel):
    seed: int = 0
    image: str = Field("default-rootfs", description="as a swe task's verifier.image")
    max_test_file_bytes: int = 40_000
    max_pass_to_pass: int = 50
    max_candidates: int = 200
    projects: list[Project]


def _run_tests_command(tests: list[str]) -> list[str]:
    command = f"python3 -m pytest -rA -p no:cacheprovider {' '.join(tests)} > {_RUN_LOG} 2>&1; true"
    return ["bash", "-c", command]


async def _test_statuses(sandbox, tests: list[str]) -> dict[str, str]:  # type: ignore[no-untyped-def]
    from swebench.harness.log_parsers import parse_log_pytest_v2

    result = await sandbox.exec(_run_tests_command(tests), timeout=300)
    if result.timed_out:
        raise RuntimeError("the project's tests timed out")
    return parse_log_pytest_v2(await _run_log(sandbox), None)


async def _run_log(sandbox) -> str:  # type: ignore[no-untyped-def]
    return (await sandbox.read_file(_RUN_LOG)).decode(errors="replace")


def _first_error(log: str) -> str:
    """The line of a pytest log that says best why nothing passed: its first error, else its last line."""
    lines = [" ".join(line.split()) for line in log.splitlines() if line.strip()]
    return next((line for line in lines if line.startswith(("ERROR", "E "))), lines[-1] if lines else "no output")


def _passing(statuses: dict[str, str]) -> set[str]:
    return {t for t, s in statuses.items() if s in ("PASSED", "XFAIL")}


def file_diff(path: str, before: str | None, after: str | None) -> str:
    """A git-style diff of one file (None: absent on that side)."""
    old = (before or "").splitlines(keepends=True)
    new = (after or "").splitlines(keepends=True)
    for lines in (old, new):
        if lines and not lines[-1].endswith("\n"):
            lines[-1] += "\n\\ No newline at end of file\n"
    header = f"diff --git a/{path} b/{path}\n"
    if before is None:
        header += "new file mode 100644\n"
    elif after is None:
        header += "deleted file mode 100644\n"
    body = difflib.unified_diff(
        old, new, "/dev/null" if before is None else f"a/{path}", "/dev/null" if after is None else f"b/{path}", n=3
    )
    return header + "".join(body)


def _tree_files(tree: bytes) -> dict[str, str]:
    with tarfile.open(fileobj=io.BytesIO(tree)) as tar:
        out = {}
        for member in tar.getmembers():
            if member.isfile() and member.name.endswith(".py"):
                data = tar.extractfile(member)
                assert data is not None
                out[member.name] = data.read().decode()
        return out


def _statement(rng: random.Random, mutation: Mutation, module: str, f2p: list[str], files: list[str]) -> str:
    shown = ", ".join(f"`{t.split('::', 1)[-1]}`" for t in f2p[:5]) + (" and others" if len(f2p) > 5 else "")
    template = rng.choice(_STATEMENTS)
    return template.format(count=len(f2p), files="`, `".join(files), tests=shown, function=mutation.function,
                           module=module)  # fmt: skip


class _Made(BaseModel):
    """A project's candidate rows, and what explains it when they are too few."""

    rows: list[dict]
    shortfall: str = Field(description="why no more rows came: what the tests and mutations did")


async def generate_project(  # type: ignore[no-untyped-def]
    suite: Suite, project: Project, image: str | None, log, sdists: Path | None = None
) -> _Made:
    source = swe_repo.sdist_source(project.name, project.version, project.sha256)
    try:
        tree = await asyncio.to_thread(swe_repo.tree_tar, source, "", sdists)
    except swe_repo.RepoSourceError as e:
        raise GenerationError(f"project {project.name} {project.version}: {e}") from None
    files = _tree_files(tree)
    spec = SandboxSpec(image=image, limits=SandboxLimits(wall_clock_s=7200, memory_mb=2048),
                       env={"PYTHONDONTWRITEBYTECODE": "1"}, workspace=WORKDIR)  # fmt: skip
    rng = random.Random(f"{suite.seed}:{project.name}")
    candidates = [(module, m) for module in project.modules for m in mutations(files[module])]
    rng.shuffle(candidates)
    rows: list[dict] = []
    tried = caught = 0
    async with open_sandbox("bwrap", spec) as sandbox:
        try:
            await stage_repository(sandbox, WORKDIR, tree, "", 300, install=True)
        except StagingError as e:
            raise GenerationError(f"project {project.name} {project.version}: {e}") from None
        first, second = await _test_statuses(sandbox, project.tests), await _test_statuses(sandbox, project.tests)
        baseline = _passing(first) & _passing(second)
        log(f"{project.name}: {len(baseline)} tests pass twice, {len(candidates)} candidate mutations")
        if not baseline:
            return _Made(rows=[], shortfall=f"0 of its tests pass twice ({_first_error(await _run_log(sandbox))})")
        for module, mutation in candidates[: suite.max_candidates]:
            if len(rows) >= project.instances:
                break
            tried += 1
            await sandbox.write_file(module, mutation.source.encode())
            try:
                runs = [await _test_statuses(sandbox, project.tests)]
                if baseline - _passing(runs[0]):
                    runs.append(await _test_statuses(sandbox, project.tests))
            finally:
                await sandbox.write_file(module, files[module].encode())
            failing = set.intersection(*(baseline - _passing(r) for r in runs))
            still = set.intersection(*(_passing(r) for r in runs)) & baseline
            caught += bool(failing)
            test_files = sorted({t.split("::", 1)[0] for t in failing})
            if not failing or any(len(files[f].encode()) > suite.max_test_file_bytes for f in test_files):
                continue
            f2p = sorted(failing)
            p2p = sorted(t for t in still if t.split("::", 1)[0] in test_files)
            if not p2p:
                continue
            p2p = sorted(random.Random(f"{suite.seed}:{mutation.source}").sample(p2p, min(len(p2p), suite.max_pass_to_pass)))
            bug = file_diff(module, files[module], mutation.source)
            row = {
                "instance_id": f"pypi__{project.name}-{len(rows) + 1:04d}",
                "repo": f"pypi/{project.name}",
                "version": project.version,
                "base_commit": "",
                "repo_source": source,
                "base_patch": bug,
                "patch": file_diff(module, mutation.source, files[module]),
                "test_patch": "".join(file_diff(f, None, files[f]) for f in test_files),
                "FAIL_TO_PASS": json.dumps(f2p),
                "PASS_TO_PASS": json.dumps(p2p),
                "problem_statement": _statement(rng, mutation, module, f2p, test_files),
                "log_parser": "parse_log_pytest_v2",
                "mutation": f"{mutation.kind} in {module}:{mutation.function} (line {mutation.line})",
            }
            rows.append(row)
            log(f"{row['instance_id']}: {row['mutation']}: {len(f2p)} fail-to-pass, {len(p2p)} pass-to-pass")
    if not caught:
        return _Made(rows=rows, shortfall=f"no mutation made a test fail ({tried} tried)")
    limit = f" (max_candidates: {suite.max_candidates})" if tried == suite.max_candidates else ""
    return _Made(rows=rows, shortfall=f"{tried} mutations tried{limit}, {caught} made a test fail, {len(rows)} of "
                 "those kept a test of the same files passing with test files under max_test_file_bytes")  # fmt: skip


async def gate(rows: list[dict], image_setting: str, log) -> tuple[list[dict], list[str]]:  # type: ignore[no-untyped-def]
    """Keep the rows whose gold patch resolves and whose empty patch does not, with base_commit filled in; and why
    each other row was dropped."""
    task = TaskConfig(name="swe/generate", type="swe", dataset=DatasetConfig(path=Path("generated.jsonl")),
                      limits=SandboxLimits(wall_clock_s=900, memory_mb=2048),
                      verifier={"image": image_setting, "skip_empty_patch": False})  # fmt: skip
    env = SweEnvironment(task, "bwrap")
    kept: list[dict] = []
    dropped: list[str] = []
    for row in rows:
        instance = TaskInstance(instance_id=row["instance_id"], data=row)
        sandbox, base = await env._staged_sandbox(parse_row(row, row["instance_id"]))
        await sandbox.close()
        checked = await check_instance(env, instance)
        if checked.sound:
            kept.append(row | {"base_commit": base})
        else:
            dropped.append(checked.why)
            log(f"{row['instance_id']}: dropped by the gate ({checked.why})")
    return kept, dropped


async def generate(suite: Suite, log, sdists: Path | None = None) -> list[dict]:  # type: ignore[no-untyped-def]
    """Every project's gated rows; a `GenerationError` at the first project that yields fewer than it asks for."""
    from nemo_gym_prorl.envs.swe.images import resolve_image

    probe = parse_row({"instance_id": "probe", "repo": "", "base_commit": "", "problem_statement": "",
                       "FAIL_TO_PASS": [], "PASS_TO_PASS": [], "patch": "", "test_patch": "", "version": ""}, "probe")  # fmt: skip
    image = resolve_image(suite.image, probe, Path.cwd())
    rows = []
    for project in suite.projects:
        made = await generate_project(suite, project, image, log, sdists)
        kept, dropped = await gate(made.rows, suite.image, log)
        if len(kept) < project.instances:
            why = made.shortfall + (f"; the gate dropped {len(dropped)} ({dropped[0]})" if dropped else "")
            raise GenerationError(f"project {project.name} {project.version}: asked for {project.instances} "
                                  f"instances, made {len(kept)}: {why}")  # fmt: skip
        for i, row in enumerate(kept, 1):  # numbered after the gate, so ids have no gaps
            row["instance_id"] = f"pypi__{project.name}-{i:04d}"
        rows += kept
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="prorl swe generate", description=__doc__.split("\n\n")[0])
    parser.add_argument("--suite", type=Path, default=TASKS_DIR / "swe/offline/suite.yaml")
    parser.add_argument("--output", type=Path, help="JSONL to write (default: the suite's offline.jsonl beside it)")
    parser.add_argument("--projects", nargs="*", help="only these projects (by name)")
    parser.add_argument("--sdists", type=Path, help="a folder holding the pinned sdists (matched by sha256), "
                        "used instead of PyPI for those not in the cache yet")  # fmt: skip
    args = parser.parse_args(argv)
    if args.sdists is not None and not args.sdists.is_dir():
        parser.error(f"--sdists {args.sdists}: expected a folder of sdist archives")
    suite = Suite.model_validate(yaml.safe_load(args.suite.read_text()))
    if args.projects:
        suite.projects = [p for p in suite.projects if p.name in args.projects]
    output = args.output or args.suite.parent / "offline.jsonl"
    try:
        rows = asyncio.run(generate(suite, lambda line: print(line, file=sys.stderr, flush=True), args.sdists))
    except GenerationError as e:
        print(f"prorl swe generate (nothing written): {e}", file=sys.stderr)
        return 1
    output.write_text("".join(json.dumps(row, sort_keys=True) + "\n" for row in rows))
    print(f"{len(rows)} instances from {len({r['repo'] for r in rows})} projects -> {output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
