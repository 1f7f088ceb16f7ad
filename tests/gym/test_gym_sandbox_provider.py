"""NeMo Gym sandboxes both ways: Gym's own API on our bwrap provider (found through the entry point), and our
environment and tools on Gym's real `local` provider; and Gym's own `apptainer` provider on our Apptainer and image."""

from __future__ import annotations

import os
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from nemo_gym.sandbox import (
    AsyncSandbox,
    SandboxCreateError,
    SandboxStatus,
    create_provider,
    get_provider_class,
    list_providers,
)
from nemo_gym.sandbox import SandboxSpec as GymSpec

from nemo_gym_prorl.contracts.sandbox import PathOutsideWorkspaceError
from nemo_gym_prorl.contracts.task import TaskInstance, load_task
from nemo_gym_prorl.envs import make_environment
from nemo_gym_prorl.gym.sandbox_providers import (
    BwrapProvider,
    ProrlProvider,
    gym_apptainer_config,
    register_gym_backends,
)
from nemo_gym_prorl.sandbox import SandboxSpec, open_sandbox
from nemo_gym_prorl.sandbox.apptainer import _instance_logs, list_instances, remove_instance_logs
from nemo_gym_prorl.sandbox.gym_provider import GymProviderSandbox
from nemo_gym_prorl.tool_calls import ToolCall
from nemo_gym_prorl.tools import make_tools

# -- our bwrap backend through Gym's sandbox API ---------------------------------------------------------------


def test_gym_discovers_our_providers_through_the_entry_point() -> None:
    assert {"bwrap", "prorl"} <= set(list_providers())
    assert get_provider_class("bwrap") is BwrapProvider and get_provider_class("prorl") is ProrlProvider


async def test_gym_api_runs_a_command_in_a_bwrap_sandbox() -> None:
    spec = GymSpec(workdir="/workspace/job", env={"GREETING": "hello"}, files={"/workspace/job/in.txt": "data"})
    async with AsyncSandbox({"bwrap": {}}, spec) as box:
        await box.start()
        assert await box.status() == SandboxStatus.RUNNING
        result = await box.exec(
            "cat in.txt; echo; echo $GREETING $EXTRA; pwd; id -u; echo oops >&2; exit 3", env={"EXTRA": "x"}
        )
        assert result.stdout == "data\nhello x\n/workspace/job\n1000\n"
        assert result.stderr == "oops\n" and result.return_code == 3 and result.error_type is None
        assert (await box.exec("pwd", cwd="/workspace")).stdout == "/workspace\n"
        unwritable = await box.exec("touch /usr/x")
        assert unwritable.return_code != 0 and "/usr/x" in unwritable.stderr and unwritable.stdout == ""
        slow = await box.exec("sleep 30", timeout_s=1)
        assert slow.error_type == "timeout" and slow.return_code == 125
        assert (await box.exec("echo still up")).stdout == "still up\n"


async def test_gym_api_moves_files_in_and_out_of_a_bwrap_sandbox(tmp_path: Path) -> None:
    local_in, local_out = tmp_path / "in.bin", tmp_path / "back" / "out.bin"
    local_in.write_bytes(bytes(range(256)) * 10)
    async with AsyncSandbox({"prorl": {"backend": "bwrap"}}, GymSpec()) as box:
        await box.start()
        await box.upload(local_in, "data/in.bin")  # relative to the workdir, /workspace by default
        assert (await box.exec("sha256sum < /workspace/data/in.bin")).stdout.split()[0] == _sha256(local_in)
        await box.exec("cp data/in.bin /workspace/out.bin && echo tail >> out.bin")
        await box.download("/workspace/out.bin", local_out)
        assert local_out.read_bytes() == local_in.read_bytes() + b"tail\n"
        with pytest.raises(ValueError, match="outside"):
            await box.upload(local_in, "/etc/evil")


async def test_closing_a_gym_bwrap_sandbox_leaves_nothing() -> None:
    provider = create_provider({"bwrap": {}})
    box = AsyncSandbox(provider, GymSpec(), owns_provider=False)
    await box.start()
    ours = box._handle.raw.sandbox  # type: ignore[union-attr]  # the provider's handle wraps our sandbox
    await box.exec("sleep 1000 > /dev/null 2>&1 &")
    pid, workspace, temp_dir = ours.pid, ours.workspace, ours.temp_dir
    assert pid is not None and os.path.exists(f"/proc/{pid}") and workspace.is_dir() and temp_dir.is_dir()
    await box.stop()
    assert not os.path.exists(f"/proc/{pid}") and not temp_dir.exists() and ours.workspace is None
    assert await box.status() == SandboxStatus.STOPPED
    # a sandbox nobody stopped is closed with its provider
    left = await provider.create(GymSpec())
    pid = left.raw.sandbox.pid
    await provider.aclose()
    assert not os.path.exists(f"/proc/{pid}") and await provider.status(left) == SandboxStatus.STOPPED


async def test_gym_spec_resources_and_provider_limits_reach_the_sandbox() -> None:
    spec = GymSpec(resources={"memory_mib": 256}, provider_options={"limits": {"max_output_bytes": 1000}})
    async with AsyncSandbox({"bwrap": {"limits": {"max_output_bytes": 50_000}}}, spec) as box:
        await box.start()
        fits = await box.exec("python3 -c 'x = bytearray(64 * 2**20); print(len(x))'")
        assert fits.stdout == f"{64 * 2**20}\n" and fits.return_code == 0
        too_big = await box.exec("python3 -c 'x = bytearray(512 * 2**20)'")
        assert too_big.return_code != 0
        flood = await box.exec("seq 100000")
        assert flood.stdout.startswith("1\n2\n") and flood.stdout.endswith("99999\n100000\n")
        assert len(flood.stdout) < 1200 and "truncated" in flood.stdout


async def test_gym_bwrap_provider_refuses_what_it_cannot_do() -> None:
    with pytest.raises(SandboxCreateError, match="unknown sandbox backend 'nope'"):
        await create_provider({"prorl": {"backend": "nope"}}).create(GymSpec())
    with pytest.raises(SandboxCreateError, match="does not exist in the image"):
        await create_provider({"bwrap": {}}).create(GymSpec(workdir="/srv/missing"))
    async with AsyncSandbox({"bwrap": {}}, GymSpec()) as box:
        await box.start()
        with pytest.raises(ValueError, match="user"):
            await box.exec("id", user="root")


def _sha256(path: Path) -> str:
    return subprocess.run(["sha256sum", str(path)], capture_output=True, text=True, check=True).stdout.split()[0]


# -- Gym's local provider as our sandbox -------------------------------------------------------------------------


@pytest.fixture
async def local() -> AsyncIterator[GymProviderSandbox]:
    async with GymProviderSandbox(SandboxSpec(), "local") as sbx:
        yield sbx


def _marked_processes(sbx: GymProviderSandbox) -> list[str]:
    found = subprocess.run(
        ["grep", "-lsxzaF", f"PRORL_SANDBOX_ID={sbx._id}", *Path("/proc").glob("[0-9]*/environ")],
        capture_output=True,
        text=True,
    )
    return found.stdout.split()


async def test_math_environment_runs_its_tools_on_gyms_local_provider() -> None:
    assert "gym:local" in register_gym_backends()
    task = load_task("math/arithmetic").model_copy(update={"tools": ["bash", "python", "str_replace_editor", "finish"]})
    env = make_environment(task, "gym:local")
    instance = TaskInstance(instance_id="t1", data={"id": "t1", "question": "Calculate 6 * 7.", "answer": "42"})
    episode = await env.init(instance)
    sbx = episode.sandbox
    try:
        assert isinstance(sbx, GymProviderSandbox) and sbx.workdir is not None
        workdir = sbx.workdir

        async def call(name: str, **arguments: object) -> str:
            output = await env.call_tool(episode, ToolCall(name=name, arguments=arguments))
            return output.text

        assert (await call("bash", command="cat problem.txt")).strip() == "Calculate 6 * 7."
        assert await call("python", code="x = 6\ny = 7") == ""
        assert await call("python", code="print(open('problem.txt').read(), x * y)") == "Calculate 6 * 7. 42\n"
        assert "     1\tCalculate 6 * 7." in await call(
            "str_replace_editor", command="view", path=f"{workdir}/problem.txt"
        )
        assert "Answer submitted." == await call("finish", answer="42")
        evaluation = await env.eval(episode)
        assert evaluation.reward == 1.0 and evaluation.resolved
        assert _marked_processes(sbx)  # the python interpreter runs in the background
    finally:
        await env.close(episode)
    assert not Path(workdir).exists() and _marked_processes(sbx) == []


async def test_local_shell_keeps_cwd_and_exported_variables(local: GymProviderSandbox) -> None:
    first = await local.run("mkdir -p a/b && cd a/b && export KEEP=1 && LOST=2 && echo moved", timeout=10)
    assert first.output == "moved\n" and first.exit_code == 0
    after = await local.run("pwd; echo ${KEEP:-unset} ${LOST:-unset}; echo err >&2; (exit 4)", timeout=10)
    assert after.output == f"{local.workdir}/a/b\n1 unset\nerr\n" and after.exit_code == 4
    slow = await local.run("cd /; sleep 30", timeout=1)
    assert slow.timed_out and slow.exit_code is None and "the command was killed" in slow.output
    assert (await local.run("pwd", timeout=10)).output == f"{local.workdir}/a/b\n"


async def test_local_files_map_the_workspace_onto_the_provider_workdir(local: GymProviderSandbox) -> None:
    await local.write_file("/workspace/deep/dir/f.txt", b"one")
    await local.write_file(f"{local.workdir}/g.txt", b"two")
    assert (await local.exec(["cat", "deep/dir/f.txt", "g.txt"], timeout=10)).output == "onetwo"
    assert await local.read_file("deep/dir/f.txt") == b"one"
    with pytest.raises(FileNotFoundError):
        await local.read_file("missing.txt")
    with pytest.raises(IsADirectoryError):
        await local.read_file("deep")
    for outside in ("/etc/passwd", "../x", "/workspace/../x"):
        with pytest.raises(PathOutsideWorkspaceError):
            await local.write_file(outside, b"x")


async def test_local_sandbox_close_kills_background_processes_and_removes_the_workspace() -> None:
    register_gym_backends()
    sbx = open_sandbox("gym:local", SandboxSpec())
    assert isinstance(sbx, GymProviderSandbox)
    async with sbx:
        await sbx.run("sleep 1000 > /dev/null 2>&1 &", timeout=10)
        await make_tools(["python"], 10)["python"](sbx, {"code": "x = 1"})
        assert len(_marked_processes(sbx)) == 2
        workdir = sbx.workdir
    assert _marked_processes(sbx) == [] and workdir is not None and not Path(workdir).exists()
    with pytest.raises(Exception, match="closed"):
        await sbx.run("true", timeout=5)


# -- Gym's own apptainer provider, on our Apptainer and image --------------------------------------------------


async def test_gyms_apptainer_provider_runs_on_our_binary_and_image(sif: Path, tmp_path: Path) -> None:
    """With `gym_apptainer_config`, Gym's provider runs on the binary and SIF our backend uses (as root, as it
    ships, it cannot start an instance here), and stopping leaves no instance, staging dir or (once removed) log."""
    spec = GymSpec(image=str(sif), workdir="/sandbox", env={"GREETING": "hello"})
    async with AsyncSandbox(gym_apptainer_config(), spec) as box:
        await box.start()
        name = (await box.serialize())["sandbox_id"]
        assert name in list_instances()
        staging = Path((await box.serialize())["staging_dir"])
        result = await box.exec("echo $GREETING; pwd; python3 -c 'import numpy; print(numpy.__name__)'")
        assert (result.return_code, result.stdout) == (0, "hello\n/sandbox\nnumpy\n")
        (tmp_path / "in.txt").write_text("data\n")
        await box.upload(tmp_path / "in.txt", "/sandbox/in.txt")
        assert (await box.exec("cat /sandbox/in.txt")).stdout == "data\n"
    assert name not in list_instances() and not staging.exists()
    remove_instance_logs(name)
    assert not _instance_logs(name)
