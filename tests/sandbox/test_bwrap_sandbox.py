"""BwrapSandbox against the real bubblewrap: what is bwrap's own — isolation, limits, images, binds, how exec is
confined, failed starts, and sweeping what a killed owner left.

The shell, exec, files, network and teardown, alike on every backend, are in test_sandbox_backends.py; escape and
abuse cases in test_sandbox_abuse.py; forks in test_sandbox_fork.py.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import psutil
import pytest
from sandbox_helpers import alive, process_tree, reachable_temp_dir, wait_until

from nemo_gym_prorl.contracts.sandbox import BindMount
from nemo_gym_prorl.sandbox import BwrapSandbox, SandboxError, SandboxLimits, SandboxSpec, bwrap
from nemo_gym_prorl.sandbox.bwrap import _hidden_etc_paths, sweep_orphans
from nemo_gym_prorl.sandbox.limits import own_cgroup_dirs

SPEC = SandboxSpec(limits=SandboxLimits(memory_mb=512, max_output_bytes=10_000))
REPO = Path(__file__).resolve().parents[2]
AS_ROOT = os.geteuid() == 0


@pytest.fixture
async def sbx() -> AsyncIterator[BwrapSandbox]:
    async with BwrapSandbox(SPEC) as sandbox:
        yield sandbox


@pytest.fixture
def shared_tmp() -> Iterator[Path]:
    with reachable_temp_dir() as path:
        yield path


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


# -- limits ------------------------------------------------------------------------------------------------------


async def test_memory_limit_per_process(sbx: BwrapSandbox) -> None:
    result = await sbx.run("python3 -c 'bytearray(4 * 1024**3)'", 10)
    assert result.exit_code != 0 and "MemoryError" in result.output


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


@pytest.mark.parametrize("mount_points", [False, True], ids=["entry-by-entry", "image-as-root"])
async def test_image_rootfs_replaces_the_host(shared_tmp: Path, mount_points: bool) -> None:
    """A rootfs with a directory for each mount point (as `prorl image build` makes them) is mounted as `/`
    itself; one without, entry by entry. The sandbox looks the same."""
    rootfs = tiny_rootfs(shared_tmp)
    for target in ("proc", "dev", "tmp", "workspace", ".prorl") if mount_points else ():
        (rootfs / target).mkdir()
    async with BwrapSandbox(SandboxSpec(image=str(rootfs))) as sandbox:
        assert (await sandbox.run("cat /etc/os-release; id -un; ls /usr/bin", 5)).output.split() == [
            "ID=tiny", "imageuser", "bash", "cat", "id", "ls", "sleep", "touch",
        ]  # fmt: skip
        assert (await sandbox.run("touch /etc/x", 5)).exit_code != 0
        assert (await sandbox.run("touch /x", 5)).exit_code != 0
        assert (await sandbox.run("touch /workspace/x /tmp/x && ls /workspace", 5)).output == "x\n"
        assert (await sandbox.exec(["cat", "/etc/os-release"], 5)).output == "ID=tiny\n"


async def test_the_image_passwd_gives_the_sandbox_user_the_workspace_as_home_and_a_link_is_never_followed(
    shared_tmp: Path,
) -> None:
    rootfs = tiny_rootfs(shared_tmp)
    async with BwrapSandbox(SandboxSpec(image=str(rootfs), workspace="/testbed")) as sandbox:
        assert (await sandbox.run("cat /etc/passwd", 5)).output == "imageuser:x:1000:1000::/testbed:/bin/bash\n"
    (rootfs / "etc/passwd").unlink()
    (rootfs / "etc/passwd").symlink_to("/etc/passwd")  # inside, a loop; followed on the host, the host's accounts
    async with BwrapSandbox(SandboxSpec(image=str(rootfs), workspace="/testbed")) as sandbox:
        seen = await sandbox.run("cat /etc/passwd", 5)
        assert seen.exit_code != 0 and "root:" not in seen.output


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


async def test_exec_is_confined_like_the_shell(sbx: BwrapSandbox) -> None:
    """exec joins the sandbox's namespaces (pid 1 is the shell) with the shell's user, capabilities and filter."""
    assert (await sbx.exec(["ps", "-o", "args=", "-p", "1"], 5)).output.startswith("/bin/bash --norc")
    status = await sbx.exec(["grep", "-E", "^(Uid|Cap...|NoNewPrivs|Seccomp):", "/proc/self/status"], 5)
    assert status.output.split() == [
        "Uid:", "1000", "1000", "1000", "1000",
        *(word for kind in ("Inh", "Prm", "Eff", "Bnd", "Amb") for word in (f"Cap{kind}:", "0000000000000000")),
        "NoNewPrivs:", "1", "Seccomp:", "2",
    ]  # fmt: skip


# -- teardown --------------------------------------------------------------------------------------------------------


async def test_failed_start_cleans_up() -> None:
    sandbox = BwrapSandbox(SPEC, bwrap="false")
    with pytest.raises(SandboxError, match="did not start"):
        await sandbox.start()
    assert sandbox.temp_dir is not None and not sandbox.temp_dir.exists()
    assert sandbox.cgroup is None or not [d for d in sandbox.cgroup.dirs.values() if os.path.exists(d)]


@pytest.mark.parametrize("victim", ["bwrap", "init"])
async def test_a_sandbox_killed_from_the_host_is_gone_not_silently_restarted(victim: str) -> None:
    """SIGKILL from the host to bwrap, or to the sandbox's init (which nothing inside can kill): the command that
    ran and every later call raise SandboxError, where a shell that merely exited would be replaced."""
    async with BwrapSandbox(SPEC) as sandbox:
        await sandbox.run("echo state > /tmp/kept", 5)
        bwrap = psutil.Process(sandbox.pid)
        target = bwrap if victim == "bwrap" else bwrap.children()[0]
        running = asyncio.ensure_future(sandbox.run("sleep 600", 60))
        await wait_until(lambda: any(p.name() == "sleep" for p in bwrap.children(recursive=True)))
        target.kill()
        with pytest.raises(SandboxError, match="the sandbox was killed"):
            await running
        for call in (sandbox.run("cat /tmp/kept", 5), sandbox.exec(["true"], 5)):
            with pytest.raises(SandboxError, match="the sandbox was killed"):
                await call
        temp_dir = sandbox.temp_dir
    assert temp_dir is not None and not temp_dir.exists() and not bwrap.is_running()


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
    await wait_until(lambda: not alive(sandbox_processes))
    assert os.path.isdir(temp_dir) and all(os.path.isdir(c) for c in cgroups)
    assert sweep_orphans(str(shared_tmp)) == [temp_dir]
    assert not os.path.exists(temp_dir) and not [c for c in cgroups if os.path.exists(c)]
    monkeypatch.setattr(tempfile, "tempdir", str(shared_tmp))
    async with BwrapSandbox(SPEC) as live:
        assert sweep_orphans(str(shared_tmp)) == []
        assert live.temp_dir is not None and live.temp_dir.exists()  # a live owner's sandbox is left alone


def test_a_close_cut_short_keeps_the_owner_record_for_the_sweep(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker killed while its sandbox's dir was being removed left dirs with no owner record (removed first, by
    chance of rmtree's order) but with mounts and cgroups still there, which no sweep would ever look at."""
    root = tmp_path / "prorl-sbx-cut-short"
    (root / "disk").mkdir(parents=True)
    (root / "disk" / "kept").write_text("x")
    bwrap._write_owner(root, [])

    def killed_here(path: str) -> None:
        raise OSError("the process died here")

    monkeypatch.setattr(bwrap, "remove_tree", killed_here)
    with pytest.raises(OSError):
        bwrap._remove_owned_dir(root)
    assert (root / ".owner").is_file()
    monkeypatch.undo()
    bwrap._remove_owned_dir(root)
    assert not root.exists()
