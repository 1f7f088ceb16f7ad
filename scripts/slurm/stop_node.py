"""Stop this node's Ray nodes at once and remove what their rollout workers' sandboxes left on the node.

    stop_node.py PID...    (ray_node.sh: the `ray start --block` processes it started)

A scancel sends SIGTERM to every process of the job at the same moment and SIGKILL after Slurm's KillWait; Ray's
raylet takes up to 30 s to drain, and a rollout worker that dies holding sandboxes leaves their disks mounted on the
host and their temp dirs and cgroups behind (their processes die with it: `--die-with-parent`, Apptainer's
watchdog). So: SIGKILL the given processes and everything under them, wait until they are gone, then

1. the sandboxes' own orphan sweeps, which touch only sandboxes whose owner process is dead (bwrap's
   `sweep_orphans`, and `reap_orphan_instances` when SANDBOX=apptainer), in the job's TMPDIR;
2. the job's folder (PRORL_JOB_DIR, which holds that TMPDIR): every mount still below it is unmounted, the cgroups
   of the sandbox dirs the sweeps left there are removed, and the folder goes. No other job uses it, and none of this
   job's processes on this node is left, so nothing there is in use; this catches a sandbox whose worker died in the
   middle of closing it (its owner record gone, its disk mounted, its cgroups still there).
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import psutil

from nemo_gym_prorl.sandbox import disk
from nemo_gym_prorl.sandbox.bwrap import TEMP_PREFIX, sweep_orphans
from nemo_gym_prorl.sandbox.limits import SandboxCgroup, own_cgroup_dirs


def kill_trees(pids: list[int], timeout_s: float = 10.0) -> None:
    processes = []
    for pid in pids:
        try:
            root = psutil.Process(pid)
            processes += [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            continue
    for process in processes:
        try:
            process.kill()
        except psutil.NoSuchProcess:
            continue
    psutil.wait_procs(processes, timeout=timeout_s)


def remove_job_dir(job_dir: Path) -> tuple[list[str], list[str]]:
    """Remove the cgroups of the sandbox dirs the sweeps did not take (no owner record), unmount everything below the
    job's folder and remove it; returns those dirs' names and the mount points."""
    if not job_dir.exists():
        return [], []
    unswept = sorted(entry.name for entry in Path(os.environ.get("TMPDIR", job_dir / "tmp")).glob("prorl-*"))
    for name in [name for name in unswept if name.startswith(TEMP_PREFIX)]:
        # a bwrap sandbox's cgroups are named as its dir, under its maker's cgroup: this step's
        cgroup = SandboxCgroup({c: os.path.join(parent, name) for c, parent in own_cgroup_dirs().items()})
        cgroup.kill()
        cgroup.remove_now()
    mounts = disk.unmount_under(job_dir)
    shutil.rmtree(job_dir, ignore_errors=True)
    return unswept, mounts


def main(argv: list[str]) -> None:
    kill_trees([int(pid) for pid in argv])
    job_dir = Path(os.environ["PRORL_JOB_DIR"])
    swept = sweep_orphans() if job_dir.exists() else []  # gone: another Slurm node on this host stopped first
    if os.environ.get("SANDBOX") == "apptainer":
        from nemo_gym_prorl.sandbox.apptainer import reap_orphan_instances

        swept += reap_orphan_instances()
    unswept, mounts = remove_job_dir(job_dir)
    print(f"stop_node.py: swept {len(swept)} sandboxes left by this node's workers", file=sys.stderr)
    if unswept or mounts:
        print(f"stop_node.py: the sweeps left {unswept} (and their cgroups) and {len(mounts)} mounts: removed",
              file=sys.stderr)


if __name__ == "__main__":
    main(sys.argv[1:])
