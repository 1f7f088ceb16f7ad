"""The trainer's current weights, serving every rollout turn: our llama.cpp model server over an unquantized F32
GGUF of the torch model, its KV cache in f32, so the log-prob it returns for a token is the trainer's own.

`publish` writes the weights after an optimizer step and loads them into the running server, which from then on
stamps every generation with their version (`policy_version`). The caller pauses the service's LLM pool around it,
so no turn is generated while the weights change (in synchronous training none is in flight then anyway).
Why llama.cpp rather than generating with the torch model itself: docs/training.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from pathlib import Path
from types import TracebackType
from typing import Any, Self

import httpx

from nemo_gym_prorl.models.launcher import LocalModelConfig, LocalModelServer
from nemo_gym_prorl.train.policy_gguf import write_policy_gguf

log = logging.getLogger(__name__)


class PolicyLoadError(RuntimeError):
    """The model server did not take the new weights."""


class LivePolicy:
    """``async with LivePolicy(source_gguf, folder, server, model, version) as policy: policy.base_url``."""

    def __init__(self, source_gguf: Path, folder: Path, server: LocalModelConfig, model: Any, version: int) -> None:
        self.source_gguf = source_gguf
        self.folder = folder
        self.server_config = server
        self.model = model
        self.version = version
        self._server: LocalModelServer | None = None
        self._gguf: Path | None = None
        self._http = httpx.AsyncClient(timeout=httpx.Timeout(30.0, read=600.0), trust_env=False)
        self.publish_s: list[float] = []  # seconds each publish took (write + load)

    @property
    def base_url(self) -> str:
        assert self._server is not None, "the policy server is not running"
        return self._server.base_url

    async def _write(self, version: int) -> Path:
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.folder / f"policy-{version:06d}.gguf"
        await asyncio.to_thread(write_policy_gguf, self.model, self.source_gguf, path)
        return path

    async def __aenter__(self) -> Self:
        self._gguf = await self._write(self.version)
        config = self.server_config.model_copy(update={"gguf": self._gguf, "policy_version": self.version})
        self._server = LocalModelServer(config)
        try:
            await self._server.__aenter__()
        except BaseException:
            self._server = None
            self._remove_files()
            raise
        return self

    async def publish(self, version: int) -> None:
        """Load the model's current weights into the server as `version`."""
        started = time.perf_counter()
        path = await self._write(version)
        root = self.base_url.removesuffix("/v1")
        response = await self._http.post(f"{root}/policy/load", json={"gguf": str(path), "version": version})
        if response.status_code != 200:
            path.unlink(missing_ok=True)
            raise PolicyLoadError(f"the policy server refused version {version}: HTTP {response.status_code} "
                                  f"{response.text[:500]}")  # fmt: skip
        previous, self._gguf, self.version = self._gguf, path, version
        if previous is not None and previous != path:
            previous.unlink(missing_ok=True)
        self.publish_s.append(time.perf_counter() - started)
        log.info("policy version %d serving (%.2f s to write and load)", version, self.publish_s[-1])

    def _remove_files(self) -> None:
        for stale in [*self.folder.glob("policy-*.gguf"), *self.folder.glob(".policy-*.tmp")]:  # and a cut write
            stale.unlink(missing_ok=True)

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        try:
            await self._http.aclose()
            if self._server is not None:
                await self._server.__aexit__(exc_type, exc, tb)
        finally:
            self._server = None
            with contextlib.suppress(OSError):
                self._remove_files()
