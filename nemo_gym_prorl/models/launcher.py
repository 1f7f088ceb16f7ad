"""Start the embedded model server as a child process and stop it, whatever happens."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from pathlib import Path
from types import TracebackType

from pydantic import BaseModel

from nemo_gym_prorl.models.server import READY_LINE


class LocalModelConfig(BaseModel):
    gguf: Path | None = None
    served_model_name: str = "smollm2-135m-instruct"
    host: str = "127.0.0.1"
    port: int = 0
    n_ctx: int = 8192
    n_threads: int | None = None
    n_engines: int = 1
    logprobs_mode: str = "raw_logprobs"
    startup_timeout_s: float = 120.0

    def argv(self) -> list[str]:
        args = [sys.executable, "-m", "nemo_gym_prorl.models.server"]
        args += ["--served-model-name", self.served_model_name, "--host", self.host, "--port", str(self.port)]
        args += ["--n-ctx", str(self.n_ctx), "--n-engines", str(self.n_engines), "--logprobs-mode", self.logprobs_mode]
        if self.gguf is not None:
            args += ["--gguf", str(self.gguf)]
        if self.n_threads is not None:
            args += ["--n-threads", str(self.n_threads)]
        return args


class LocalModelServer:
    """``async with LocalModelServer(config) as server: server.base_url`` — the process is gone on exit."""

    def __init__(self, config: LocalModelConfig) -> None:
        self.config = config
        self.base_url = ""
        self._process: asyncio.subprocess.Process | None = None

    async def __aenter__(self) -> LocalModelServer:
        self._process = await asyncio.create_subprocess_exec(
            *self.config.argv(), stdout=asyncio.subprocess.PIPE, start_new_session=True
        )
        try:
            port = await asyncio.wait_for(self._ready_port(), self.config.startup_timeout_s)
        except BaseException:
            await self.stop()
            raise
        self.base_url = f"http://{self.config.host}:{port}/v1"
        return self

    async def _ready_port(self) -> int:
        assert self._process is not None and self._process.stdout is not None
        async for raw in self._process.stdout:
            line = raw.decode(errors="replace").strip()
            if line.startswith(READY_LINE):
                return int(line.split()[1])
        code = await self._process.wait()
        raise RuntimeError(f"the local model server exited with code {code} before it was ready")

    async def stop(self) -> None:
        process, self._process = self._process, None
        if process is None or process.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            await asyncio.wait_for(process.wait(), 10)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            await process.wait()

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.stop()
