"""`prorl serve` as a real process: killed with SIGKILL and restarted, nothing accepted is lost; `prorl rollout`
sends its jobs to it with `service.url`."""

from __future__ import annotations

import asyncio
import json
import signal
import sys
from pathlib import Path

import psutil
import pytest
from service_helpers import prorl_serve
from standin_helpers import ROW

from nemo_gym_prorl.contracts.job import JobRequest
from nemo_gym_prorl.service.client import RolloutClient


async def test_sigkill_loses_nothing_accepted(instant_model: str, slow_model: str, tmp_path: Path) -> None:
    store = tmp_path / "jobs.db"
    async with prorl_serve(slow_model, store) as (url, process):
        async with RolloutClient(url) as client:
            job_id = await client.submit(JobRequest(instance=ROW, n=2, job_id="accepted"))
            async with asyncio.timeout(60):  # both rollouts are live in sandboxes, waiting on the slow model
                while (await client.status())["stages"]["run"]["active"] < 2:
                    await asyncio.sleep(0.05)
        sandboxes = [p for p in psutil.Process(process.pid).children(recursive=True) if p.name() == "bwrap"]
        assert sandboxes
        process.kill()
        await process.wait()
        gone, alive = psutil.wait_procs(sandboxes, timeout=10)
        assert alive == []  # sandboxes die with the service
    async with prorl_serve(instant_model, store) as (url, _), RolloutClient(url) as client:
        view = await client.wait(job_id)
    assert view.state == "done" and [t.reward for t in view.results] == [1.0, 1.0]


async def test_prorl_rollout_sends_jobs_to_a_running_service(instant_model: str, tmp_path: Path) -> None:
    output = tmp_path / "rollouts.jsonl"
    async with prorl_serve(instant_model, tmp_path / "jobs.db") as (url, _):
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "nemo_gym_prorl.cli", "rollout", "task=math", f"service.url={url}", "limit=2",
            "n_samples=2",
            f"output={output}", stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )
        stdout, stderr = await asyncio.wait_for(process.communicate(), 300)
    assert process.returncode == 0, stderr.decode()[-2000:]
    rows = [json.loads(line) for line in output.read_text().splitlines()]
    assert len(rows) == 4 and all(row["critical_error"] is None for row in rows)
    assert "mean reward" in stdout.decode()
    # the service's count of turns, polled during the run, ends at this run's own turns
    turns = sum(1 for row in rows for m in row["messages"] if m["role"] == "assistant" and "generation_token_ids" in m)
    last_drawn = [line for line in stderr.decode().replace("\r", "\n").splitlines() if "turns=" in line][-1]
    assert f"turns={turns}," in last_drawn, last_drawn


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
async def test_a_stop_signal_closes_everything_then_exits_cleanly(
    instant_model: str, slow_model: str, tmp_path: Path, stop: signal.Signals
) -> None:
    """uvicorn re-raises the signal it stopped on; with the default SIGTERM that killed the service before it closed
    its sandboxes, model and pool (they only went because they die with it). Now the service closes them itself,
    exits 0, and the rollouts it cut short are run again after a restart. Ctrl-C does the same."""
    store = tmp_path / "jobs.db"
    async with prorl_serve(slow_model, store) as (url, process):
        async with RolloutClient(url) as client:
            job_id = await client.submit(JobRequest(instance=ROW, n=2, job_id="cut-short"))
            async with asyncio.timeout(60):
                while (await client.status())["stages"]["run"]["active"] < 2:
                    await asyncio.sleep(0.05)
        sandboxes = [p for p in psutil.Process(process.pid).children(recursive=True) if p.name() == "bwrap"]
        assert sandboxes
        process.send_signal(stop)
        assert await asyncio.wait_for(process.wait(), 60) == 0
        assert [p for p in sandboxes if p.is_running() and p.status() != psutil.STATUS_ZOMBIE] == []
        last = (await process.stdout.read()).decode().strip().splitlines()[-1]  # the user is told what was kept
        assert last.startswith(f"prorl serve: stopped; {store} keeps 1 job (0 done, 1 unfinished)"), last
        assert "will run their missing samples (service.recovery=requeue)" in last
    async with prorl_serve(instant_model, store) as (url, _), RolloutClient(url) as client:
        view = await client.wait(job_id)
    assert view.state == "done" and [t.reward for t in view.results] == [1.0, 1.0]
