"""The swe task type against real parts: shipped rows staged in real bubblewrap sandboxes on the default image,
real git, real pytest, graded by the swebench package; the service path with a scripted stand-in model.

The gold patch of a fixed sample of shipped instances (one per project) must resolve and the empty patch must not;
`prorl swe generate` gates every shipped row the same way when it makes them.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from standin_helpers import running_standin

from nemo_gym_prorl.contracts.job import JobRequest
from nemo_gym_prorl.contracts.task import TaskInstance, load_task
from nemo_gym_prorl.envs import make_environment
from nemo_gym_prorl.envs.dataset import load_instances
from nemo_gym_prorl.envs.swe.env import SweEnvironment
from nemo_gym_prorl.envs.swe.images import ImageNotFound
from nemo_gym_prorl.envs.swe.rows import SweRowError, parse_row
from nemo_gym_prorl.envs.swe.stage import clean_patch
from nemo_gym_prorl.gym.processes import gym_environ, run_gym
from nemo_gym_prorl.gym.venvs import ensure_venv_links
from nemo_gym_prorl.launch.runtime import ModelConfig, ServiceConfig, ServiceSettings
from nemo_gym_prorl.launch.serve import run_service
from nemo_gym_prorl.service.client import RolloutClient
from nemo_gym_prorl.tool_calls import ToolCall

TASK = "swe/offline"


@pytest.fixture(scope="module")
def env(rootfs: Path) -> SweEnvironment:
    environment = make_environment(load_task(TASK), "bwrap")
    assert isinstance(environment, SweEnvironment)
    return environment


@pytest.fixture(scope="module")
def instances(rootfs: Path) -> dict[str, TaskInstance]:
    return {i.instance_id: i for i in load_instances(load_task(TASK).dataset)}


def sample(instances: dict[str, TaskInstance]) -> list[TaskInstance]:
    """The first instance of each project (a fixed sample)."""
    first: dict[str, TaskInstance] = {}
    for instance in instances.values():
        first.setdefault(instance.data["repo"], instance)
    return list(first.values())


def bash(command: str) -> ToolCall:
    return ToolCall(name="bash", arguments={"command": command})


def apply_command(patch: str) -> str:
    return f"git apply <<'PRORL_EOF'\n{patch}PRORL_EOF\n"


async def agent_runs(env: SweEnvironment, instance: TaskInstance, command: str) -> dict:
    """What an episode whose agent ran `command` submits."""
    episode = await env.init(instance)
    try:
        await env.call_tool(episode, bash(command))
        return await env.collect(episode)
    finally:
        await env.close(episode)


def test_shipped_suite_has_60_instances_from_4_projects(instances: dict[str, TaskInstance]) -> None:
    rows = [parse_row(i.data, i.instance_id) for i in instances.values()]
    assert len(rows) >= 60 and len({r.repo for r in rows}) >= 4
    assert all(r.FAIL_TO_PASS and r.PASS_TO_PASS and r.repo_source.startswith("sdist:") for r in rows)


def test_rows_missing_a_field_are_refused_naming_row_and_field(env: SweEnvironment, instances) -> None:
    row = dict(next(iter(instances.values())).data)
    del row["test_patch"]
    with pytest.raises(SweRowError, match=r"row pypi__\w+-0001: missing field 'test_patch'"):
        env.prompt_messages(TaskInstance(instance_id=row["instance_id"], data=row))
    with pytest.raises(SweRowError, match="FAIL_TO_PASS"):
        parse_row(row | {"test_patch": "", "FAIL_TO_PASS": "not json"}, "r7")
    r2e = parse_row({"docker_image": "namanjain12/x:1", "problem_statement": "p",
                     "expected_output_json": '{"t::a": "PASSED", "t::b": "FAILED"}'}, "3")  # fmt: skip
    assert r2e.expected_status == {"t::a": "PASSED", "t::b": "FAILED"} and r2e.FAIL_TO_PASS == ["t::a"]


def test_gym_swebench_rows_are_accepted() -> None:
    import resources_servers.swebench as gym_swebench

    path = Path(gym_swebench.__path__[0]) / "data" / "example.jsonl"
    row = json.loads(path.read_text().splitlines()[0])
    parsed = parse_row(row, "0")
    assert parsed.instance_id == "astropy__astropy-12907" and parsed.FAIL_TO_PASS and parsed.repo_source is None


def test_binary_diffs_and_oversized_patches_are_dropped_with_a_note() -> None:
    text = "diff --git a/x.py b/x.py\n--- a/x.py\n+++ b/x.py\n@@ -1 +1 @@\n-a\n+b\n"
    binary = "diff --git a/img.png b/img.png\nnew file mode 100644\nBinary files /dev/null and b/img.png differ\n"
    kept = clean_patch(text + binary, 10_000)
    assert kept.patch == text and "img.png" in kept.notes[0]
    assert clean_patch(text, 10).patch == "" and "over the cap" in clean_patch(text, 10).notes[0]


async def test_missing_image_fails_init_naming_the_path(instances, tmp_path: Path) -> None:
    task = load_task(TASK)
    task.verifier = task.verifier | {"image": str(tmp_path / "{swebench_image}.sif")}
    environment = SweEnvironment(task, "bwrap")
    instance = next(iter(instances.values()))
    with pytest.raises(ImageNotFound, match=str(tmp_path / "sweb.eval.x86_64.pypi_1776_")):
        await environment.init(instance)


def test_gold_patch_resolves_and_empty_patch_does_not(instances) -> None:
    """`prorl swe check` on the fixed sample (the whole suite: `prorl swe check`, ~7 min; not in CI)."""
    ids = [i.instance_id for i in sample(instances)]
    checked = subprocess.run([sys.executable, "-m", "nemo_gym_prorl.cli", "swe", "check", "--instances", *ids],
                             capture_output=True, text=True, timeout=600)  # fmt: skip
    assert checked.returncode == 0, checked.stdout + checked.stderr[-3000:]
    last = checked.stdout.strip().splitlines()[-1]
    assert last.startswith(f"{len(ids)}/{len(ids)} instances of swe/offline on bwrap: gold patch resolves"), last

    unsound = subprocess.run([sys.executable, "-m", "nemo_gym_prorl.cli", "swe", "check", "--instances", "nope"],
                             capture_output=True, text=True, timeout=600)  # fmt: skip
    assert unsound.returncode != 0 and "no instance nope" in unsound.stderr


async def test_agent_fixing_through_the_tools_gets_reward_1(env: SweEnvironment, instances) -> None:
    instance = sample(instances)[0]
    episode = await env.init(instance)
    try:
        log = await env.call_tool(episode, bash("git log --oneline | wc -l; git remote | wc -l; ls"))
        assert log.text.split()[:2] == ["1", "0"]  # one squashed commit, no remotes
        hidden = json.loads(instance.data["FAIL_TO_PASS"])[0].split("::")[0]
        assert hidden not in log.text.split()  # the hidden tests are not there while the agent works
        applied = await env.call_tool(episode, bash(apply_command(instance.data["patch"]) + "[ $? = 0 ] && echo applied"))
        assert "applied" in applied.text
        ran = await env.call_tool(episode, ToolCall(name="python", arguments={"code": "print(6 * 7)"}))
        assert "42" in ran.text
        submission = await env.collect(episode)
    finally:
        await env.close(episode)
    evaluation = await env.grade(instance, submission)
    assert evaluation.reward == 1.0 and evaluation.details["patch_applied"], evaluation.details
    assert ".prorl" not in submission["patch"]  # the python tool's interpreter files are no part of the fix


async def test_an_apptainer_episode_on_the_sif_stages_at_testbed_and_resolves(sif: Path, instances) -> None:
    task = load_task(TASK)
    task.verifier = task.verifier | {"image": "default-sif"}
    env = SweEnvironment(task, "apptainer")
    instance = sample(instances)[1]
    episode = await env.init(instance)
    try:
        seen = await env.call_tool(episode, bash(f"pwd; {apply_command(instance.data['patch'])}"))
        assert seen.text.split()[0] == "/testbed", seen.text
        submission = await env.collect(episode)
    finally:
        await env.close(episode)
    evaluation = await env.grade(instance, submission)
    assert evaluation.reward == 1.0 and evaluation.details["patch_applied"], evaluation.details


async def test_wrong_fix_gets_0_naming_the_failing_tests(env: SweEnvironment, instances) -> None:
    instance = sample(instances)[1]
    submission = await agent_runs(env, instance, "echo '# a comment' >> README.rst; echo 'x = 1' > new_module.py")
    assert "new_module.py" in submission["patch"]
    evaluation = await env.grade(instance, submission)
    assert evaluation.reward == 0.0 and evaluation.details["patch_applied"]
    assert set(json.loads(instance.data["FAIL_TO_PASS"])) <= set(evaluation.details["failing_tests"])


async def test_agent_rewriting_git_or_deleting_tests_gets_a_clear_reason(env: SweEnvironment, instances) -> None:
    instance = sample(instances)[2]
    submission = await agent_runs(env, instance, "rm -rf .git && git init -q && git add -A && git commit -qm x")
    assert submission["patch"] == "" and "base commit" in submission["patch_notes"][0]
    evaluation = await env.grade(instance, submission)
    assert evaluation.reward == 0.0 and "base commit" in evaluation.details["patch_notes"][0]

    # An agent that writes its own version of the hidden tests: they are put back before the real ones go in.
    hidden = json.loads(instance.data["FAIL_TO_PASS"])[0].split("::")[0]
    fake = f"diff --git a/{hidden} b/{hidden}\nnew file mode 100644\n--- /dev/null\n+++ b/{hidden}\n" \
           f"@@ -0,0 +1,2 @@\n+def test_nothing():\n+    pass\n"  # fmt: skip
    evaluation = await env.grade(instance, {"patch": fake})
    assert evaluation.reward == 0.0 and evaluation.details["patch_applied"]
    assert set(json.loads(instance.data["FAIL_TO_PASS"])) <= set(evaluation.details["failing_tests"])


async def test_non_applying_and_hanging_patches_end_with_reward_0_and_why(env: SweEnvironment, instances) -> None:
    instance = sample(instances)[0]
    bad = "diff --git a/nope.py b/nope.py\n--- a/nope.py\n+++ b/nope.py\n@@ -1 +1 @@\n-a\n+b\n"
    evaluation = await env.grade(instance, {"patch": bad})
    assert evaluation.reward == 0.0 and not evaluation.details["patch_applied"]
    assert evaluation.details["reason"] == "the patch does not apply"

    hang = "diff --git a/conftest.py b/conftest.py\nnew file mode 100644\n--- /dev/null\n+++ b/conftest.py\n" \
           "@@ -0,0 +1,2 @@\n+while True:\n+    pass\n"  # fmt: skip
    env.settings.test_timeout_s = 5
    try:
        evaluation = await env.grade(instance, {"patch": hang})
    finally:
        env.settings.test_timeout_s = 300
    assert evaluation.reward == 0.0 and "time limit of 5 s" in evaluation.details["reason"]


@pytest.fixture(scope="module")
def gold_agent(instances) -> Iterator[tuple[str, TaskInstance]]:
    instance = sample(instances)[0]
    script = [f"```bash\n{apply_command(instance.data['patch'])}\n```", "Fixed the bug."]
    for url in running_standin(script):
        yield url, instance


async def test_scripted_gold_agent_gets_reward_1_through_the_service(gold_agent, tmp_path: Path) -> None:
    url, instance = gold_agent
    model = ModelConfig(kind="remote", addresses=[url], served_model_name="standin", tool_call_format="codeact")
    config = ServiceConfig(service=ServiceSettings(port=0, store=tmp_path / "s.db", tasks=[TASK]), model=model)
    async with run_service(config) as svc, httpx.AsyncClient(base_url=svc.url, timeout=300) as http:
        processed = (await http.post("/process", json={"instance": instance.data, "sampling_params": {}})).json()
        assert processed["reward"] == 1.0 and processed["resolved"], processed.get("evaluation") or processed
        async with RolloutClient(svc.url) as client:
            job = await client.submit(JobRequest(instance=instance.data, n=2, sampling_params={"seed": 1}))
            finished = await client.wait(job)
        assert [t.reward for t in finished.results] == [1.0, 1.0]
        gym_row = instance.data | {"responses_create_params": {"input": "fix it"}, "prorl_task": TASK, "_rowidx": 0}
        verified = (await http.post("/run", json=gym_row)).json()
        assert verified["reward"] == 1.0


async def test_a_group_shares_one_staging_in_independent_forks(instances) -> None:
    """As the service's group forking does (`pipeline.fork_groups`, which SWE tasks ask for while their stagings
    take longer than a fork per sample, as measured): one init, four forks."""
    env = make_environment(load_task(TASK), "bwrap")  # its own: what it measured is this test's alone
    instance = sample(instances)[3]
    assert env.shares_group_init  # nothing measured yet: it forks, and learns what a fork costs
    episodes = await env.fork(await env.init(instance), [env] * 4)
    assert len(env.staging_s) == 1 and len(env.fork_s) == 1 and env.staging_s[0] > env.fork_s[0] > 0
    assert env.shares_group_init
    env.fork_s.extend([env.staging_s[0] * 2] * 2)  # were forks to cost more than a staging, groups would not fork
    assert not env.shares_group_init
    env.settings.fork_groups = True  # unless the task says
    assert env.shares_group_init
    try:
        assert len({e.session["base_commit"] for e in episodes}) == 1
        await env.call_tool(episodes[0], bash("echo mine > only_here.txt"))
        seen = [(await env.call_tool(e, bash("ls only_here.txt 2>&1; git status --short | wc -l"))).text for e in episodes]
        assert "No such file" not in seen[0] and all("No such file" in text for text in seen[1:])
        patches = [await env.collect(e) for e in episodes]
    finally:
        await asyncio.gather(*(env.close(e) for e in episodes))
    assert "only_here.txt" in patches[0]["patch"] and not any(p["patch"] for p in patches[1:])


EVERY_KIND_OF_CHANGE = (
    "printf 'one\\r\\ntwo\\r\\n' > crlf.txt; echo '# changed' >> setup.py; rm MANIFEST.in; mv LICENSE LICENSE.txt;"
    " printf 'a\\000b' > blob.bin; chmod +x setup.cfg; rm -rf docs && mkdir docs && echo new > docs/new.rst;"
    " rm PKG-INFO && mkdir PKG-INFO && echo in > PKG-INFO/inner; ln -s inflection/__init__.py alias.py;"
    " echo odd > ':(exclude)we ird[1]*.py'; touch top.pyc; mkdir -p inflection/__pycache__ && touch inflection/__pycache__/x.pyc;"
    " mkdir -p pkg && python3 -c \"print('x = 1' * 20000)\" > pkg/big.py"
)


async def test_a_forks_patch_is_a_fresh_sandboxs_on_every_kind_of_change(env: SweEnvironment, instances) -> None:
    """A fork takes its patch from the paths its overlay says it changed (on a fresh index: the agent's is left as
    it was), back on the extraction's output when it fits: the same patch as a fresh sandbox's, which walks the
    whole tree, for added (CRLF kept), changed, deleted, renamed, binary (dropped, with a note), mode-changed,
    replaced, oddly named, ignored and large (read back as a file) changes, and after a .gitignore change (the
    whole tree then); nothing for a fork that only looked."""
    instance = sample(instances)[0]
    changes = [EVERY_KIND_OF_CHANGE, "echo '*.cfg' > .gitignore; echo '# more' >> setup.py"]
    fresh = [await env.init(instance) for _ in changes]
    forks = await env.fork(await env.init(instance), [env] * (len(changes) + 1))
    try:
        for episode, change in [*zip(fresh, changes), *zip(forks, changes)]:
            await env.call_tool(episode, bash(change))
        await env.call_tool(forks[-1], bash("git status --short; git diff; ls"))
        await env.call_tool(forks[-1], ToolCall(name="python", arguments={"code": "print(1)"}))
        taken = [await env.collect(e) for e in (*fresh, *forks)]
        staged = (await env.call_tool(forks[0], bash("git diff --cached --name-only | wc -l"))).text.split()
    finally:
        await asyncio.gather(*(env.close(e) for e in (*fresh, *forks)))
    patch = taken[0]["patch"]
    for part in ("+one\r\n+two\r\n", "+# changed", "deleted file mode", "rename from LICENSE\nrename to LICENSE.txt",
                 "old mode 100644\nnew mode 100755", "b/docs/new.rst", "a/docs/conf.py", "b/PKG-INFO/inner",
                 "b/alias.py", "we ird[1]*.py", "pkg/big.py"):  # fmt: skip
        assert part in patch, part
    assert ".pyc" not in patch and len(patch) > 100_000
    assert taken[0]["patch_notes"] == ["binary diff dropped: a/blob.bin b/blob.bin"]
    assert ".gitignore" in taken[1]["patch"] and "+# more" in taken[1]["patch"]
    assert taken[2:4] == taken[0:2]
    assert taken[4] == {"patch": "", "patch_notes": []}
    assert staged == ["0"]  # the fork's own index untouched: its patch came from its changed paths alone


@pytest.mark.slow
async def test_gym_env_test_passes_for_prorl_swe(rootfs: Path, tmp_path: Path) -> None:
    ensure_venv_links()
    out = await run_gym(
        ["env", "test", "--resources-server", "prorl_swe", f"hydra.run.dir={tmp_path / 'hydra'}"],
        gym_environ(), Path(__file__).resolve().parents[3], timeout_s=600,
    )
    assert " 2 passed" in out and " failed" not in out, out[-3000:]
