"""BwrapSandbox against the real bubblewrap: isolation, limits, images, binds, exec, files, and teardown.

Escape and abuse cases shared by every backend are in test_sandbox_abuse.py, forks in test_sandbox_fork.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import psutil
import pytest

from nemo_gym_prorl.sandbox import BwrapSandbox, SandboxError, SandboxLimits, SandboxSpec, open_sandbox
from nemo_gym_prorl.sandbox.base import BindMount, PathOutsideWorkspaceError
from nemo_gym_prorl.sandbox.bwrap import _hidden_etc_paths, sweep_orphans
from nemo_gym_prorl.sandbox.limits import own_cgroup_dirs

SPEC = SandboxSpec(limits=SandboxLimits(memory_mb=512, max_output_bytes=10_000))
REPO = Path(__file__).resolve().parents[1]
AS_ROOT = os.geteuid() == 0


@pytest.fixture
async def sbx() -> AsyncIterator[BwrapSandbox]:
    async with BwrapSandbox(SPEC) as sandbox:
        yield sandbox


@pytest.fixture
def shared_tmp() -> Iterator[Path]:
    """A temp dir the sandbox's host uid can reach (pytest's tmp_path lives under a 0700 dir)."""
    path = Path(tempfile.mkdtemp(prefix="prorl-test-"))
    path.chmod(0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path)


def process_tree(pid: int | None) -> list[psutil.Process]:
    assert pid is not None
    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


async def wait_until(predicate: Callable[[], bool], timeout: float = 5.0) -> None:
    """Wait for a condition we can only observe by looking (a process appearing)."""
    async with asyncio.timeout(timeout):
        while not predicate():
            await asyncio.sleep(0.01)


# -- the persistent shell ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("command", ["sleep 100", "while :; do :; done", "trap '' INT; sleep 100"])
async def test_persistent_shell_and_timeout(sbx: BwrapSandbox, command: str) -> None:
    await sbx.run("mkdir -p sub && cd sub && export KEPT=yes", 5)
    result = await sbx.run(command, 1)
    assert result.timed_out and result.exit_code is None and "timed out after 1s" in result.output
    after = await sbx.run("echo ok; pwd; echo $KEPT", 5)
    assert after.output == "ok\n/workspace/sub\nyes\n" and after.exit_code == 0


async def test_exit_then_next_command_works(sbx: BwrapSandbox) -> None:
    result = await sbx.run("exit 3", 5)
    assert result.exit_code == 3 and "shell exited" in result.output
    after = await sbx.run("pwd", 5)
    assert after.exit_code == 0 and after.output.startswith("/workspace\n")


async def test_output_cap(sbx: BwrapSandbox) -> None:
    result = await sbx.run("python3 -c \"print('y' * 5_000_000)\"", 20)
    assert result.exit_code == 0 and result.truncated and result.duration_s < 10
    assert len(result.output) < 10_100 and "bytes truncated ...]" in result.output


# -- isolation -----------------------------------------------------------------------------------------------------


async def test_isolation(sbx: BwrapSandbox) -> None:
    assert (await sbx.run("id", 5)).output == "uid=1000(sandbox) gid=1000(sandbox) groups=1000(sandbox)\n"
    status = (await sbx.run("grep -E '^(Cap|NoNewPrivs|Seccomp:)' /proc/self/status", 5)).output
    assert status.splitlines() == [
        *(f"Cap{kind}:\t0000000000000000" for kind in ("Inh", "Prm", "Eff", "Bnd", "Amb")),
        "NoNewPrivs:\t1",
        "Seccomp:\t2",
    ]
    assert (await sbx.run("ps -e --no-headers | wc -l", 5)).output == "3\n"  # bash, ps, wc
    assert (await sbx.run("hostname", 5)).output == "sandbox\n"
    env = (await sbx.run("env | sort | grep -v -e ^_= -e ^PWD= -e ^SHLVL=", 5)).output
    assert env == (
        "HOME=/workspace\nLANG=C.UTF-8\nPATH=/usr/local/bin:/usr/bin:/bin:/usr/local/sbin:/usr/sbin:/sbin\nTERM=dumb\n"
    )


async def test_host_homes_checkout_and_secrets_are_not_there(sbx: BwrapSandbox) -> None:
    assert (await sbx.run("ls -A /", 5)).output.split() == [
        ".prorl", "bin", "dev", "etc", "lib", "lib64", "proc", "sbin", "tmp", "usr", "workspace",
    ]  # fmt: skip
    for path in ("/root", "/home", "/run", "/var", "/sys", str(REPO), str(Path.home())):
        assert (await sbx.run(f"ls {path}", 5)).exit_code != 0, path
    for secret in ("/etc/shadow", "/etc/gshadow", "/etc/machine-id", "/etc/pip.conf"):
        result = await sbx.run(f"cat {secret}", 5)
        assert result.output == "", secret  # an empty file stands in for it
    assert (await sbx.run("ls -A /etc/ssh /etc/ssl/private", 5)).output.split() == ["/etc/ssh:", "/etc/ssl/private:"]
    users = (await sbx.run("cut -d: -f1 /etc/passwd /etc/group", 5)).output.split()
    assert set(users) == {"root", "sandbox", "nobody", "nogroup"}  # the host's accounts are not listed
    # Whatever the host's other users may not read is hidden too, not merely unreadable.
    unreadable = [p for p in _hidden_etc_paths() if os.path.isfile(p) and not os.stat(p).st_mode & 0o004]
    assert unreadable, "this host has no private file under /etc to check"
    for path in unreadable[:5]:
        assert (await sbx.run(f"test -s {path} || echo empty", 5)).output == "empty\n", path


async def test_seccomp_denies_what_leaves_the_sandbox(sbx: BwrapSandbox) -> None:
    probe = """
import ctypes, errno, os
libc = ctypes.CDLL(None, use_errno=True)
def call(name, *args):
    ctypes.set_errno(0)
    ret = libc.syscall(*args)
    print(name, errno.errorcode.get(ctypes.get_errno(), "OK") if ret == -1 else "OK")
# x86-64 numbers: ptrace, mount, umount2, unshare, setns, keyctl, add_key, bpf, perf_event_open, init_module,
# kexec_load, clone3, io_uring_setup, open_by_handle_at, userfaultfd
call("ptrace", 101, 16, 1, 0, 0)
call("mount", 165, b"none", b"/tmp", b"tmpfs", 0, 0)
call("umount2", 166, b"/proc", 0)
call("unshare", 272, 0x10000000)
call("setns", 308, os.open("/proc/self/ns/net", os.O_RDONLY), 0)
call("keyctl", 250, 0, 0, 0, 0, 0)
call("add_key", 248, b"user", b"k", b"v", 1, -2)
call("bpf", 321, 0, 0, 0)
call("perf_event_open", 298, 0, 0, -1, -1, 0)
call("init_module", 175, 0, 0, b"")
call("kexec_load", 246, 0, 0, 0, 0)
call("clone3", 435, 0, 0)
call("io_uring_setup", 425, 1, 0)
call("open_by_handle_at", 304, 0, 0, 0)
call("userfaultfd", 323, 0)
"""
    await sbx.write_file("probe.py", probe.encode())
    lines = (await sbx.run("python3 probe.py", 10)).output.splitlines()
    assert lines == [
        *(f"{name} EPERM" for name in ("ptrace", "mount", "umount2", "unshare", "setns", "keyctl", "add_key", "bpf")),
        *(f"{name} EPERM" for name in ("perf_event_open", "init_module", "kexec_load")),
        "clone3 ENOSYS",
        *(f"{name} EPERM" for name in ("io_uring_setup", "open_by_handle_at", "userfaultfd")),
    ]
    assert (await sbx.run("unshare -U true", 5)).exit_code != 0
    spawn = "python3 -c 'import subprocess; print(subprocess.run([\"true\"]).returncode)'"
    assert (await sbx.run(spawn, 5)).output == "0\n"  # clone3 refused, glibc falls back to clone: still works


async def test_writes_outside_workspace_fail(sbx: BwrapSandbox) -> None:
    for target in ("/usr/x", "/etc/x", "/.prorl/x", "/x"):
        assert (await sbx.run(f"touch {target}", 5)).exit_code != 0
    assert (await sbx.run("touch /workspace/x /tmp/x /dev/shm/x", 5)).exit_code == 0


async def test_network(sbx: BwrapSandbox) -> None:
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        connect = f"python3 -c \"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=3)\""
        assert (await sbx.run(connect, 10)).exit_code != 0
        async with BwrapSandbox(SandboxSpec(network=True)) as networked:
            assert (await networked.run(connect, 10)).exit_code == 0


# -- limits ------------------------------------------------------------------------------------------------------


async def test_memory_limit_per_process(sbx: BwrapSandbox) -> None:
    result = await sbx.run("python3 -c 'bytearray(4 * 1024**3)'", 10)
    assert result.exit_code != 0 and "MemoryError" in result.output


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
ready = 0
while chunk := os.read(ready_r, 16):  # EOF: every child reported in or died
    ready += len(chunk)
os.close(go_w)
killed = sum(os.waitpid(pid, 0)[1] == signal.SIGKILL for pid in children)
print("ready", ready, "killed", killed)
"""


async def test_memory_limit_for_the_whole_sandbox() -> None:
    """Where the cgroup exists (root here), processes that each stay under the limit cannot add up past it."""
    spec = SandboxSpec(limits=SandboxLimits(memory_mb=200))
    async with BwrapSandbox(spec) as sandbox:
        assert (sandbox.cgroup is not None) == AS_ROOT
        if sandbox.cgroup is None:
            return  # only RLIMIT_AS holds here; test_memory_limit_per_process covers it
        await sandbox.write_file("hogs.py", HOGS.encode())
        result = await sandbox.run("python3 hogs.py", 30)
        assert result.exit_code == 0 and int(result.output.split()[-1]) >= 1, result.output
        limit = Path(sandbox.cgroup.dirs["memory"], "memory.limit_in_bytes").read_text()
        assert int(limit) == 200 * 2**20
        oom_control = Path(sandbox.cgroup.dirs["memory"], "memory.oom_control").read_text()
        oom = dict(line.split() for line in oom_control.splitlines())
        assert int(oom["oom_kill"]) >= 1


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


async def test_process_limit_is_per_sandbox() -> None:
    """RLIMIT_NPROC is counted per user namespace, and the pids cgroup per sandbox: one sandbox full of processes
    does not stop another from starting its own, although both run as the same host uid."""
    spec = SandboxSpec(limits=SandboxLimits(max_processes=20))
    async with BwrapSandbox(spec) as full, BwrapSandbox(spec) as other:
        for sandbox in (full, other):
            await sandbox.write_file("spawn.py", SPAWN.encode())
        result = await full.run("python3 spawn.py 100", 20)
        assert result.output == "refused: Resource temporarily unavailable\n18 20\n"  # bash, python, 18 sleeps
        assert (await other.run("python3 spawn.py 15", 20)).output == "15 17\n"
        if full.cgroup is not None:
            assert Path(full.cgroup.dirs["pids"], "pids.max").read_text().strip() == "21"  # + bwrap's monitor


async def test_file_size_and_cpu_time_limits() -> None:
    spec = SandboxSpec(limits=SandboxLimits(file_size_mb=1, cpu_time_s=1))
    async with BwrapSandbox(spec) as sandbox:
        big = await sandbox.run("head -c 2000000 /dev/zero > big; echo $?; stat -c %s big", 10)
        assert big.output.splitlines()[-2:] == ["153", "1048576"]  # 128 + SIGXFSZ
        spin = await sandbox.run("python3 -c 'while True: pass'; echo $?", 20)
        assert spin.output.strip().endswith("152") and spin.duration_s < 10  # 128 + SIGXCPU


# -- images and binds ----------------------------------------------------------------------------------------------


def tiny_rootfs(root: Path) -> Path:
    """A rootfs holding a few host binaries and their libraries, with an /etc of its own."""
    rootfs = root / "rootfs"
    (rootfs / "usr/bin").mkdir(parents=True)
    (rootfs / "etc").mkdir()
    for link in ("bin", "lib", "lib64"):
        os.symlink(f"usr/{link}", rootfs / link)
    for program in ("bash", "cat", "ls", "id", "touch", "sleep"):
        binary = shutil.which(program)
        assert binary is not None
        shutil.copy2(binary, rootfs / "usr/bin" / program)
        for line in subprocess.run(["ldd", binary], capture_output=True, text=True, check=True).stdout.splitlines():
            library = next((part for part in line.split() if part.startswith("/")), None)
            if library:
                parts = Path(library).parts[1:]
                target = rootfs / "usr" / Path(*(parts[1:] if parts[0] == "usr" else parts))  # lib -> usr/lib
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(os.path.realpath(library), target)
    (rootfs / "etc/passwd").write_text("imageuser:x:1000:1000::/workspace:/bin/bash\n")
    (rootfs / "etc/os-release").write_text("ID=tiny\n")
    return rootfs


async def test_image_rootfs_replaces_the_host(shared_tmp: Path) -> None:
    rootfs = tiny_rootfs(shared_tmp)
    async with BwrapSandbox(SandboxSpec(image=str(rootfs))) as sandbox:
        assert (await sandbox.run("cat /etc/os-release; id -un; ls /usr/bin", 5)).output.split() == [
            "ID=tiny", "imageuser", "bash", "cat", "id", "ls", "sleep", "touch",
        ]  # fmt: skip
        assert (await sandbox.run("touch /etc/x", 5)).exit_code != 0
        assert (await sandbox.run("touch /workspace/x /tmp/x && ls /workspace", 5)).output == "x\n"
        assert (await sandbox.exec(["cat", "/etc/os-release"], 5)).output == "ID=tiny\n"


async def test_image_must_be_a_reachable_directory(shared_tmp: Path) -> None:
    with pytest.raises(SandboxError, match="rootfs directory"):
        await BwrapSandbox(SandboxSpec(image=str(shared_tmp / "missing.sif"))).start()
    private = shared_tmp / "private"
    private.mkdir(mode=0o700)
    tiny_rootfs(private)
    if AS_ROOT:
        sandbox = BwrapSandbox(SandboxSpec(image=str(private / "rootfs")))
        with pytest.raises(SandboxError, match="out of reach of the sandbox's host uid 65534"):
            await sandbox.start()
        assert sandbox.temp_dir is not None and not sandbox.temp_dir.exists()


async def test_binds(shared_tmp: Path) -> None:
    (shared_tmp / "data").mkdir()
    (shared_tmp / "data/in.txt").write_text("input\n")
    (shared_tmp / "out").mkdir()
    if AS_ROOT:
        os.chown(shared_tmp / "out", 65534, 65534)
    binds = [
        BindMount(source=str(shared_tmp / "data"), target="/data"),
        BindMount(source=str(shared_tmp / "out"), target="/workspace/out", writable=True),
    ]
    async with BwrapSandbox(SandboxSpec(binds=binds)) as sandbox:
        assert (await sandbox.run("cat /data/in.txt", 5)).output == "input\n"
        assert (await sandbox.run("touch /data/x", 5)).exit_code != 0
        assert (await sandbox.run("echo result > /workspace/out/r.txt", 5)).exit_code == 0
    assert (shared_tmp / "out/r.txt").read_text() == "result\n"
    with pytest.raises(SandboxError, match="does not exist"):
        await BwrapSandbox(SandboxSpec(binds=[BindMount(source=str(shared_tmp / "nope"), target="/x")])).start()


# -- exec ----------------------------------------------------------------------------------------------------------


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


async def test_exec_runs_inside_the_same_sandbox(sbx: BwrapSandbox) -> None:
    """exec sees the shell's /tmp, processes and loopback, and is confined like the shell."""
    await sbx.write_file("server.py", SERVER.encode())
    await sbx.write_file("client.py", CLIENT.encode())
    await sbx.run("cd /tmp && export ONLY_IN_SHELL=1 && echo from-shell > /tmp/note", 5)
    assert (await sbx.run("mkfifo /tmp/up; python3 /workspace/server.py & cat /tmp/up", 10)).exit_code == 0
    result = await sbx.exec(["python3", "client.py"], 10)
    assert result.exit_code == 0 and result.output == "from-shell /workspace None\nhello from the shell\n"
    assert (await sbx.exec(["ps", "-o", "args=", "-p", "1"], 5)).output.startswith("/bin/bash --norc")
    status = await sbx.exec(["grep", "-E", "^(Uid|Cap...|NoNewPrivs|Seccomp):", "/proc/self/status"], 5)
    assert status.output.split() == [
        "Uid:", "1000", "1000", "1000", "1000",
        *(word for kind in ("Inh", "Prm", "Eff", "Bnd", "Amb") for word in (f"Cap{kind}:", "0000000000000000")),
        "NoNewPrivs:", "1", "Seccomp:", "2",
    ]  # fmt: skip
    assert (await sbx.run("pwd", 5)).output == "/tmp\n"  # the shell's state is untouched


async def test_exec_results(sbx: BwrapSandbox) -> None:
    assert (await sbx.exec(["sh", "-c", "echo out; echo err >&2; exit 3"], 5)).model_dump(
        include={"output", "exit_code", "timed_out"}
    ) == {"output": "out\nerr\n", "exit_code": 3, "timed_out": False}
    missing = await sbx.exec(["no-such-program"], 5)
    assert missing.exit_code == 127 and "No such file or directory" in missing.output
    big = await sbx.exec(["head", "-c", "50000000", "/dev/zero"], 20)
    assert big.truncated and len(big.output) < 10_200 and big.duration_s < 10
    with pytest.raises(ValueError):
        await sbx.exec([], 5)


async def test_exec_timeout_kills_the_program_and_its_group(sbx: BwrapSandbox) -> None:
    result = await sbx.exec(["sh", "-c", "echo started; sleep 100 & exec sleep 101"], 1)
    assert result.timed_out and result.exit_code is None and result.output.startswith("started\n")
    assert "timed out after 1s" in result.output and result.duration_s < 5
    left = await sbx.run("ps -e -o args= | grep -c '^sleep 10[01]' || true", 5)
    assert left.output == "0\n"


async def test_exec_after_the_shell_exited_and_after_close(sbx: BwrapSandbox) -> None:
    await sbx.run("exit 0", 5)
    assert (await sbx.exec(["echo", "ok"], 5)).output == "ok\n"
    await sbx.close()
    with pytest.raises(SandboxError, match="closed"):
        await sbx.exec(["echo", "ok"], 5)


def processes_named(name: str) -> list[psutil.Process]:
    found = []
    for process in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            if process.cmdline()[:1] == [name]:
                found.append(process)
    return found


async def test_cancelled_exec_leaves_no_process(sbx: BwrapSandbox) -> None:
    name = f"prorl-cancelled-{os.getpid()}"
    task = asyncio.create_task(sbx.exec(["bash", "-c", f"exec -a {name} sleep 300"], 60))
    await wait_until(lambda: bool(processes_named(name)))
    sleepers = processes_named(name)
    assert [p.uids().real for p in sleepers] == [65534 if AS_ROOT else os.getuid()]
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert not [p for p in sleepers if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert (await sbx.run("echo ok", 5)).output == "ok\n"


# -- files -----------------------------------------------------------------------------------------------------------


async def test_files_roundtrip_and_escapes(sbx: BwrapSandbox) -> None:
    await sbx.write_file("dir/a.txt", b"hello\n")
    await sbx.write_file("/workspace/b.bin", bytes(range(256)))
    assert (await sbx.run("cat dir/a.txt && echo more >> dir/a.txt && touch dir/c", 5)).output == "hello\n"
    assert await sbx.read_file("/workspace/dir/a.txt") == b"hello\nmore\n"
    assert await sbx.read_file("b.bin") == bytes(range(256))
    await sbx.run("ln -s /etc/passwd out; ln -s dir inside", 5)
    assert await sbx.read_file("inside/a.txt") == b"hello\nmore\n"
    for path in ("../escape", "dir/../../escape", "/etc/passwd", "out"):
        with pytest.raises(PathOutsideWorkspaceError, match="outside"):
            await sbx.read_file(path)
        with pytest.raises(PathOutsideWorkspaceError, match="outside"):
            await sbx.write_file(path, b"x")


# -- teardown --------------------------------------------------------------------------------------------------------


async def test_close_leaves_nothing(sbx: BwrapSandbox) -> None:
    background = int((await sbx.run("sleep 1000 & setsid sleep 1001 & echo $!", 5)).output)
    processes = process_tree(sbx.pid)
    assert len(processes) >= 4 and background  # bwrap, bash, two sleeps
    temp_dir, cgroup = sbx.temp_dir, sbx.cgroup
    cgroup_dirs = list(cgroup.dirs.values()) if cgroup is not None else []
    assert len(cgroup_dirs) == (len(own_cgroup_dirs()) if AS_ROOT else 0) > 0 or not AS_ROOT
    await sbx.close()
    await sbx.close()
    assert not [p for p in processes if p.is_running()]
    assert temp_dir is not None and not temp_dir.exists()
    assert not [d for d in cgroup_dirs if os.path.exists(d)]
    with pytest.raises(SandboxError, match="closed"):
        await sbx.run("echo hi", 5)


async def test_cancelled_run_then_close(sbx: BwrapSandbox) -> None:
    task = asyncio.create_task(sbx.run("sleep 100", 60))
    await wait_until(lambda: any(p.name() == "sleep" for p in process_tree(sbx.pid)))
    processes = process_tree(sbx.pid)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await sbx.close()
    assert not [p for p in processes if p.is_running()]
    assert sbx.temp_dir is not None and not sbx.temp_dir.exists()


async def test_wall_clock_limit_kills_the_sandbox() -> None:
    sandbox = BwrapSandbox(SandboxSpec(limits=SandboxLimits(wall_clock_s=1)))
    async with sandbox:
        processes = process_tree(sandbox.pid)
        result = await sandbox.run("sleep 100", 30)
        assert result.exit_code is None and "wall-clock limit" in result.output and result.duration_s < 5
        assert not [p for p in processes if p.is_running()]
        with pytest.raises(SandboxError, match="wall-clock"):
            await sandbox.run("echo hi", 5)


async def test_failed_start_cleans_up() -> None:
    sandbox = BwrapSandbox(SPEC, bwrap="false")
    with pytest.raises(SandboxError, match="did not start"):
        await sandbox.start()
    assert sandbox.temp_dir is not None and not sandbox.temp_dir.exists()
    assert sandbox.cgroup is None or not [d for d in sandbox.cgroup.dirs.values() if os.path.exists(d)]


def test_open_sandbox_registry() -> None:
    assert isinstance(open_sandbox("bwrap", SPEC), BwrapSandbox)
    with pytest.raises(ValueError, match=r"unknown sandbox backend 'docker'; known: .*bwrap"):
        open_sandbox("docker", SPEC)


OWNER = """
import asyncio, sys
from nemo_gym_prorl.sandbox import BwrapSandbox

async def main():
    sandbox = BwrapSandbox()
    await sandbox.start()
    await sandbox.run("sleep 1000 &", 5)
    print(sandbox.temp_dir, sandbox.pid, flush=True)
    await asyncio.Event().wait()

asyncio.run(main())
"""


async def test_what_a_killed_owner_left_is_swept(shared_tmp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """SIGKILL the process that owns a sandbox: bwrap dies with it (and so everything inside); the temp dir and
    the cgroups it could not remove are swept by the next process that looks."""
    owner = subprocess.Popen(
        [sys.executable, "-c", OWNER], stdout=subprocess.PIPE, text=True, env={**os.environ, "TMPDIR": str(shared_tmp)}
    )
    assert owner.stdout is not None
    temp_dir, bwrap_pid = owner.stdout.readline().split()
    sandbox_processes = process_tree(int(bwrap_pid))
    cgroups = [line for line in Path(temp_dir, ".owner").read_text().splitlines()[1:]]
    assert len(cgroups) == (len(own_cgroup_dirs()) if AS_ROOT else 0)
    owner.send_signal(signal.SIGKILL)
    owner.wait()
    await wait_until(lambda: not [p for p in sandbox_processes if p.is_running() and p.status() != "zombie"])
    assert os.path.isdir(temp_dir) and all(os.path.isdir(c) for c in cgroups)
    assert sweep_orphans(str(shared_tmp)) == [temp_dir]
    assert not os.path.exists(temp_dir) and not [c for c in cgroups if os.path.exists(c)]
    monkeypatch.setattr(tempfile, "tempdir", str(shared_tmp))
    async with BwrapSandbox(SPEC) as alive:
        assert sweep_orphans(str(shared_tmp)) == []
        assert alive.temp_dir is not None and alive.temp_dir.exists()  # a live owner's sandbox is left alone
