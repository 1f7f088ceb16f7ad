"""Start the embedded model server as a child process and stop it, whatever happens.

The child's stderr goes to the ``nemo_gym_prorl.models.server`` logger: at INFO until the server is ready (model
loading chatter; `prorl` keeps it in the run's log file), at WARNING after (a server that breaks while serving is
worth seeing). A server that dies before it is ready raises `ModelServerError` naming the last line it wrote.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import signal
import sys
import threading
from pathlib import Path
from types import TracebackType
from typing import Literal, Self

from pydantic import BaseModel

from nemo_gym_prorl.child_lifetime import ends_with_parent
from nemo_gym_prorl.models.server import READY_LINE

log = logging.getLogger("nemo_gym_prorl.models.server")


class ModelServerError(RuntimeError):
    """The model server could not be started; the message names why and what to do."""


class LocalModelConfig(BaseModel):
    gguf: Path | None = None
    served_model_name: str = "smollm2-135m-instruct"
    host: str = "127.0.0.1"
    port: int = 0
    n_ctx: int = 8192
    n_threads: int | None = None
    n_engines: int = 1
    logprobs_mode: str = "raw_logprobs"
    kv_cache_type: Literal["f16", "f32"] = "f16"  # f32 for a policy whose log-probs must match its trainer's
    policy_version: int | None = None  # stamped on every generation; POST /policy/load changes it
    startup_timeout_s: float = 120.0

    def argv(self) -> list[str]:
        args = [sys.executable, "-m", "nemo_gym_prorl.models.server"]
        args += ["--served-model-name", self.served_model_name, "--host", self.host, "--port", str(self.port)]
        args += ["--n-ctx", str(self.n_ctx), "--n-engines", str(self.n_engines), "--logprobs-mode", self.logprobs_mode]
        if self.gguf is not None:
            args += ["--gguf", str(self.gguf)]
        if self.n_threads is not None:
            args += ["--n-threads", str(self.n_threads)]
        if self.kv_cache_type != "f16":
            args += ["--kv-cache-type", self.kv_cache_type]
        if self.policy_version is not None:
            args += ["--policy-version", str(self.policy_version)]
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
        self._stderr_tail: collections.deque[str] = collections.deque(maxlen=20)
        self._ready = False
        self._stderr_reader: threading.Thread | None = None

    async def __aenter__(self) -> Self:
        read_end, write_end = os.pipe()
        try:
            self._process = await asyncio.create_subprocess_exec(
                *self.argv, stdout=asyncio.subprocess.PIPE, stderr=write_end, start_new_session=True,
                preexec_fn=ends_with_parent(signal.SIGTERM),
            )  # fmt: skip
        except BaseException:
            os.close(read_end)
            raise
        finally:
            os.close(write_end)
        self.pid = self._process.pid
        self._stderr_reader = threading.Thread(
            target=self._read_stderr, args=(read_end,), name=f"model-server-{self.pid}-stderr", daemon=True
        )
        self._stderr_reader.start()
        try:
            port = await asyncio.wait_for(self._ready_port(), self.startup_timeout_s)
        except TimeoutError:
            await self.stop()
            raise ModelServerError(
                f"the model server was not ready within {self.startup_timeout_s:g} s{self._last_words()}"
            ) from None
        except BaseException:
            await self.stop()
            raise
        self.base_url = f"http://{self.host}:{port}/v1"
        self._ready = True
        return self

    def _read_stderr(self, read_end: int) -> None:
        """Drain the child's stderr until it closes, keeping the last lines. A thread, not a task: the event loop
        that started the server may not run while it serves (a test fixture's), and a full pipe would block it."""
        with open(read_end, "rb") as pipe:
            for raw in pipe:
                line = raw.decode(errors="replace").rstrip()
                if line:
                    self._stderr_tail.append(line)
                    log.log(logging.WARNING if self._ready else logging.INFO, "%s", line)

    def _last_words(self) -> str:
        return f": {self._stderr_tail[-1]}" if self._stderr_tail else ""

    async def _ready_port(self) -> int:
        assert self._process is not None and self._process.stdout is not None
        async for raw in self._process.stdout:
            line = raw.decode(errors="replace").strip()
            if line.startswith(READY_LINE):
                return int(line.split()[1])
        code = await self._process.wait()
        if self._stderr_reader is not None:  # its last lines say why
            await asyncio.to_thread(self._stderr_reader.join, 5)
        raise ModelServerError(f"the model server exited with code {code} before it was ready{self._last_words()}")

    async def stop(self) -> None:
        process, self._process = self._process, None
        self._ready = False  # what it says while being stopped is for the log file
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

    async def __aenter__(self) -> Self:
        check_gguf(self.config)
        return await super().__aenter__()


def check_gguf(config: LocalModelConfig) -> None:
    """A GGUF path that is not a file fails here, in one line, rather than in the server process."""
    if config.gguf is not None and not config.gguf.is_file():
        raise ModelServerError(
            f"model.gguf={config.gguf} is not a file: give the path of a GGUF model, "
            "or leave model.gguf unset for the embedded SmolLM2-135M-Instruct"
        )
