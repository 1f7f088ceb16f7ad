"""Sandboxes: the contract (`base`) and a registry of backends, opened by name."""

from __future__ import annotations

from collections.abc import Callable

from nemo_gym_prorl.contracts.sandbox import (
    WORKSPACE,
    ExecResult,
    Sandbox,
    SandboxError,
    SandboxLimits,
    SandboxSpec,
)
from nemo_gym_prorl.sandbox.apptainer import ApptainerSandbox
from nemo_gym_prorl.sandbox.bwrap import BwrapSandbox

__all__ = [
    "WORKSPACE",
    "BwrapSandbox",
    "ExecResult",
    "Sandbox",
    "SandboxError",
    "SandboxLimits",
    "SandboxSpec",
    "backend_forks",
    "backends",
    "open_sandbox",
    "register_backend",
]

_BACKENDS: dict[str, Callable[[SandboxSpec], Sandbox]] = {"bwrap": BwrapSandbox}


def register_backend(name: str, factory: Callable[[SandboxSpec], Sandbox]) -> None:
    """Make `factory` available to `open_sandbox` under `name` (other backends register themselves here)."""
    _BACKENDS[name] = factory


register_backend("apptainer", ApptainerSandbox)


def backends() -> list[str]:
    """The names `open_sandbox` takes (besides ``gym:<provider>``), in registration order."""
    return list(_BACKENDS)


def backend_forks(backend: str) -> bool:
    """Whether `backend`'s sandboxes fork (``Sandbox.fork``, copy-on-write: GRPO group forking); Gym's providers
    (``gym:<provider>``) do not."""
    return callable(getattr(_BACKENDS.get(backend), "fork", None))


def open_sandbox(backend: str, spec: SandboxSpec) -> Sandbox:
    """A new, not yet started sandbox of `backend`; use it as `async with open_sandbox(...) as sbx:`.
    ``gym:<provider>`` runs on one of NeMo Gym's own sandbox providers (e.g. ``gym:local``)."""
    if backend.startswith("gym:"):
        from nemo_gym_prorl.sandbox.gym_provider import GymProviderSandbox

        return GymProviderSandbox(spec, backend.removeprefix("gym:"))
    try:
        factory = _BACKENDS[backend]
    except KeyError:
        raise ValueError(f"unknown sandbox backend {backend!r}; known: {', '.join(sorted(_BACKENDS))}") from None
    return factory(spec)
