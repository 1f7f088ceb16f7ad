"""Schemathesis fuzzes the service from its own OpenAPI document: no request, however odd, gets a 5xx."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from service_helpers import service

from nemo_gym_prorl.agent.llm_pool import LLMPoolConfig

# /stop and /llm/pause hold back every later rollout until resumed (tested in test_service.py); fuzzing them
# would only make the other calls wait.
EXCLUDED = ["/stop", "/llm/pause"]


async def test_no_request_gets_a_server_error(instant_model: str, tmp_path: Path) -> None:
    pool = LLMPoolConfig(wait_for_backend_s=1.0, health_interval_s=0)
    async with service(instant_model, tmp_path, llm_pool=pool, max_n=4) as svc:
        argv = [
            sys.executable, "-m", "schemathesis.cli", "run", f"{svc.url}/openapi.json",
            "--checks", "not_a_server_error", "--max-examples", "15", "--seed", "1",
            "--request-timeout", "120", "--generation-deterministic",
            *[arg for path in EXCLUDED for arg in ("--exclude-path", path)],
        ]
        process = await asyncio.create_subprocess_exec(
            *argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, cwd=tmp_path  # it writes .schemathesis/
        )
        output, _ = await asyncio.wait_for(process.communicate(), 600)
    report = output.decode(errors="replace")
    assert process.returncode == 0, report[-4000:]
    assert " passed" in report and "failed" not in report.split("=====")[-1], report[-4000:]
