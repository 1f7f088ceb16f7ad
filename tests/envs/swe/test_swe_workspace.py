"""A sandbox's workspace mounted where SWE images and eval scripts expect the repository (`SandboxSpec.workspace`,
/testbed), on real bubblewrap (and its forks, in the default image), real Apptainer on a SIF, our NeMo Gym provider and the tools.
The default (/workspace) is what every other test runs on.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from nemo_gym.sandbox import AsyncSandbox
from nemo_gym.sandbox import SandboxSpec as GymSpec
from pydantic import ValidationError

from nemo_gym_prorl.contracts.sandbox import PathOutsideWorkspaceError
from nemo_gym_prorl.sandbox import SandboxSpec, open_sandbox
from nemo_gym_prorl.tools import make_tools

TESTBED = "/testbed"


@pytest.fixture(params=["bwrap", "apptainer"])
def testbed_spec(request: pytest.FixtureRequest) -> tuple[str, SandboxSpec]:
    if request.param == "bwrap":
        return "bwrap", SandboxSpec(workspace=TESTBED)
    sif: Path = request.getfixturevalue("sif")
    return "apptainer", SandboxSpec(workspace=TESTBED, image=str(sif))


async def test_shell_files_and_tools_use_a_workspace_at_testbed(testbed_spec: tuple[str, SandboxSpec]) -> None:
    backend, spec = testbed_spec
    tools = make_tools(["bash", "python", "str_replace_editor"], timeout_s=60)
    async with open_sandbox(backend, spec) as sandbox:
        # the sandbox user's passwd entry agrees with HOME (programs that ask passwd, not $HOME, find the workspace)
        shell = await sandbox.run("pwd; echo $HOME; echo ~; getent passwd $(id -u) | cut -d: -f6", 30)
        assert shell.output.split() == [TESTBED] * 4
        await sandbox.write_file(f"{TESTBED}/pkg/mod.py", b"VALUE = 1\n")
        assert await sandbox.read_file("pkg/mod.py") == b"VALUE = 1\n"
        ran = await sandbox.exec(["python3", "-c", "import pkg.mod; print(pkg.mod.__file__)"], 30)
        assert ran.output.strip() == f"{TESTBED}/pkg/mod.py"
        with pytest.raises(PathOutsideWorkspaceError):
            await sandbox.write_file("/workspace/x.py", b"")

        edit = {"command": "str_replace", "path": f"{TESTBED}/pkg/mod.py", "old_str": "1", "new_str": "22"}
        assert "edited" in (await tools["str_replace_editor"](sandbox, edit)).text
        outside = await tools["str_replace_editor"](sandbox, {"command": "view", "path": "/workspace/pkg"})
        assert f"Only files under {TESTBED}" in outside.text
        python = await tools["python"](sandbox, {"code": "import os, pkg.mod; print(os.getcwd(), pkg.mod.VALUE)"})
        assert python.text.split()[:2] == [TESTBED, "22"], python.text
        assert (await tools["bash"](sandbox, {"command": "cat pkg/mod.py"})).text.strip() == "VALUE = 22"


async def test_bwrap_forks_of_an_image_keep_the_workspace_at_testbed(rootfs: Path) -> None:
    async with open_sandbox("bwrap", SandboxSpec(workspace=TESTBED, image=str(rootfs))) as parent:
        await parent.write_file("base.txt", b"base")
        forks = await parent.fork(2)
    try:
        await forks[0].write_file(f"{TESTBED}/mine.txt", b"mine")
        home = "getent passwd $(id -u) | cut -d: -f6"  # the image's entry for the sandbox user, its home moved
        seen = [(await f.run(f"{home}; pwd; cat base.txt; echo; ls", 30)).output.split() for f in forks]
        assert seen[0] == [TESTBED, TESTBED, "base", "base.txt", "mine.txt"]
        assert seen[1] == [TESTBED, TESTBED, "base", "base.txt"]
        assert await forks[0].read_file("mine.txt") == b"mine"
    finally:
        for fork in forks:
            await fork.close()


async def test_gym_provider_mounts_the_workspace_where_provider_options_say() -> None:
    spec = GymSpec(workdir="src", provider_options={"workspace": TESTBED}, files={f"{TESTBED}/src/in.txt": "data"})
    async with AsyncSandbox({"bwrap": {}}, spec) as box:
        await box.start()
        assert (await box.exec("pwd; cat in.txt")).stdout == f"{TESTBED}/src\ndata"


@pytest.mark.parametrize("path", ["testbed", "/", "/tmp", "/proc/x", "/a/../b", "/x:y", "//testbed"])
def test_a_workspace_that_cannot_be_mounted_is_refused_naming_it(path: str) -> None:
    with pytest.raises(ValidationError, match="workspace"):
        SandboxSpec(workspace=path)
