"""What every shell and sandbox of ours does alike, tested once over each of them, for real.

The persistent shell: `PtyShell` on its own (a bash in a pty on the host), and inside bwrap and Apptainer. Then what
a sandbox adds, over both backends: `exec` beside the shell, files in and out, network on request, the memory of the
whole sandbox bounded, and teardown — on close, at the wall-clock limit, cancelled — leaving nothing on the host.

Each backend's own isolation, limits, images and start-up are tested in test_pty_shell.py, test_bwrap_sandbox.py and
test_apptainer_sandbox.py; escapes and abuse in test_sandbox_abuse.py; forks in test_sandbox_fork.py.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from glob import glob
from pathlib import Path
from typing import Any

import psutil
import pytest
from sandbox_helpers import alive, apptainer_processes, process_tree, processes_named, wait_until

from nemo_gym_prorl.contracts.sandbox import PathOutsideWorkspaceError
from nemo_gym_prorl.sandbox import WORKSPACE, SandboxError, SandboxLimits, SandboxSpec, open_sandbox
from nemo_gym_prorl.sandbox.apptainer import SANDBOX_UID, ApptainerSandbox, list_instances
from nemo_gym_prorl.sandbox.bwrap import BwrapSandbox
from nemo_gym_prorl.sandbox.limits import own_cgroup_dirs
from nemo_gym_prorl.sandbox.pty_shell import PtyShell
from nemo_gym_prorl.sandbox.workspace import lexical_relative

AS_ROOT = os.geteuid() == 0
LIMITS = SandboxLimits(memory_mb=512, max_output_bytes=10_000)
BASH = ["bash", "--norc", "--noprofile", "--noediting", "-i"]
SANDBOXES = ["bwrap", "apptainer"]
SHELLS = ["pty", *SANDBOXES]
INSIDE_UID = {"bwrap": 1000, "apptainer": SANDBOX_UID if AS_ROOT else os.getuid()}
"""Who owns, as seen inside, what the sandbox's processes and `write_file` create."""


def image_for(request: pytest.FixtureRequest, backend: str) -> str | None:
    """bwrap runs on the host's /usr; Apptainer on the default image (built by the session fixture if missing)."""
    return str(request.getfixturevalue("sif")) if backend == "apptainer" else None


@pytest.fixture(params=SANDBOXES)
def make(request: pytest.FixtureRequest) -> Callable[..., Any]:
    """A factory of not yet started sandboxes of one backend: `make(**spec_fields)`."""
    image = image_for(request, request.param)

    def make(**fields: Any) -> Any:
        return open_sandbox(request.param, SandboxSpec(**{"image": image, "limits": LIMITS, **fields}))

    return make


@pytest.fixture
async def sbx(make: Callable[..., Any]) -> AsyncIterator[Any]:
    async with make() as sandbox:
        yield sandbox


@dataclass
class Shell:
    target: Any  # PtyShell | BwrapSandbox | ApptainerSandbox: what `run` is called on
    home: str  # the shell's cwd at start


@pytest.fixture(params=SHELLS)
async def shell(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Shell]:
    if request.param == "pty":
        home, control = tmp_path / "home", tmp_path / "control"
        home.mkdir()
        control.mkdir()
        env = {"PATH": "/usr/bin:/bin", "TERM": "dumb"}
        pty = PtyShell(["env", "-C", str(home), *BASH], control, env=env, max_output_bytes=10_000, grace_s=0.5)
        await pty.start()
        try:
            yield Shell(pty, str(home))
        finally:
            await pty.close()
    else:
        spec = SandboxSpec(image=image_for(request, request.param), limits=LIMITS)
        async with open_sandbox(request.param, spec) as sandbox:
            yield Shell(sandbox, WORKSPACE)


def host_processes(target: Any) -> list[psutil.Process]:
    """Every host process of a shell or sandbox."""
    return apptainer_processes(target) if isinstance(target, ApptainerSandbox) else process_tree(target.pid)


def host_traces(target: Any) -> Callable[[], list[str]]:
    """What a shell or sandbox has on the host now besides processes (temp dir, cgroups, Apptainer's instance, logs
    and mounts), checked to be there; returns a check of which of them are still there."""
    if isinstance(target, BwrapSandbox):
        cgroups = list(target.cgroup.dirs.values()) if target.cgroup is not None else []
        assert len(cgroups) == (len(own_cgroup_dirs()) if AS_ROOT else 0)
        paths = [str(target.temp_dir), *cgroups]
    elif isinstance(target, ApptainerSandbox):
        entry = list_instances()[target.name]
        assert entry["pid"] == target.instance_pid
        cgroups = glob(f"/sys/fs/cgroup/*/apptainer/{target.instance_pid}")
        assert (len(cgroups) > 0) == AS_ROOT
        paths = [str(target.temp_dir), *cgroups, str(entry["logErrPath"]), str(entry["logOutPath"])]
    else:
        return lambda: []
    assert all(os.path.exists(path) for path in paths), paths

    def left() -> list[str]:
        found = [path for path in paths if os.path.exists(path)]
        if isinstance(target, ApptainerSandbox):
            found += [f"instance {target.name}"] if target.name in list_instances() else []
            found += ["a mount"] if target.name in Path("/proc/self/mountinfo").read_text() else []
        return found

    return left


def memory_cgroup(sandbox: Any) -> Path | None:
    """The sandbox's own memory cgroup (v1, where root may make one), None without."""
    if isinstance(sandbox, BwrapSandbox):
        return Path(sandbox.cgroup.dirs["memory"]) if sandbox.cgroup is not None else None
    found = glob(f"/sys/fs/cgroup/memory/apptainer/{sandbox.instance_pid}")
    return Path(found[0]) if found else None


# -- the persistent shell --------------------------------------------------------------------------------------------


async def test_state_persists_between_commands(shell: Shell) -> None:
    await shell.target.run('mkdir -p sub && cd sub && export GREETING=hello; greet() { echo "$GREETING $1"; }', 10)
    result = await shell.target.run("pwd; greet world", 10)
    assert result.output == f"{shell.home}/sub\nhello world\n" and result.exit_code == 0


async def test_exit_codes_and_multiline_commands(shell: Shell) -> None:
    for command, code in (("true", 0), ("false", 1), ("(exit 42)", 42), ("echo hi | grep -q nope", 1)):
        assert (await shell.target.run(command, 10)).exit_code == code, command
    command = "NAME=heredoc\ncat <<EOF\nline 1\n  $NAME 'quoted' \"double\"\nEOF\necho done"
    result = await shell.target.run(command, 10)
    assert (result.exit_code, result.output) == (0, "line 1\n  heredoc 'quoted' \"double\"\ndone\n")


async def test_output_is_exactly_what_was_printed(shell: Shell) -> None:
    assert (await shell.target.run("printf 'a\\nb'", 10)).output == "a\nb"
    assert (await shell.target.run("echo out; echo err >&2", 10)).output == "out\nerr\n"
    assert (await shell.target.run("printf 'x\\r\\n'", 10)).output == "x\n"
    assert (await shell.target.run(":", 10)).output == ""


async def test_large_output_is_capped_and_fast(shell: Shell) -> None:
    result = await shell.target.run("head -c 5000000 /dev/zero | tr '\\0' x; echo; echo END", 30)
    assert result.exit_code == 0 and result.truncated and result.duration_s < 10
    head, tail = result.output.split("\n[... 4990005 bytes truncated ...]\n")
    assert head == "x" * 5000
    assert tail == "x" * 4995 + "\nEND\n"


@pytest.mark.parametrize(
    ("command", "how"),
    [("sleep 100", "Ctrl-C"), ("while :; do :; done", "Ctrl-C"), ("trap '' INT; sleep 100", "Ctrl-\\")],
)
async def test_timeout_interrupts_and_keeps_the_session(shell: Shell, command: str, how: str) -> None:
    await shell.target.run("mkdir -p sub && cd sub && export KEPT=yes", 10)
    result = await shell.target.run(f"echo before; {command}", 1)
    assert result.timed_out and result.exit_code is None
    assert result.output.startswith("before\n") and "timed out after 1s" in result.output and how in result.output
    after = await shell.target.run("echo ok; pwd; echo $KEPT", 10)
    assert after.output == f"ok\n{shell.home}/sub\nyes\n" and after.exit_code == 0


async def test_exit_resets_the_shell(shell: Shell) -> None:
    await shell.target.run("export GONE=1 && mkdir -p sub && cd sub", 10)
    result = await shell.target.run("exit 3", 10)
    assert result.exit_code == 3 and "shell exited" in result.output
    after = await shell.target.run("echo ok ${GONE:-unset}; pwd", 10)
    assert after.exit_code == 0
    assert after.output.startswith(f"ok unset\n{shell.home}\n") and "reset" in after.output


async def test_cancelled_run_leaves_a_usable_shell(shell: Shell) -> None:
    task = asyncio.create_task(shell.target.run("sleep 100", 60))
    await wait_until(lambda: any(p.name() == "sleep" for p in process_tree(shell.target.pid)))
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert (await shell.target.run("echo ok", 10)).output == "ok\n"


async def test_cancelled_run_then_close(shell: Shell) -> None:
    task = asyncio.create_task(shell.target.run("sleep 100", 60))
    await wait_until(lambda: any(p.name() == "sleep" for p in process_tree(shell.target.pid)))
    processes, left = host_processes(shell.target), host_traces(shell.target)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await shell.target.close()
    assert not alive(processes) and not left()


# -- exec --------------------------------------------------------------------------------------------------------------


SERVER = """
import socket
s = socket.socket()
s.bind(("127.0.0.1", 8765))
s.listen()
open("/tmp/up", "w").close()  # the shell's `cat /tmp/up` returns: we are listening
c, _ = s.accept()
c.sendall(b"hello from the shell")
c.close()
"""
CLIENT = """
import os, socket
print(open("/tmp/note").read().strip(), os.getcwd(), os.environ.get("ONLY_IN_SHELL"))
print(socket.create_connection(("127.0.0.1", 8765), timeout=5).recv(100).decode())
"""


async def test_exec_runs_inside_the_same_sandbox(sbx: Any) -> None:
    """exec sees the shell's /tmp and loopback, starts in /workspace, and leaves the shell's state alone."""
    await sbx.write_file("server.py", SERVER.encode())
    await sbx.write_file("client.py", CLIENT.encode())
    await sbx.run("cd /tmp && export ONLY_IN_SHELL=1 && echo from-shell > /tmp/note", 10)
    assert (await sbx.run("mkfifo /tmp/up; python3 /workspace/server.py & cat /tmp/up", 10)).exit_code == 0
    result = await sbx.exec(["python3", "client.py"], 20)
    assert result.exit_code == 0 and result.output == "from-shell /workspace None\nhello from the shell\n"
    assert (await sbx.run("pwd", 10)).output == "/tmp\n"


async def test_exec_results(sbx: Any) -> None:
    assert (await sbx.exec(["sh", "-c", "echo out; echo err >&2; exit 3"], 10)).model_dump(
        include={"output", "exit_code", "timed_out"}
    ) == {"output": "out\nerr\n", "exit_code": 3, "timed_out": False}
    missing = await sbx.exec(["no-such-program"], 10)
    assert missing.exit_code == 127 and "No such file or directory" in missing.output
    big = await sbx.exec(["head", "-c", "50000000", "/dev/zero"], 30)
    assert big.truncated and len(big.output) < 10_200 and big.duration_s < 10
    with pytest.raises(ValueError):
        await sbx.exec([], 5)


async def test_exec_returns_when_the_program_exits(sbx: Any) -> None:
    """A background process that keeps the program's output open neither delays the result nor is killed."""
    result = await sbx.exec(["sh", "-c", "echo before; sleep 300 & exit 4"], 30)
    assert (result.exit_code, result.output, result.timed_out) == (4, "before\n", False) and result.duration_s < 5
    assert (await sbx.run("pgrep -c -x sleep", 10)).output == "1\n"


async def test_exec_timeout_kills_the_program_and_its_group(sbx: Any) -> None:
    result = await sbx.exec(["sh", "-c", "echo started; sleep 100 & exec sleep 101"], 1)
    assert result.timed_out and result.exit_code is None and result.output.startswith("started\n")
    assert "timed out after 1s" in result.output and result.duration_s < 5
    for _ in range(50):  # the kill is sent at once, but on a loaded host the dying can take a moment to be seen
        left = await sbx.run("ps -e -o args= | grep -c '^sleep 10[01]' || true", 10)
        if left.output == "0\n":
            break
        await asyncio.sleep(0.1)
    assert left.output == "0\n"


async def test_cancelled_exec_leaves_no_process(sbx: Any) -> None:
    name = f"prorl-cancelled-{os.getpid()}"
    task = asyncio.create_task(sbx.exec(["bash", "-c", f"exec -a {name} sleep 300"], 60))
    await wait_until(lambda: bool(processes_named(name)))
    sleepers = processes_named(name)
    assert [p.uids().real for p in sleepers] == [65534 if AS_ROOT else os.getuid()]
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert not alive(sleepers)
    assert (await sbx.run("echo ok", 10)).output == "ok\n"


async def test_exec_after_the_shell_exited_and_after_close(sbx: Any) -> None:
    await sbx.run("exit 0", 10)
    assert (await sbx.exec(["echo", "ok"], 10)).output == "ok\n"
    await sbx.close()
    with pytest.raises(SandboxError, match="closed"):
        await sbx.exec(["echo", "ok"], 5)


# -- files -------------------------------------------------------------------------------------------------------------


async def test_files_roundtrip_and_escapes(sbx: Any) -> None:
    await sbx.write_file("dir/a.txt", b"hello\n")
    await sbx.write_file("/workspace/b.bin", bytes(range(256)))
    assert (await sbx.run("cat dir/a.txt && echo more >> dir/a.txt && touch dir/c", 10)).output == "hello\n"
    assert await sbx.read_file("/workspace/dir/a.txt") == b"hello\nmore\n"
    assert await sbx.read_file("b.bin") == bytes(range(256))
    inside_uid = INSIDE_UID["bwrap" if isinstance(sbx, BwrapSandbox) else "apptainer"]
    assert (await sbx.exec(["stat", "-c", "%u", "dir/a.txt", "dir"], 10)).output.split() == [str(inside_uid)] * 2
    await sbx.run("ln -s /etc/passwd out; ln -s dir inside", 10)
    assert await sbx.read_file("inside/a.txt") == b"hello\nmore\n"
    for path in ("../escape", "dir/../../escape", "/etc/passwd", "out"):
        with pytest.raises(PathOutsideWorkspaceError, match="outside"):
            await sbx.read_file(path)
        with pytest.raises(PathOutsideWorkspaceError, match="outside"):
            await sbx.write_file(path, b"x")
    for path in ("", ".", "/workspace", "dir/.."):
        with pytest.raises(PathOutsideWorkspaceError, match="workspace itself"):
            await sbx.write_file(path, b"x")


def test_lexical_paths_stay_in_the_workspace_they_name() -> None:
    """The check for workspaces the host cannot open (forks, NeMo Gym providers): by name, `..` included."""
    assert str(lexical_relative("/workspace/a/../b")) == "b"
    assert str(lexical_relative("../here/x", "/tmp/here")) == "x"
    assert str(lexical_relative("/workspace/x", "/tmp/here", aliases=(WORKSPACE,))) == "x"
    for path, message in (("../x", "outside"), ("/etc/passwd", "outside"), ("a/..", "workspace itself")):
        with pytest.raises(PathOutsideWorkspaceError, match=message):
            lexical_relative(path)


# -- network and limits ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("network", [False, True])
async def test_network_only_when_asked(make: Callable[..., Any], network: bool) -> None:
    """Without spec.network only a loopback of its own: a port the host listens on is out of reach."""
    accepted = asyncio.Event()

    async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.set()
        writer.close()

    server = await asyncio.start_server(on_connect, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    probe = f"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=5); print('connected')"
    interfaces = "import socket; print(*sorted(name for _, name in socket.if_nameindex()))"
    try:
        async with make(network=network) as sandbox:
            result = await sandbox.exec(["python3", "-c", probe], 20)
            names = (await sandbox.exec(["python3", "-c", interfaces], 20)).output.split()
    finally:
        server.close()
        await server.wait_closed()
    if network:
        assert result.output == "connected\n" and accepted.is_set()
    else:
        assert result.exit_code != 0 and "ConnectionRefusedError" in result.output and not accepted.is_set()
        assert names == ["lo"]


SPAWN = """
import os, subprocess, sys
children = []
try:
    while len(children) < int(sys.argv[1]):
        children.append(subprocess.Popen(["sleep", "100"]))
except BlockingIOError as e:
    print("refused:", e.strerror)
print(len(children), sum(name.isdigit() for name in os.listdir("/proc")))
"""
OWN_PROCESSES = {"bwrap": 2, "apptainer": 3}
"""Processes of a sandbox besides what its commands start: bash, python; and Apptainer's init."""


async def test_process_limit_is_per_sandbox(make: Callable[..., Any]) -> None:
    """As root a pids cgroup per sandbox, otherwise RLIMIT_NPROC counted per user namespace: one sandbox full of
    processes does not stop another from starting its own, although both run as the same host uid."""
    async with (
        make(limits=SandboxLimits(max_processes=20)) as full,
        make(limits=SandboxLimits(max_processes=20)) as other,
    ):
        own = OWN_PROCESSES["bwrap" if isinstance(full, BwrapSandbox) else "apptainer"]
        for sandbox in (full, other):
            await sandbox.write_file("spawn.py", SPAWN.encode())
        result = await full.run("python3 spawn.py 100", 30)
        assert result.output == f"refused: Resource temporarily unavailable\n{20 - own} 20\n"
        assert (await other.run("python3 spawn.py 15", 30)).output == f"15 {15 + own}\n"
        if isinstance(full, BwrapSandbox) and full.cgroup is not None:
            assert Path(full.cgroup.dirs["pids"], "pids.max").read_text().strip() == "21"  # + bwrap's monitor


HOGS = """
import os, signal
ready_r, ready_w = os.pipe()
go_r, go_w = os.pipe()
children = []
for _ in range(3):
    pid = os.fork()
    if pid == 0:
        os.close(go_w)
        hog = bytearray(120 * 2**20)
        hog[::4096] = b"x" * len(hog[::4096])  # touch every page: resident, not just reserved
        os.write(ready_w, b".")
        os.close(ready_w)
        os.read(go_r, 1)  # hold the memory until the parent lets go
        os._exit(0)
    children.append(pid)
os.close(ready_w)
while os.read(ready_r, 16):  # EOF: every child reported in or died
    pass
os.close(go_w)
print("killed", sum(os.waitpid(pid, 0)[1] == signal.SIGKILL for pid in children))
"""


async def test_memory_limit_for_the_whole_sandbox(make: Callable[..., Any]) -> None:
    """As root, a memory cgroup per sandbox: processes that each stay under the limit cannot add up past it.
    Otherwise only the per-process RLIMIT_AS holds (the backends' own tests cover it)."""
    async with make(limits=SandboxLimits(memory_mb=200)) as sandbox:
        cgroup = memory_cgroup(sandbox)
        assert (cgroup is not None) == AS_ROOT
        if cgroup is None:
            return
        assert int((cgroup / "memory.limit_in_bytes").read_text()) == 200 * 2**20
        await sandbox.write_file("hogs.py", HOGS.encode())
        result = await sandbox.run("python3 hogs.py", 60)
        assert result.exit_code == 0 and int(result.output.split()[-1]) >= 1, result.output
        oom = dict(line.split() for line in (cgroup / "memory.oom_control").read_text().splitlines())
        assert int(oom["oom_kill"]) >= 1


# -- teardown ----------------------------------------------------------------------------------------------------------


async def test_close_leaves_nothing(sbx: Any) -> None:
    await sbx.run("sleep 1000 & setsid sleep 1001 & nohup sleep 1002 >/dev/null 2>&1 &", 10)
    await sbx.exec(["sh", "-c", "sleep 1003 &"], 10)
    await wait_until(lambda: sum(p.name() == "sleep" for p in set(host_processes(sbx))) == 4)  # forked, then exec'd
    processes, left = host_processes(sbx), host_traces(sbx)
    await sbx.close()
    await sbx.close()
    assert not alive(processes) and not left()
    for operation in (sbx.run("echo hi", 5), sbx.exec(["echo", "hi"], 5), sbx.read_file("x")):
        with pytest.raises(SandboxError, match="closed|not running"):
            await operation


async def test_cancelled_inside_async_with_leaves_nothing(make: Callable[..., Any]) -> None:
    sandbox = make()
    seen: list[Callable[[], list[str]]] = []

    async def use() -> None:
        async with sandbox:
            seen.append(host_traces(sandbox))
            await sandbox.run("sleep 100", 60)

    task = asyncio.create_task(use())
    await wait_until(lambda: sandbox.pid is not None and any(p.name() == "sleep" for p in process_tree(sandbox.pid)))
    processes = host_processes(sandbox)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert not alive(processes) and not seen[0]()


async def test_wall_clock_limit_kills_the_sandbox(make: Callable[..., Any]) -> None:
    sandbox = make(limits=SandboxLimits(wall_clock_s=2))
    async with sandbox:
        processes, left = host_processes(sandbox), host_traces(sandbox)
        result = await sandbox.run("sleep 100", 30)
        assert result.exit_code is None and "wall-clock limit" in result.output and result.duration_s < 10
        with pytest.raises(SandboxError, match="wall-clock"):
            await sandbox.run("echo hi", 5)
        await sandbox.close()  # the closing the limit started, awaited
        assert not alive(processes) and not left()


@pytest.mark.parametrize(("backend", "kind"), [("bwrap", BwrapSandbox), ("apptainer", ApptainerSandbox)])
def test_open_sandbox_registry(backend: str, kind: type) -> None:
    assert type(open_sandbox(backend, SandboxSpec())) is kind
    with pytest.raises(ValueError, match=r"unknown sandbox backend 'docker'; known: .*apptainer.*bwrap"):
        open_sandbox("docker", SandboxSpec())
