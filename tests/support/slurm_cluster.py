"""A real Slurm cluster on this host for a test: Debian's munged, slurmctld and one slurmd per node (``node1``,
``node2``, ...: all this machine, each on a port of its own) started from a generated slurm.conf in a temp dir, on
free ports, and stopped (with every job cancelled) at the end.

Nothing of the host's Slurm or munge set-up is used or changed: the key, the munge socket, the state and spool
dirs, pid and log files all live under the cluster's folder, and the client commands find it through
``SLURM_CONF`` in ``cluster.env``. Jobs are tracked by process tree (``proctrack/linuxproc``): no cgroups needed.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psutil


class SlurmError(RuntimeError):
    """The cluster did not come up, or a Slurm command failed; the message carries the daemons' last log lines."""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _tail(paths: list[Path], lines: int = 15) -> str:
    for path in paths:
        if path.exists():
            return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    return "(no log)"


class SlurmCluster:
    """munged + slurmctld + a slurmd per node (``nodes`` of them on this host, ``cpus`` CPUs each), all under
    ``root``."""

    def __init__(self, root: Path, nodes: int = 1, cpus: int | None = None, kill_wait_s: int = 10) -> None:
        self.root = root
        self.host = socket.gethostname()
        self.nodes = [f"node{i}" for i in range(1, nodes + 1)]
        self.cpus = cpus or os.cpu_count() or 1
        self.kill_wait_s = kill_wait_s
        self.conf = root / "slurm.conf"
        self.munge_socket = root / "munge" / "munge.socket"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        self._daemons: dict[str, subprocess.Popen[bytes]] = {}

    # --- set-up -------------------------------------------------------------------------------------------

    def _write_files(self) -> None:
        for sub in ("munge", "state", "spool", "log"):
            (self.root / sub).mkdir(mode=0o700, parents=True, exist_ok=True)
        key = self.root / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        memory_mb = psutil.virtual_memory().total // 2**20 // 2
        self.conf.write_text(
            f"""\
ClusterName=prorltest
SlurmctldHost={self.host}(127.0.0.1)
SlurmctldPort={free_port()}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={self.munge_socket}
CredType=cred/munge
StateSaveLocation={self.root / "state"}
SlurmdSpoolDir={self.root / "spool"}/%n
SlurmctldPidFile={self.root / "slurmctld.pid"}
SlurmdPidFile={self.root}/slurmd-%n.pid
SlurmctldLogFile={self.root / "log" / "slurmctld.log"}
SlurmdLogFile={self.root}/log/slurmd-%n.log
PlugStackConfig={self.root / "plugstack.conf"}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
KillWait={self.kill_wait_s}
MinJobAge=300
"""
            + "".join(
                f"NodeName={node} NodeHostname={self.host} NodeAddr=127.0.0.1 Port={free_port()} CPUs={self.cpus} "
                f"RealMemory={memory_mb} State=UNKNOWN\n"
                for node in self.nodes
            )
            + f"PartitionName=debug Nodes={','.join(self.nodes)} Default=YES MaxTime=INFINITE State=UP "
            "OverSubscribe=FORCE:4\n"
        )
        for node in self.nodes:
            (self.root / "spool" / node).mkdir(mode=0o700)
        (self.root / "plugstack.conf").write_text("")

    def _start(self, name: str, argv: list[str]) -> None:
        log = open(self.root / "log" / f"{name}.out", "wb")
        self._daemons[name] = subprocess.Popen(
            argv, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        log.close()

    def _wait(self, what: str, ready, timeout_s: float = 60) -> None:
        deadline = time.monotonic() + timeout_s
        while not ready():
            for name, process in self._daemons.items():
                if process.poll() is not None:
                    raise SlurmError(f"{name} exited ({process.returncode}) before {what}:\n{self.logs()}")
            if time.monotonic() > deadline:
                raise SlurmError(f"timed out waiting for {what}:\n{self.logs()}")
            time.sleep(0.2)

    def start(self) -> None:
        self._write_files()
        munge_dir = self.root / "munge"
        self._start("munged", [
            "munged", "--foreground", "--force", f"--socket={self.munge_socket}",
            f"--key-file={munge_dir / 'munge.key'}", f"--pid-file={munge_dir / 'munged.pid'}",
            f"--log-file={self.root / 'log' / 'munged.log'}", f"--seed-file={munge_dir / 'munged.seed'}",
        ])
        self._wait("munged's socket", self.munge_socket.exists)
        self._start("slurmctld", ["slurmctld", "-D", "-i", "-f", str(self.conf)])
        self._wait("slurmctld", lambda: self._run_ok("scontrol", "ping"))
        for node in self.nodes:
            self._start(f"slurmd-{node}", ["slurmd", "-D", "-N", node, "-f", str(self.conf)])
        self._wait("the nodes to be idle", lambda: self.node_states() == ["IDLE"] * len(self.nodes))

    def stop(self) -> None:
        """Cancel every job, wait until none is left, then stop the daemons (the slurmds first, munged last)."""
        if "slurmctld" in self._daemons and self._daemons["slurmctld"].poll() is None:
            self._run_ok("scancel", "--full", "--partition=debug")
            deadline = time.monotonic() + 3 * self.kill_wait_s + 30
            while self.jobs() and time.monotonic() < deadline:
                time.sleep(0.5)
        for name in [*(f"slurmd-{node}" for node in self.nodes), "slurmctld", "munged"]:
            process = self._daemons.pop(name, None)
            if process is None:
                continue
            process.terminate()
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()

    # --- commands -----------------------------------------------------------------------------------------

    def run(self, *argv: str, timeout_s: float = 60) -> str:
        done = subprocess.run(argv, env=self.env, capture_output=True, text=True, timeout=timeout_s)
        if done.returncode != 0:
            raise SlurmError(f"{' '.join(argv)} failed ({done.returncode}): {done.stderr.strip()}\n{self.logs()}")
        return done.stdout

    def _run_ok(self, *argv: str) -> bool:
        try:
            return subprocess.run(argv, env=self.env, capture_output=True, timeout=30).returncode == 0
        except subprocess.TimeoutExpired:
            return False

    def node_states(self) -> list[str]:
        try:
            return self.run("sinfo", "--noheader", "--Node", "--format=%T").upper().split()
        except SlurmError:
            return []

    def sbatch(self, script: Path, *options: str, env: dict[str, str] | None = None) -> str:
        """Submit ``script``; return the job id."""
        done = subprocess.run(
            ["sbatch", "--parsable", *options, str(script)],
            env={**self.env, **(env or {})}, capture_output=True, text=True, timeout=60,
        )
        if done.returncode != 0:
            raise SlurmError(f"sbatch failed: {done.stderr.strip()}\n{self.logs()}")
        return done.stdout.strip().split(";")[0]

    def job_state(self, job_id: str) -> str:
        text = self.run("scontrol", "show", "job", job_id)
        match = re.search(r"JobState=(\S+)", text)
        return match.group(1) if match else "UNKNOWN"

    def cancel(self, job_id: str) -> None:
        """``scancel`` the job (nothing happens to one that has ended already)."""
        self._run_ok("scancel", job_id)

    def wait_ended(self, job_id: str, timeout_s: float = 120) -> str:
        """The job's final state (COMPLETED, CANCELLED, FAILED, ...), once it is no longer pending, running or
        completing."""
        deadline = time.monotonic() + timeout_s
        while (state := self.job_state(job_id)) in ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING"):
            if time.monotonic() > deadline:
                raise SlurmError(f"job {job_id} still {state} after {timeout_s} s")
            time.sleep(0.5)
        return state

    def job_processes(self) -> list[psutil.Process]:
        """Every live process of this cluster's jobs: slurmstepd and all it starts inherit ``SLURM_CONF`` naming this
        cluster's slurm.conf (whatever their parent is now: daemonised processes included), and their descendants
        (those that cleared their environment: a sandbox's own processes); the daemons and their helpers excluded."""
        daemons = {process.pid for process in self._daemons.values()}
        for process in self._daemons.values():  # and their own helpers (slurmctld's slurmscriptd)
            try:
                daemons.update(child.pid for child in psutil.Process(process.pid).children(recursive=True))
            except psutil.Error:
                continue
        marker = f"SLURM_CONF={self.conf}".encode()
        found = []
        for process in psutil.process_iter():
            if process.pid in daemons:
                continue
            try:
                with open(f"/proc/{process.pid}/environ", "rb") as environ:
                    if marker in environ.read().split(b"\0"):
                        found.append(process)
            except OSError:  # gone meanwhile, or a kernel thread
                continue
        for process in list(found):
            try:
                found.extend(child for child in process.children(recursive=True) if child not in found)
            except psutil.Error:
                continue
        return found

    @staticmethod
    def node_of(process: psutil.Process) -> str | None:
        """The Slurm node a job's process was started on (``SLURMD_NODENAME`` in its environment)."""
        try:
            return process.environ().get("SLURMD_NODENAME")
        except psutil.Error:
            return None

    def jobs(self) -> list[str]:
        """Ids of jobs not yet finished (pending, running, completing)."""
        try:
            return self.run("squeue", "--noheader", "--format=%i").split()
        except SlurmError:
            return []

    def logs(self) -> str:
        log = self.root / "log"
        return "\n".join(f"--- {name}:\n{_tail([log / f'{name}.log', log / f'{name}.out'])}" for name in self._daemons)


@contextmanager
def slurm_cluster(root: Path, nodes: int = 1, cpus: int | None = None) -> Iterator[SlurmCluster]:
    missing = [name for name in ("munged", "slurmctld", "slurmd", "sbatch") if shutil.which(name) is None]
    if missing:
        raise SlurmError(f"Slurm is not installed ({', '.join(missing)} missing): apt-get install slurm-wlm munge")
    cluster = SlurmCluster(root, nodes, cpus)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
