"""The bubblewrap backend as our users run it: rootless, as an ordinary user on an HPC node. No `setpriv`, no
cgroups (only rlimits bound the sandbox), unprivileged user namespaces for bwrap and for a fork's overlay.

As root (CI here), a script runs the sandbox as an unprivileged uid. Its interpreter may live where that uid
cannot reach (pyenv under a 0700 /root): the script then runs in a private mount namespace where that one
directory is a world-readable tmpfs holding, bound back in, just the subtree on the way to the interpreter. Run
by an ordinary user, the same script runs as that user.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

UNPRIVILEGED_UID = 4242

FORKS = """
import os, signal
children = []
try:
    while len(children) < 200:
        pid = os.fork()
        if pid == 0:
            signal.pause()
        children.append(pid)
except OSError as e:
    print(len(children), e.errno)
for pid in children:
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
"""

SCRIPT = r'''
import asyncio, json, os, sys, tempfile
from nemo_gym_prorl.sandbox import BwrapSandbox, SandboxError, SandboxLimits, SandboxSpec

async def main():
    report = {"uid": os.getuid()}
    spec = SandboxSpec(limits=SandboxLimits(memory_mb=512, max_processes=40, cpu_time_s=20))
    sandbox = BwrapSandbox(spec)
    await sandbox.start()
    report["cgroup"] = sandbox.cgroup is not None
    report["id"] = (await sandbox.run("id -u; ulimit -u; ulimit -t", 10)).output
    report["escape"] = (await sandbox.run("ulimit -u 100000 2>&1; touch /etc/x 2>&1; ls /root 2>&1", 10)).output
    await sandbox.write_file("forks.py", sys.argv[1].encode())
    report["forks_made"] = (await sandbox.run("python3 forks.py", 30)).output
    await sandbox.run("echo base > f.txt; mkdir -p d/e; chmod 500 d", 10)
    report["exec"] = (await sandbox.exec(["cat", "f.txt"], 10)).output
    forks = await sandbox.fork(2, close=True)
    await forks[0].run("echo mine > f.txt; rm -rf e", 10)
    report["forks"] = [(await f.run("cat f.txt", 10)).output for f in forks]
    report["fork_exec"] = (await forks[1].exec(["cat", "f.txt"], 10)).output
    await forks[0].run("sleep 300 &", 10)
    (again,) = await forks[0].fork(1)  # its processes stopped (no freezer cgroup rootless) while it is copied
    report["fork_again"] = (await again.run("cat f.txt", 10)).output + (await forks[0].run("jobs -r", 10)).output
    await again.close()
    init = open(f"/proc/{forks[1].pid}/task/{forks[1].pid}/children").read().split()[0]
    os.kill(int(init), 9)
    try:
        await forks[1].run("true", 10)
        report["killed"] = "not noticed"
    except SandboxError as e:
        report["killed"] = str(e)
    for fork in forks:
        await fork.close()
    report["left"] = sorted(os.listdir(tempfile.gettempdir()))
    print(json.dumps(report))

asyncio.run(main())
'''


def reachable_interpreter_argv(keep: Path) -> list[str]:
    """Where the interpreter's path crosses a directory other users cannot enter: `unshare` commands that show
    that directory, in a private mount namespace, as a tmpfs holding only the subtree on the way (held meanwhile
    at `keep`, an empty directory)."""
    path = Path(os.path.realpath(sys.executable))
    for parent in path.parents[::-1][1:]:
        if not os.stat(parent).st_mode & stat.S_IXOTH:
            child = path.parents[len(path.parents) - len(parent.parts) - 1]
            remount = (
                f"mount --bind {child} {keep} && mount -t tmpfs -o mode=755 prorl-test {parent} && "
                f"mkdir {child} && mount --bind {keep} {child} && "
                'exec "$@"'
            )
            return ["unshare", "--mount", "--propagation", "private", "sh", "-c", remount, "sh"]
    return []


@pytest.fixture
def unprivileged_tmp() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="prorl-test-rootless-"))
    if os.geteuid() == 0:
        os.chown(path, UNPRIVILEGED_UID, UNPRIVILEGED_UID)
    yield path
    subprocess.run(["rm", "-rf", str(path)], check=True)


def test_a_rootless_user_gets_the_same_sandbox(unprivileged_tmp: Path) -> None:
    argv = [sys.executable, "-I", "-c", SCRIPT, FORKS]
    env = {"PATH": os.environ["PATH"], "HOME": str(unprivileged_tmp), "TMPDIR": str(unprivileged_tmp)}
    with tempfile.TemporaryDirectory(prefix="prorl-test-keep-") as keep:
        if os.geteuid() == 0:
            drop = ["setpriv", f"--reuid={UNPRIVILEGED_UID}", f"--regid={UNPRIVILEGED_UID}", "--clear-groups", "--"]
            argv = [*reachable_interpreter_argv(Path(keep)), *drop, *argv]
        done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120, cwd=unprivileged_tmp)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.splitlines()[-1])
    assert report["uid"] != 0 and report["cgroup"] is False
    assert report["id"] == "1000\n40\n20\n"
    assert "cannot modify limit" in report["escape"] and "Read-only file system" in report["escape"]
    assert "No such file or directory" in report["escape"]  # no /root in the sandbox
    made, errno = report["forks_made"].split()
    assert int(made) < 40 and int(errno) == 11  # EAGAIN: the process limit held
    assert report["exec"] == "base\n" and report["forks"] == ["mine\n", "base\n"] and report["fork_exec"] == "base\n"
    assert report["fork_again"].startswith("mine\n") and "Running" in report["fork_again"]  # and it runs on
    assert report["killed"].startswith("the sandbox was killed")
    assert report["left"] == []  # every temp dir removed, overlay work dirs included
