"""A model server told to stop while it generates stops within seconds, cutting the generation (a SIGTERM, or the
death signal its parent's death sends it): before, it ran every generation in flight to its end first, and one whose
parent was killed kept a core busy for minutes."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import httpx
import psutil

from nemo_gym_prorl.models.launcher import LocalModelConfig, LocalModelServer


async def test_sigterm_mid_generation_stops_the_server_within_seconds():
    server = LocalModelServer(LocalModelConfig(n_ctx=4096))
    async with server, httpx.AsyncClient(timeout=300) as http:
        # greedy counting: thousands of tokens without an end-of-generation token (a minute or more here)
        body = {"prompt": ", ".join(str(i) for i in range(1, 40)) + ",", "max_tokens": 3500, "temperature": 0.0}
        generating = asyncio.create_task(http.post(server.base_url + "/completions", json=body))
        assert server._process is not None
        process, tracked = server._process, psutil.Process(server._process.pid)
        busy_from = sum(tracked.cpu_times()[:2])
        deadline = time.monotonic() + 60
        while sum(tracked.cpu_times()[:2]) - busy_from < 1.0:  # a CPU-second spent: the generation is running
            assert time.monotonic() < deadline, "the server never started generating"
            await asyncio.sleep(0.05)
        os.kill(process.pid, signal.SIGTERM)
        stopped = time.monotonic()
        await asyncio.wait_for(process.wait(), 30)
        took = time.monotonic() - stopped
        generating.cancel()
        assert took < 8, f"the server ran {took:.1f} s after SIGTERM"
