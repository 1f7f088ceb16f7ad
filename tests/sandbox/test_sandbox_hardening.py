"""What a model must not be able to do to the host through its sandbox, each tried on every backend it applies to,
through the public sandbox and tool APIs only: stall a host thread with a FIFO, blow up host memory with a sparse
file, fill the host's disk, exhaust the host's file table, get host files copied into a fork by racing its snapshot,
make namespaces with clone3, or run on after the service that owns it was SIGKILLed. Each case leaves nothing on the
host (processes, temp dirs, mounts, loop devices).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import signal
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from sandbox_helpers import assert_nothing_left, reachable_temp_dir, wait_until

from nemo_gym_prorl.contracts.sandbox import FileTooLargeError, NotARegularFileError, Sandbox
from nemo_gym_prorl.gym.sandbox_providers import register_gym_backends
from nemo_gym_prorl.sandbox import SandboxLimits, SandboxSpec, open_sandbox
from nemo_gym_prorl.sandbox.apptainer import reap_orphan_instances
from nemo_gym_prorl.sandbox.bwrap import sweep_orphans
from nemo_gym_prorl.tools import EditorTool, PythonTool

pytestmark = pytest.mark.timeout(120)

LIMITS = SandboxLimits(memory_mb=512, max_processes=64, wall_clock_s=120)
OURS = ["bwrap", "apptainer"]
FILE_IO = ["bwrap", "bwrap-fork", "apptainer", "gym:local"]
"""Where host-side file I/O differs: a plain bwrap or Apptainer workspace (a host directory), a bwrap fork (through
the join helper), and the adapter onto a NeMo Gym provider."""
HOST_CALL_S = 10.0


def spec_for(request: pytest.FixtureRequest, backend: str, **limits: Any) -> SandboxSpec:
    image = str(request.getfixturevalue("sif")) if backend == "apptainer" else None
    return SandboxSpec(image=image, limits=LIMITS.model_copy(update=limits))


@contextlib.asynccontextmanager
async def sandbox_of(request: pytest.FixtureRequest, backend: str, **limits: Any) -> AsyncIterator[Sandbox]:
    """A started sandbox of `backend` ("bwrap-fork": a fork of a bwrap sandbox), closed afterwards."""
    if backend.startswith("gym:"):
        register_gym_backends()
    spec = spec_for(request, backend.removesuffix("-fork"), **limits)
    async with open_sandbox(backend.removesuffix("-fork"), spec) as sandbox:
        if not backend.endswith("-fork"):
            yield sandbox
            return
        (fork,) = await sandbox.fork(1)
        try:
            yield fork
        finally:
            await fork.close()


@pytest.fixture(autouse=True)
async def host_temp(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Path]:
    """Every sandbox's host temp dir under a root of this test's own, checked to hold nothing afterwards: no temp dir,
    no mount, and (once the kernel has let go of them, which a closed sandbox leaves to a thread) no loop device on
    a sandbox's disk image."""
    with reachable_temp_dir() as root:
        monkeypatch.setattr(tempfile, "tempdir", str(root))
        yield root
        await assert_nothing_left(root)


@pytest.fixture(params=FILE_IO)
async def io_sandbox(request: pytest.FixtureRequest) -> AsyncIterator[Sandbox]:
    async with sandbox_of(request, request.param) as sandbox:
        yield sandbox


@pytest.fixture(params=OURS)
def backend(request: pytest.FixtureRequest) -> str:
    return request.param


# -- 1. FIFOs and other special files ----------------------------------------------------------------------------


async def test_a_fifo_in_the_workspace_never_blocks_host_file_io_or_the_tools(io_sandbox: Sandbox) -> None:
    made = await io_sandbox.run("mkfifo pipe && mkdir -p .prorl/python && mkfifo .prorl/python/repl.py && echo ok", 10)
    assert made.output.strip().endswith("ok"), made.output
    for call in (io_sandbox.read_file("pipe"), io_sandbox.write_file("pipe", b"x")):
        with pytest.raises(NotARegularFileError, match="not a regular file"):
            await asyncio.wait_for(call, HOST_CALL_S)
    editor = EditorTool()
    for arguments in ({"command": "view", "path": "pipe"}, {"command": "create", "path": "pipe", "file_text": "x"}):
        answer = await asyncio.wait_for(editor(io_sandbox, arguments), HOST_CALL_S)
        assert answer.text.startswith("Error:") and "regular file" in answer.text, answer.text
    answer = await asyncio.wait_for(PythonTool(timeout_s=5)(io_sandbox, {"code": "print(1)"}), HOST_CALL_S)
    assert answer.text.startswith("python: could not run the code"), answer.text
    assert (await io_sandbox.run("echo alive", 10)).output.strip().endswith("alive")  # nothing inside is stuck


# -- 2. sparse files ---------------------------------------------------------------------------------------------


async def test_a_sparse_file_is_refused_by_its_size_before_it_is_read(io_sandbox: Sandbox) -> None:
    await io_sandbox.run("truncate -s 96M sparse && echo small > small", 10)
    with pytest.raises(FileTooLargeError, match=r"100663296 bytes, more than the 67108864 bytes"):
        await asyncio.wait_for(io_sandbox.read_file("sparse"), HOST_CALL_S)
    view = await EditorTool()(io_sandbox, {"command": "view", "path": "sparse"})
    assert view.text.startswith("Error:") and "max_read_mb" in view.text, view.text
    assert await io_sandbox.read_file("small") == b"small\n"


# -- 3. a disk quota per sandbox ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("backend", "where"),
    [("bwrap", "workspace"), ("bwrap", "fork"), ("bwrap", "tmp"), ("apptainer", "workspace"), ("apptainer", "tmp")],
)
async def test_the_writable_space_is_full_at_its_quota_not_the_host(
    request: pytest.FixtureRequest, backend: str, where: str
) -> None:
    directory = "/tmp" if where == "tmp" else "/workspace"
    fill = f"cd {directory}; for i in $(seq 12); do head -c 8M /dev/zero > f$i || break; done; du -sm {directory}"
    kind = f"{backend}-fork" if where == "fork" else backend
    async with sandbox_of(request, kind, disk_mb=48, file_size_mb=8) as sbx:
        result = await sbx.run(fill, 60)
        assert "No space left on device" in result.output, result.output
        assert int(result.output.split()[-2]) <= 48, result.output  # du's total in MiB
        assert (await sbx.run("rm -f f*; echo again > f1 && cat f1", 10)).output.strip().endswith("again")


# -- 4. open files -----------------------------------------------------------------------------------------------

OPEN_FILES = """
import os
held = []
try:
    while len(held) < 50_000:
        held.append(os.eventfd(0))
except OSError as e:
    print(len(held), e.strerror)
"""


async def test_open_files_are_capped_per_process(request: pytest.FixtureRequest, backend: str) -> None:
    async with sandbox_of(request, backend, max_open_files=200) as sbx:
        await sbx.write_file("fds.py", OPEN_FILES.encode())
        opened = (await sbx.run("python3 fds.py; ulimit -Hn", 30)).output.split()
        assert opened[-1] == "200" and int(opened[0]) < 200 and "Too many open files" in " ".join(opened), opened
        assert (await sbx.run("ulimit -n 100000", 10)).exit_code != 0  # not to be raised from inside


# -- 5. a fork's snapshot against a symlink race -----------------------------------------------------------------

SWAPPER = """
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
os.makedirs("tree", exist_ok=True)
for i in range(300):
    with open(f"tree/file{i}", "w") as f:
        f.write("own\\n")
os.symlink(sys.argv[1], "link")
print("swapping", flush=True)
while True:  # renameat2(AT_FDCWD, "tree", AT_FDCWD, "link", RENAME_EXCHANGE)
    libc.syscall(316, -100, b"tree", -100, b"link", 2)
"""


async def test_a_fork_never_copies_host_files_through_a_symlink_race(request: pytest.FixtureRequest) -> None:
    secret = f"HOST-SECRET-{secrets.token_hex(4)}"
    with reachable_temp_dir(0o700) as host_dir:
        for i in range(300):
            (host_dir / f"file{i}").write_text(secret)
        async with sandbox_of(request, "bwrap") as parent:
            await parent.write_file("swap.py", SWAPPER.encode())
            started = await parent.run(
                f"python3 swap.py {host_dir} > swap.log 2>&1 & echo $! > swap.pid; "
                "for _ in $(seq 200); do grep -q swapping swap.log && break; sleep 0.05; done; cat swap.log",
                20,
            )
            assert "swapping" in started.output, started.output
            for _ in range(6):
                forks = await parent.fork(2)
                try:
                    for fork in forks:
                        found = await fork.run(f"grep -rl {secret} /workspace | head -3", 20)
                        assert secret not in found.output and found.output.strip() == "", found.output
                finally:
                    await asyncio.gather(*(fork.close() for fork in forks))
            # The parent's swapper ran on through the forks; stopped, its tree is whole (listing while it swaps
            # could see the directory under both names, or under neither).
            listed = await parent.run(
                "pid=$(cat swap.pid); kill -0 $pid && echo running; kill $pid; "
                "wait $pid 2>/dev/null; ls tree/ link/ 2>/dev/null | grep -c ^file",
                20,
            )
            assert listed.output.split() == ["running", "300"], listed.output


# -- 6. clone3 -------------------------------------------------------------------------------------------------------

CLONE3 = """
import ctypes, os, threading
libc = ctypes.CDLL(None, use_errno=True)
class CloneArgs(ctypes.Structure):
    _fields_ = [(name, ctypes.c_uint64) for name in
                ("flags", "pidfd", "child_tid", "parent_tid", "exit_signal", "stack", "stack_size", "tls")]
args = CloneArgs(flags=0x10000000 | 0x40000000, exit_signal=17)  # CLONE_NEWUSER | CLONE_NEWNET
pid = libc.syscall(435, ctypes.byref(args), ctypes.sizeof(args))
if pid == 0:
    os._exit(0)
print("clone3", "succeeded" if pid > 0 else os.strerror(ctypes.get_errno()))
if pid > 0:
    os.waitpid(pid, 0)
thread = threading.Thread(target=print, args=("threads still start",))
thread.start()
thread.join()
"""


async def test_clone3_cannot_make_namespaces(request: pytest.FixtureRequest, backend: str) -> None:
    async with sandbox_of(request, backend) as sbx:
        await sbx.write_file("clone3.py", CLONE3.encode())
        result = await sbx.run("python3 clone3.py; hostname", 20)  # and the host's name is not there either
        assert result.output == "clone3 Function not implemented\nthreads still start\nsandbox\n", result.output


# -- 7. a SIGKILLed owner ------------------------------------------------------------------------------------------

OWNER = """
import asyncio, os, sys
from nemo_gym_prorl.sandbox import SandboxLimits, SandboxSpec, open_sandbox

async def main():
    spec = SandboxSpec(image=sys.argv[2] or None, limits=SandboxLimits(memory_mb=256))
    sandbox = open_sandbox(sys.argv[1], spec)
    await sandbox.start()
    await sandbox.run("nohup sleep 1000 > /dev/null 2>&1 &", 10)
    print((await sandbox.run("readlink /proc/self/ns/pid", 10)).output.strip(), flush=True)
    await asyncio.sleep(1000)

asyncio.run(main())
"""


def pid_namespace_members(namespace: str) -> list[int]:
    found = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if os.readlink(f"/proc/{entry.name}/ns/pid") == namespace:
                    found.append(int(entry.name))
    return found


async def test_nothing_of_a_sandbox_runs_on_after_its_owner_is_sigkilled(
    request: pytest.FixtureRequest, backend: str, host_temp: Path
) -> None:
    image = spec_for(request, backend).image or ""
    env = {**os.environ, "TMPDIR": str(host_temp)}
    owner = subprocess.Popen([sys.executable, "-c", OWNER, backend, image], stdout=subprocess.PIPE, env=env)
    try:
        assert owner.stdout is not None
        namespace = (await asyncio.to_thread(owner.stdout.readline)).decode().strip()
        assert namespace.startswith("pid:[") and len(pid_namespace_members(namespace)) >= 2
    finally:
        owner.send_signal(signal.SIGKILL)
        owner.wait()
    await wait_until(lambda: not pid_namespace_members(namespace), timeout=15)
    # What is left is files and mounts, nothing running: the next start's clean-up removes them.
    if backend == "apptainer":
        await asyncio.to_thread(reap_orphan_instances)
    else:
        await asyncio.to_thread(sweep_orphans, str(host_temp))

