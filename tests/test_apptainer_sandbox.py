"""ApptainerSandbox against the real Apptainer and a real image: isolation, limits, exec, files, and teardown.

Apptainer comes from scripts/install_apptainer.sh and the image from the image cache (test_images.py's session
fixtures build whatever is missing), so these tests fail, not skip, where Apptainer cannot be installed.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import shutil
import subprocess
import tempfile
from collections.abc import AsyncIterator, Callable, Iterator
from glob import glob
from pathlib import Path

import psutil
import pytest

from nemo_gym_prorl.sandbox import SandboxError, SandboxLimits, SandboxSpec, apptainer, open_sandbox
from nemo_gym_prorl.sandbox.apptainer import ApptainerSandbox, find_apptainer, list_instances, reap_orphan_instances
from nemo_gym_prorl.sandbox.base import BindMount, PathOutsideWorkspaceError

AS_ROOT = os.geteuid() == 0
LIMITS = SandboxLimits(memory_mb=512, max_output_bytes=10_000)
INSIDE_UID = apptainer.SANDBOX_UID if AS_ROOT else os.getuid()  # the tests also assume gid == uid otherwise


@pytest.fixture
def spec(sif: Path) -> SandboxSpec:  # noqa: F811
    return SandboxSpec(image=str(sif), limits=LIMITS)


@pytest.fixture
async def sbx(spec: SandboxSpec) -> AsyncIterator[ApptainerSandbox]:
    async with ApptainerSandbox(spec) as sandbox:
        yield sandbox


@pytest.fixture
def shared_tmp() -> Iterator[Path]:
    """A host dir the sandbox's user may write to (pytest's tmp_path lives under a 0700 dir)."""
    path = Path(tempfile.mkdtemp(prefix="prorl-test-"))
    path.chmod(0o777)
    try:
        yield path
    finally:
        shutil.rmtree(path)


def process_tree(pid: int | None) -> list[psutil.Process]:
    assert pid is not None
    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


def sandbox_processes(sandbox: ApptainerSandbox) -> list[psutil.Process]:
    """Every host process of a sandbox: Apptainer's monitor, the shell's Apptainer parent and what runs under it,
    and whatever lives in the instance's pid namespace (processes that entered it are not the init's children)."""
    init = psutil.Process(sandbox.instance_pid)
    namespace = os.readlink(f"/proc/{init.pid}/ns/pid")
    inside = []
    for process in psutil.process_iter():
        with contextlib.suppress(OSError):
            if os.readlink(f"/proc/{process.pid}/ns/pid") == namespace:
                inside.append(process)
    return [init.parent(), *process_tree(sandbox.pid), *inside]


def alive(processes: list[psutil.Process]) -> list[psutil.Process]:
    return [p for p in processes if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


def cgroup_dirs(init_pid: int | None) -> list[str]:
    """Apptainer's cgroup v1 directories of an instance (one per controller)."""
    return glob(f"/sys/fs/cgroup/*/apptainer/{init_pid}")


async def wait_until(predicate: Callable[[], bool], timeout: float = 10.0) -> None:
    """Wait for a condition we can only observe by looking (a process appearing)."""
    async with asyncio.timeout(timeout):
        while not predicate():
            await asyncio.sleep(0.01)


# -- the persistent shell ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("command", ["sleep 100", "while :; do :; done", "trap '' INT; sleep 100"])
async def test_persistent_shell_and_timeout(sbx: ApptainerSandbox, command: str) -> None:
    await sbx.run("mkdir -p sub && cd sub && export KEPT=yes", 10)
    result = await sbx.run(command, 1)
    assert result.timed_out and result.exit_code is None and "timed out after 1s" in result.output
    after = await sbx.run("echo ok; pwd; echo $KEPT", 10)
    assert after.output == "ok\n/workspace/sub\nyes\n" and after.exit_code == 0


async def test_exit_codes_and_multiline_commands(sbx: ApptainerSandbox) -> None:
    assert (await sbx.run("false", 10)).exit_code == 1
    assert (await sbx.run("(exit 7)", 10)).exit_code == 7
    heredoc = await sbx.run("cat <<'EOF' > note.txt\nline one\nline two\nEOF\nwc -l < note.txt", 10)
    assert (heredoc.exit_code, heredoc.output) == (0, "2\n")
    exited = await sbx.run("exit 3", 10)
    assert exited.exit_code == 3 and "shell exited" in exited.output
    after = await sbx.run("pwd; cat note.txt", 10)
    assert after.exit_code == 0 and after.output.startswith("/workspace\nline one\n")


async def test_output_cap(sbx: ApptainerSandbox) -> None:
    result = await sbx.run("python3 -c \"print('y' * 5_000_000)\"", 30)
    assert result.exit_code == 0 and result.truncated and len(result.output) < 10_100
    big = await sbx.exec(["head", "-c", "50000000", "/dev/zero"], 30)
    assert big.exit_code == 0 and big.truncated and len(big.output) < 10_200


# -- isolation -----------------------------------------------------------------------------------------------------


async def test_not_root_and_no_capabilities(sbx: ApptainerSandbox) -> None:
    assert (await sbx.run("id -u; id -g; id -G", 10)).output.split() == [str(INSIDE_UID)] * 3
    for probe in (sbx.run("grep -E '^(Cap...|NoNewPrivs|Seccomp):' /proc/self/status", 10),
                  sbx.exec(["grep", "-E", "^(Cap...|NoNewPrivs|Seccomp):", "/proc/self/status"], 10)):  # fmt: skip
        assert (await probe).output.split() == [
            *(word for kind in ("Inh", "Prm", "Eff", "Bnd", "Amb") for word in (f"Cap{kind}:", "0000000000000000")),
            "NoNewPrivs:", "1", "Seccomp:", "2" if AS_ROOT else "0",
        ]  # fmt: skip
    # The uid is the host's own (no user namespace maps it to anything else) and it owns nothing of the image.
    if AS_ROOT:
        assert (await sbx.run("cat /proc/self/uid_map", 10)).output.split() == ["0", "0", "4294967295"]
    denied = await sbx.run("touch /etc/x || touch /usr/bin/x || echo denied", 10)
    assert denied.output.rstrip().endswith("denied") and "Permission denied" in denied.output
    assert (await sbx.run("su -c true root </dev/null 2>&1 || echo no-su", 10)).output.rstrip().endswith("no-su")
    processes = (await sbx.run("ps -e -o user=,args=", 10)).output.splitlines()
    assert [p.split(None, 1)[1] for p in processes] == ["appinit", "/bin/bash --norc --noprofile --noediting -i",
                                                        "ps -e -o user=,args="]  # fmt: skip
    env = (await sbx.run("env | sort | grep -v -e ^_= -e ^PWD= -e ^SHLVL= -e ^OLDPWD=", 10)).output
    assert env == (
        "HOME=/workspace\nLANG=C.UTF-8\nPATH=/usr/local/bin:/usr/bin:/bin:/usr/local/sbin:/usr/sbin:/sbin\nTERM=dumb\n"
    )


async def test_host_files_are_not_there(sbx: ApptainerSandbox) -> None:
    repo = Path(__file__).resolve().parents[1]
    for path in ("/root/.cache", str(repo), "/home"):
        result = await sbx.run(f"ls {path}/* >/dev/null 2>&1 && echo visible || echo hidden", 10)
        assert result.output == "hidden\n", path
    assert (await sbx.run("ls /workspace; touch /tmp/t && echo tmp-ok", 10)).output == "tmp-ok\n"


@pytest.mark.parametrize("network", [False, True])
async def test_network(sif: Path, network: bool) -> None:  # noqa: F811
    """Without spec.network only a loopback of its own: a port the host listens on is out of reach."""
    accepted = asyncio.Event()

    async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.set()
        writer.close()

    server = await asyncio.start_server(on_connect, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    probe = f"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=5); print('connected')"
    try:
        async with ApptainerSandbox(SandboxSpec(image=str(sif), network=network, limits=LIMITS)) as sandbox:
            result = await sandbox.exec(["python3", "-c", probe], 20)
            interfaces = (await sandbox.run("ls /sys/class/net", 10)).output.split()
    finally:
        server.close()
        await server.wait_closed()
    if network:
        assert result.output == "connected\n" and accepted.is_set()
    else:
        assert result.exit_code != 0 and "ConnectionRefusedError" in result.output and not accepted.is_set()
        assert interfaces == ["lo"]


# -- limits --------------------------------------------------------------------------------------------------------


async def test_memory_file_size_and_cpu_limits(sif: Path) -> None:  # noqa: F811
    limits = SandboxLimits(memory_mb=256, file_size_mb=1, cpu_time_s=1, max_output_bytes=10_000)
    async with ApptainerSandbox(SandboxSpec(image=str(sif), limits=limits)) as sandbox:
        hog = await sandbox.run("python3 -c \"b = bytearray(400 * 2**20); print('allocated')\"", 30)
        assert hog.exit_code != 0 and "MemoryError" in hog.output
        small = await sandbox.run("python3 -c \"b = bytearray(50 * 2**20); print('allocated')\"", 30)
        assert small.output == "allocated\n"
        big = await sandbox.run("head -c 2M /dev/zero > big; echo $?; stat -c %s big", 10)
        assert big.output.split()[-2:] == ["153", str(2**20)]  # 128 + SIGXFSZ, and nothing past the limit
        spin = await sandbox.exec(["python3", "-c", "while True: pass"], 20)
        assert (spin.exit_code, spin.timed_out) == (152, False) and spin.duration_s < 10  # 128 + SIGXCPU


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


async def test_process_limit_is_per_sandbox(sif: Path) -> None:  # noqa: F811
    """Root: Apptainer's pids cgroup, one per sandbox; otherwise RLIMIT_NPROC, counted in the instance's user
    namespace. Either way one sandbox full of processes does not stop another from starting its own."""
    spec = SandboxSpec(image=str(sif), limits=SandboxLimits(max_processes=20))
    async with ApptainerSandbox(spec) as full, ApptainerSandbox(spec) as other:
        for sandbox in (full, other):
            await sandbox.write_file("spawn.py", SPAWN.encode())
        result = await full.run("python3 spawn.py 100", 30)
        assert result.output == "refused: Resource temporarily unavailable\n17 20\n"  # + init, bash, python
        assert (await other.run("python3 spawn.py 15", 30)).output == "15 18\n"


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


async def test_memory_limit_for_the_whole_sandbox(sif: Path) -> None:  # noqa: F811
    """As root, Apptainer's memory cgroup: processes that each stay under the limit cannot add up past it.
    Otherwise (no cgroups without systemd) only the per-process RLIMIT_AS of test_memory_file_size_and_cpu_limits."""
    spec = SandboxSpec(image=str(sif), limits=SandboxLimits(memory_mb=200))
    async with ApptainerSandbox(spec) as sandbox:
        memory_dirs = glob(f"/sys/fs/cgroup/memory/apptainer/{sandbox.instance_pid}")
        assert len(memory_dirs) == (1 if AS_ROOT else 0)
        if not AS_ROOT:
            return
        assert int(Path(memory_dirs[0], "memory.limit_in_bytes").read_text()) == 200 * 2**20
        await sandbox.write_file("hogs.py", HOGS.encode())
        result = await sandbox.run("python3 hogs.py", 60)
        assert result.exit_code == 0 and int(result.output.split()[-1]) >= 1, result.output


# -- exec ----------------------------------------------------------------------------------------------------------


async def test_exec_runs_inside_the_same_sandbox(sbx: ApptainerSandbox) -> None:
    await sbx.run("echo from-shell > /tmp/note; sleep 300 &", 10)
    await sbx.run("cd /tmp && export ONLY_IN_SHELL=1", 10)
    result = await sbx.exec(["sh", "-c", "cat /tmp/note; pwd; echo ${ONLY_IN_SHELL:-unset}; pgrep -c -x sleep"], 10)
    assert (result.exit_code, result.output) == (0, "from-shell\n/workspace\nunset\n1\n")
    assert (await sbx.run("pwd", 10)).output == "/tmp\n"  # the shell's state is untouched


async def test_exec_results(sbx: ApptainerSandbox) -> None:
    assert (await sbx.exec(["sh", "-c", "echo out; echo err >&2; exit 3"], 10)).model_dump(
        include={"output", "exit_code", "timed_out"}
    ) == {"output": "out\nerr\n", "exit_code": 3, "timed_out": False}
    missing = await sbx.exec(["no-such-program"], 10)
    assert missing.exit_code == 127 and "No such file or directory" in missing.output
    with pytest.raises(ValueError):
        await sbx.exec([], 5)


async def test_exec_returns_when_the_program_exits(sbx: ApptainerSandbox) -> None:
    """A background process that keeps the program's output open neither delays the result nor is killed."""
    result = await sbx.exec(["sh", "-c", "echo before; sleep 300 & exit 4"], 30)
    assert (result.exit_code, result.output, result.timed_out) == (4, "before\n", False) and result.duration_s < 5
    assert (await sbx.run("pgrep -c -x sleep", 10)).output == "1\n"


async def test_exec_timeout_kills_the_program_and_its_group(sbx: ApptainerSandbox) -> None:
    result = await sbx.exec(["sh", "-c", "echo started; sleep 100 & exec sleep 101"], 1)
    assert result.timed_out and result.exit_code is None and result.output.startswith("started\n")
    assert "timed out after 1s" in result.output and result.duration_s < 5
    left = await sbx.run("ps -e -o args= | grep -c '^sleep 10[01]' || true", 10)
    assert left.output == "0\n"


def processes_named(name: str) -> list[psutil.Process]:
    found = []
    for process in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            if process.cmdline()[:1] == [name]:
                found.append(process)
    return found


async def test_cancelled_exec_leaves_no_process(sbx: ApptainerSandbox) -> None:
    name = f"prorl-cancelled-{os.getpid()}"
    task = asyncio.create_task(sbx.exec(["bash", "-c", f"exec -a {name} sleep 300"], 60))
    await wait_until(lambda: bool(processes_named(name)))
    sleepers = processes_named(name)
    assert [p.uids().real for p in sleepers] == [INSIDE_UID]
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert not alive(sleepers)
    assert (await sbx.run("echo ok", 10)).output == "ok\n"


# -- files ---------------------------------------------------------------------------------------------------------


async def test_files_roundtrip_and_escapes(sbx: ApptainerSandbox) -> None:
    await sbx.write_file("dir/a.txt", b"hello\n")
    await sbx.write_file("/workspace/b.bin", bytes(range(256)))
    assert (await sbx.run("cat dir/a.txt && echo more >> dir/a.txt && touch dir/c", 10)).output == "hello\n"
    assert await sbx.read_file("/workspace/dir/a.txt") == b"hello\nmore\n"
    assert await sbx.read_file("b.bin") == bytes(range(256))
    assert (await sbx.exec(["stat", "-c", "%u", "dir/a.txt", "dir"], 10)).output.split() == [str(INSIDE_UID)] * 2
    await sbx.run("ln -s /etc/passwd out; ln -s dir inside", 10)
    assert await sbx.read_file("inside/a.txt") == b"hello\nmore\n"
    for path in ("../escape", "dir/../../escape", "/etc/passwd", "out"):
        with pytest.raises(PathOutsideWorkspaceError, match="outside"):
            await sbx.read_file(path)
        with pytest.raises(PathOutsideWorkspaceError, match="outside"):
            await sbx.write_file(path, b"x")


# -- images and binds ----------------------------------------------------------------------------------------------


async def test_directory_image_and_binds(rootfs: Path, shared_tmp: Path) -> None:  # noqa: F811
    (shared_tmp / "ro").mkdir()
    (shared_tmp / "ro" / "data.txt").write_text("read me\n")
    (shared_tmp / "rw").mkdir(mode=0o777)
    (shared_tmp / "rw").chmod(0o777)
    binds = [
        BindMount(source=str(shared_tmp / "ro"), target="/data"),
        BindMount(source=str(shared_tmp / "rw"), target="/out", writable=True),
    ]
    async with ApptainerSandbox(SandboxSpec(image=str(rootfs), binds=binds, limits=LIMITS)) as sandbox:
        assert (await sandbox.run("cat /data/data.txt", 10)).output == "read me\n"
        assert (await sandbox.run("touch /data/x 2>&1", 10)).exit_code != 0
        assert (await sandbox.run("echo written > /out/result.txt", 10)).exit_code == 0
        assert (await sandbox.run("python3 -c 'import numpy; print(numpy.__name__)'", 30)).output == "numpy\n"
    assert (shared_tmp / "rw" / "result.txt").read_text() == "written\n"


async def test_default_image_is_the_cached_one(sif: Path) -> None:  # noqa: F811
    async with ApptainerSandbox(SandboxSpec(limits=LIMITS)) as sandbox:
        manifest = (await sandbox.run("cat /etc/prorl-image.json", 10)).output
        assert '"name": "prorl-base"' in manifest
        assert (await sandbox.exec(["git", "--version"], 10)).output.startswith("git version ")


async def test_failed_start_cleans_up(shared_tmp: Path) -> None:
    not_an_image = shared_tmp / "junk.sif"
    not_an_image.write_bytes(b"not a SIF")
    for image, message in (
        (not_an_image, "instance start failed"),
        (shared_tmp, "has no /.singularity.d/startscript"),
        (shared_tmp / "missing", "does not exist"),
    ):
        sandbox = ApptainerSandbox(SandboxSpec(image=str(image)))
        with pytest.raises(SandboxError, match=message):
            await sandbox.start()
        assert sandbox.temp_dir is None or not sandbox.temp_dir.exists()
        assert sandbox.name not in list_instances() and not apptainer._instance_logs(sandbox.name)


# -- teardown ------------------------------------------------------------------------------------------------------


async def test_close_leaves_nothing(sbx: ApptainerSandbox) -> None:
    await sbx.run("sleep 1000 & setsid sleep 1001 & nohup sleep 1002 >/dev/null 2>&1 &", 10)
    entry = list_instances()[sbx.name]
    assert entry["pid"] == sbx.instance_pid
    processes = sandbox_processes(sbx)
    assert len({p.pid for p in processes if p.name() == "sleep"}) == 3
    temp_dir, cgroups = sbx.temp_dir, cgroup_dirs(sbx.instance_pid)
    logs = [str(entry["logErrPath"]), str(entry["logOutPath"])]
    assert sorted(map(str, apptainer._instance_logs(sbx.name))) == sorted(logs)
    assert all(os.path.exists(log) for log in logs) and (len(cgroups) > 0) == AS_ROOT
    await sbx.close()
    await sbx.close()
    assert sbx.name not in list_instances()
    assert not alive(processes)
    assert temp_dir is not None and not temp_dir.exists()
    assert not [d for d in cgroups if os.path.exists(d)]
    assert not [log for log in logs if os.path.exists(log)]
    assert sbx.name not in Path("/proc/self/mountinfo").read_text()
    with pytest.raises(SandboxError, match="closed"):
        await sbx.run("echo hi", 5)
    with pytest.raises(SandboxError, match="closed"):
        await sbx.exec(["echo", "hi"], 5)


async def test_cancelled_run_then_close(sbx: ApptainerSandbox) -> None:
    task = asyncio.create_task(sbx.run("sleep 100", 60))
    await wait_until(lambda: any(p.name() == "sleep" for p in process_tree(sbx.pid)))
    processes = sandbox_processes(sbx)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await sbx.close()
    assert not alive(processes)
    assert sbx.temp_dir is not None and not sbx.temp_dir.exists()
    assert sbx.name not in list_instances()


async def test_cancelled_start_leaves_nothing(spec: SandboxSpec) -> None:
    """Cancelled while `apptainer instance start` runs: the instance that comes up anyway is stopped."""
    sandbox = ApptainerSandbox(spec)
    task = asyncio.create_task(sandbox.start())
    await wait_until(lambda: sandbox.temp_dir is not None and any(
        sandbox.name in " ".join(p.cmdline()) for p in psutil.Process().children(recursive=True)
    ))  # fmt: skip
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert sandbox.name not in list_instances()
    assert sandbox.temp_dir is not None and not sandbox.temp_dir.exists()
    assert not [p for p in psutil.process_iter(["cmdline"]) if sandbox.name in " ".join(p.info["cmdline"] or [])]


async def test_cancelled_inside_async_with_leaves_nothing(spec: SandboxSpec) -> None:
    sandbox = ApptainerSandbox(spec)

    async def use() -> None:
        async with sandbox:
            await sandbox.run("sleep 100", 60)

    task = asyncio.create_task(use())
    await wait_until(lambda: sandbox.pid is not None and any(p.name() == "sleep" for p in process_tree(sandbox.pid)))
    processes = sandbox_processes(sandbox)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert not alive(processes)
    assert sandbox.name not in list_instances()
    assert sandbox.temp_dir is not None and not sandbox.temp_dir.exists()


async def test_wall_clock_limit_kills_the_sandbox(sif: Path) -> None:  # noqa: F811
    sandbox = ApptainerSandbox(SandboxSpec(image=str(sif), limits=SandboxLimits(wall_clock_s=2)))
    async with sandbox:
        result = await sandbox.run("sleep 100", 30)
        assert result.exit_code is None and "wall-clock limit" in result.output and result.duration_s < 10
        with pytest.raises(SandboxError, match="wall-clock"):
            await sandbox.run("echo hi", 5)
    assert sandbox.name not in list_instances()
    assert sandbox.temp_dir is not None and not sandbox.temp_dir.exists()


async def test_instance_that_died_closes_cleanly(sbx: ApptainerSandbox) -> None:
    processes = sandbox_processes(sbx)
    init = psutil.Process(sbx.instance_pid)
    init.kill()
    init.wait(10)
    with contextlib.suppress(SandboxError):  # the shell may be seen dying, or fail to come back
        assert (await sbx.run("echo hi", 10)).exit_code != 0
    await sbx.close()
    assert not alive(processes)
    assert sbx.name not in list_instances()
    assert sbx.temp_dir is not None and not sbx.temp_dir.exists()


# -- orphans -------------------------------------------------------------------------------------------------------


def start_instance(image: Path, name: str) -> None:
    argv = [find_apptainer(), "-q", "instance", "start", "--containall", "--no-home"]
    argv += ["--drop-caps", "ALL"] if AS_ROOT else []
    subprocess.run([*argv, str(image), name], check=True, capture_output=True, timeout=60)


def stop_instance(name: str) -> None:
    subprocess.run(
        [find_apptainer(), "-q", "instance", "stop", "--force", name], check=False, capture_output=True, timeout=60
    )
    for log in apptainer._instance_logs(name):
        log.unlink()


def test_reaper_stops_only_our_orphans(sif: Path) -> None:  # noqa: F811
    gone = subprocess.Popen(["true"])
    gone.wait()  # a pid whose process is gone (and, being reaped, not reused within this test)
    suffix = secrets.token_hex(4)
    orphan = f"prorl-{gone.pid}-12345-{suffix}"
    live = f"prorl-{os.getpid()}-{apptainer._process_start_time(os.getpid())}-{suffix}"
    foreign = f"other-{gone.pid}-12345-{suffix}"
    leftover = Path(tempfile.mkdtemp(prefix=f"{orphan}-"))
    names = (orphan, live, foreign)
    try:
        for name in names:
            start_instance(sif, name)
        assert set(names) <= set(list_instances())
        assert reap_orphan_instances() == [orphan]
        running = list_instances()
        assert orphan not in running and live in running and foreign in running
        assert not leftover.exists() and not apptainer._instance_logs(orphan)
        assert len(apptainer._instance_logs(live)) == 2
    finally:
        for name in names:
            stop_instance(name)
        shutil.rmtree(leftover, ignore_errors=True)
    assert not set(names) & set(list_instances())


# -- locating Apptainer, registry ----------------------------------------------------------------------------------


def test_find_apptainer(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, installed: str) -> None:  # noqa: F811
    assert find_apptainer() == installed
    monkeypatch.setenv(apptainer.APPTAINER_ENV, str(tmp_path / "nothing"))
    with pytest.raises(SandboxError, match="not an executable"):
        find_apptainer()
    monkeypatch.delenv(apptainer.APPTAINER_ENV)
    monkeypatch.delenv(apptainer.PREFIX_ENV, raising=False)
    monkeypatch.setattr(apptainer, "_REPO", tmp_path)
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(SandboxError, match=r"apptainer is not installed: run .*scripts/install_apptainer\.sh"):
        find_apptainer()


def test_open_sandbox_registry(spec: SandboxSpec) -> None:
    assert isinstance(open_sandbox("apptainer", spec), ApptainerSandbox)
