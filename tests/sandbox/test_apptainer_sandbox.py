"""ApptainerSandbox against the real Apptainer and a real image: what is Apptainer's own — isolation, limits, images
and binds, start-up (failed, cancelled), an instance that died, the orphan reaper, and locating Apptainer.

The shell, exec, files, network and teardown, alike on every backend, are in test_sandbox_backends.py; escape and
abuse cases in test_sandbox_abuse.py.

Apptainer comes from scripts/install_apptainer.sh and the image from the image cache (test_images.py's session
fixtures build whatever is missing), so these tests fail, not skip, where Apptainer cannot be installed.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import shutil
import subprocess
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import psutil
import pytest
from sandbox_helpers import alive, apptainer_processes, reachable_temp_dir, wait_until

from nemo_gym_prorl.contracts.sandbox import BindMount
from nemo_gym_prorl.sandbox import SandboxError, SandboxLimits, SandboxSpec, apptainer, apptainer_binary
from nemo_gym_prorl.sandbox.apptainer import ApptainerSandbox, list_instances, reap_orphan_instances
from nemo_gym_prorl.sandbox.apptainer_binary import find_apptainer

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
    with reachable_temp_dir(0o777) as path:  # the sandbox's user may write to it
        yield path


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
    repo = Path(__file__).resolve().parents[2]
    for path in ("/root/.cache", str(repo), "/home"):
        result = await sbx.run(f"ls {path}/* >/dev/null 2>&1 && echo visible || echo hidden", 10)
        assert result.output == "hidden\n", path
    assert (await sbx.run("ls /workspace; touch /tmp/t && echo tmp-ok", 10)).output == "tmp-ok\n"


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


def sleepers(sandbox: ApptainerSandbox) -> int:
    """How many `sleep` processes run in the sandbox's instance (0 while one of them is being looked at exits)."""
    try:
        return sum(p.name() == "sleep" for p in apptainer_processes(sandbox))
    except psutil.NoSuchProcess:
        return 0


def assert_all_gone(sandbox: ApptainerSandbox, processes: list[psutil.Process]) -> None:
    assert not alive(processes)
    assert sandbox.name not in list_instances() and not apptainer._instance_logs(sandbox.name)
    assert sandbox.temp_dir is not None and not sandbox.temp_dir.exists()


@pytest.mark.parametrize("victim", ["init", "monitor"])
async def test_an_instance_killed_from_the_host_is_gone_not_silently_restarted(spec: SandboxSpec, victim: str) -> None:
    """SIGKILL from the host to the instance's init (which nothing inside can kill) or to Apptainer's monitor: the
    command and the program that ran, and every later call, raise SandboxError, where a shell that merely exited
    would be replaced; closing still removes everything."""
    async with ApptainerSandbox(spec) as sandbox:
        running = asyncio.ensure_future(sandbox.run("sleep 30", 60))
        program = asyncio.ensure_future(sandbox.exec(["sleep", "30"], 60))
        await wait_until(lambda: sleepers(sandbox) == 2)
        processes = apptainer_processes(sandbox)
        init = psutil.Process(sandbox.instance_pid)
        (init if victim == "init" else init.parent()).kill()
        for call in (running, program, sandbox.run("echo hi", 5), sandbox.exec(["true"], 5)):
            with pytest.raises(SandboxError, match="the sandbox was killed"):
                await call
    assert_all_gone(sandbox, processes)


async def test_an_instance_killed_while_idle_fails_the_next_call(sbx: ApptainerSandbox) -> None:
    processes = apptainer_processes(sbx)
    init = psutil.Process(sbx.instance_pid)
    init.kill()
    init.wait(10)
    with pytest.raises(SandboxError, match="the sandbox was killed: its instance's init was killed from the host"):
        await sbx.run("echo hi", 10)
    with pytest.raises(SandboxError, match="the sandbox was killed"):
        await sbx.exec(["true"], 10)
    await sbx.close()
    assert_all_gone(sbx, processes)


async def test_a_shell_that_exits_is_replaced(sbx: ApptainerSandbox) -> None:
    """`exit`, even with the status of a SIGKILL'd program, ends the shell, not the instance: a new shell takes over."""
    for status in (0, 137):
        result = await sbx.run(f"exit {status}", 10)
        assert result.exit_code == status and "shell exited" in result.output
        after = await sbx.run("echo ok", 10)
        assert after.exit_code == 0 and after.output.startswith("ok\n") and "new shell" in after.output
    assert (await sbx.exec(["echo", "ok"], 10)).output == "ok\n"


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


# -- locating Apptainer -------------------------------------------------------------------------------------------


def test_find_apptainer(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, installed: str) -> None:  # noqa: F811
    assert find_apptainer() == installed
    monkeypatch.setenv(apptainer_binary.APPTAINER_ENV, str(tmp_path / "nothing"))
    with pytest.raises(SandboxError, match="not an executable"):
        find_apptainer()
    monkeypatch.delenv(apptainer_binary.APPTAINER_ENV)
    monkeypatch.delenv(apptainer_binary.PREFIX_ENV, raising=False)
    monkeypatch.setattr(apptainer_binary, "_REPO", tmp_path)
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(SandboxError, match=r"apptainer is not installed: run .*scripts/install_apptainer\.sh"):
        find_apptainer()
