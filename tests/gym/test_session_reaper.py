"""The watchdog beside a `gym env start` session: told its parent died (SIGTERM, the parent-death signal), it
gives the session a grace period, then kills whatever of it is left, such as a server that ignored gym's SIGINT."""

from __future__ import annotations

import signal
import subprocess
import sys

import psutil

from nemo_gym_prorl.gym.session_reaper import block_sigterm


def test_after_the_parent_death_signal_what_is_left_of_the_session_is_killed() -> None:
    stubborn = subprocess.Popen(  # a session leader and a child of it, both deaf to SIGINT
        [sys.executable, "-c", "import signal, subprocess, time; signal.signal(signal.SIGINT, signal.SIG_IGN); "
         "subprocess.Popen(['sleep', '600']); time.sleep(600)"],
        start_new_session=True,
    )  # fmt: skip
    try:
        leader = psutil.Process(stubborn.pid)
        while not leader.children():
            pass  # its child is started within milliseconds
        session = [leader, *leader.children()]
        argv = [sys.executable, "-m", "nemo_gym_prorl.gym.session_reaper", str(stubborn.pid), "0.5"]
        reaper = subprocess.Popen(argv, preexec_fn=block_sigterm)  # as gym_env_start starts it
        reaper.send_signal(signal.SIGTERM)
        assert reaper.wait(timeout=30) == 0
        gone, alive = psutil.wait_procs(session, timeout=10)
        assert alive == [] and next(p for p in gone if p.pid == stubborn.pid).returncode == -signal.SIGKILL
    finally:
        stubborn.kill()


def test_with_no_session_left_to_watch_it_exits_by_itself() -> None:
    ended = subprocess.Popen(["true"], start_new_session=True)
    ended.wait()
    reaper = subprocess.run([sys.executable, "-m", "nemo_gym_prorl.gym.session_reaper", str(ended.pid), "5"], timeout=30)
    assert reaper.returncode == 0
