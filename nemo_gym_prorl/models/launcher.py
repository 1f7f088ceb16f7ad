"""Start the embedded model server as a child process and stop it, whatever happens."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from pathlib import Path
from types import TracebackType
from typing import Self

from pydantic import BaseModel

from nemo_gym_prorl.child_lifetime import ends_with_parent
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


class ModelServerProcess:
    """A model server child process that prints ``PRORL_MODEL_SERVER_READY <port>`` when it accepts requests.
    ``async with ModelServerProcess(argv) as server: server.base_url`` — the process group is gone on exit."""

    def __init__(self, argv: list[str], host: str = "127.0.0.1", startup_timeout_s: float = 120.0) -> None:
        self.argv = argv
        self.host = host
        self.startup_timeout_s = startup_timeout_s
        self.base_url = ""
        self.pid: int | None = None
        self._process: asyncio.subprocess.Process | None = None

    async def __aenter__(self) -> Self:
        self._process = await asyncio.create_subprocess_exec(
            *self.argv, stdout=asyncio.subprocess.PIPE, start_new_session=True,
            preexec_fn=ends_with_parent(signal.SIGTERM),
        )  # fmt: skip
        self.pid = self._process.pid
        try:
            port = await asyncio.wait_for(self._ready_port(), self.startup_timeout_s)
        except BaseException:
            await self.stop()
            raise
        self.base_url = f"http://{self.host}:{port}/v1"
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


class LocalModelServer(ModelServerProcess):
    """The embedded llama.cpp server (`nemo_gym_prorl.models.server`) as configured."""

    def __init__(self, config: LocalModelConfig) -> None:
        super().__init__(config.argv(), config.host, config.startup_timeout_s)
        self.config = config
