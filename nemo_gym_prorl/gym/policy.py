"""The training policy's model servers, as NeMo RL hands them to Gym, registered with our rollout service.

NeMo RL writes into Gym's global config ``policy_base_url`` (a list: one ``http://<ip>:<port>/v1`` per vLLM data-
parallel rank, possibly not listening yet when Gym starts), ``policy_model_name`` (requests must carry it as
``model``) and ``policy_api_key``. Our agents register those servers with the service on their first ``/run`` —
once, under a lock, and again only if registering failed — so every turn of every rollout goes to the policy being
trained, under its name. Registering is idempotent on the service's side too (an address present is updated).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf
from pydantic import BaseModel, Field

BASE_URL_KEY = "policy_base_url"
MODEL_NAME_KEY = "policy_model_name"
API_KEY_KEY = "policy_api_key"


class PolicyBackends(BaseModel):
    """The body of the service's ``POST /add_llm_server`` for the policy's servers."""

    addresses: list[str] = Field(min_length=1)
    model: str
    api_key: str | None = None
    replace: bool = Field(True, description="remove the service's other backends (they do not serve this policy)")


def policy_backends(global_config: Mapping[str, Any] | DictConfig, replace: bool = True) -> PolicyBackends | None:
    """The policy's servers named in Gym's global config; None when it names none (Gym run without a trainer)."""
    urls = global_config.get(BASE_URL_KEY)
    if not urls:
        return None
    if isinstance(urls, ListConfig):
        urls = OmegaConf.to_container(urls, resolve=True)
    addresses = [urls] if isinstance(urls, str) else [str(u) for u in urls if u]
    model = global_config.get(MODEL_NAME_KEY)
    if not model:
        raise ValueError(f"Gym's global config has {BASE_URL_KEY} but no {MODEL_NAME_KEY}: the policy's servers "
                         "answer only requests that name their model")  # fmt: skip
    key = global_config.get(API_KEY_KEY)
    return PolicyBackends(addresses=addresses, model=str(model), api_key=str(key) if key else None, replace=replace)


class PolicyRegistration:
    """``await registration.ensure()`` before each rollout: the first call registers, the others return at once."""

    def __init__(self, backends: PolicyBackends | None, register: Callable[[PolicyBackends], Awaitable[None]]) -> None:
        self.backends = backends
        self._register = register
        self._lock = asyncio.Lock()
        self.registered = backends is None

    async def ensure(self) -> None:
        if self.registered:
            return
        async with self._lock:
            if not self.registered:
                assert self.backends is not None
                await self._register(self.backends)  # raises: the next /run tries again
                self.registered = True
