"""Our sandbox backends as NeMo Gym sandbox providers, and every Gym provider registered as our ``gym:<name>``.

`ProrlProvider` (any backend `open_sandbox` knows) and `BwrapProvider` (bubblewrap) implement Gym's
`SandboxProvider` protocol and are published as the `nemo_gym.sandbox_providers` entry points `prorl` and `bwrap`.
`gym_apptainer_config()` is the config on which Gym's own `apptainer` provider runs here, with our Apptainer.

Design notes (how Gym's spec maps onto ours, what is refused): docs/nemo-gym.md#gymsandbox_providerspy
"""

from __future__ import annotations

import asyncio
import logging
import os
import posixpath
import secrets
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from functools import partial
from pathlib import Path, PurePosixPath
from typing import Any

from nemo_gym.sandbox import (
    SandboxCreateError,
    SandboxExecResult,
    SandboxHandle,
    SandboxStatus,
    list_providers,
)
from nemo_gym.sandbox import SandboxSpec as GymSandboxSpec

from nemo_gym_prorl.contracts.sandbox import (
    WORKSPACE,
    BindMount,
    Sandbox,
    SandboxError,
    SandboxLimits,
    SandboxSpec,
)
from nemo_gym_prorl.sandbox import open_sandbox, register_backend
from nemo_gym_prorl.sandbox.apptainer_binary import find_apptainer
from nemo_gym_prorl.sandbox.gym_provider import GymProviderSandbox

LOGGER = logging.getLogger(__name__)

RUNTIME_ERROR_CODE = 125
"""Gym's non-process return code: the sandbox could not run the command (timeout, sandbox failure)."""

# -- our backends as NeMo Gym providers ------------------------------------------------------------------------

# argv: bash -c SCRIPT gym-exec COMMAND CWD MARKER. stdout passes through; stderr goes to a temp file that is
# printed after MARKER, so the one stream our sandboxes capture can be split again.
_SPLIT_STDERR = """
err=$(mktemp) || exit 125
cd -- "$2" 2>"$err" && /bin/bash -c "$1" 2>>"$err" </dev/null
rc=$?
printf '\\n%s\\n' "$3"
cat -- "$err"
rm -f -- "$err"
exit "$rc"
"""


@dataclass
class _Running:
    sandbox: Sandbox
    workdir: str


class ProrlProvider:
    """A NeMo Gym sandbox provider over one of our backends (any name `open_sandbox` knows)."""

    name = "prorl"

    def __init__(
        self,
        backend: str = "bwrap",
        *,
        network: bool = False,
        limits: Mapping[str, Any] | None = None,
        binds: list[Mapping[str, Any]] | None = None,
        workspace: str = WORKSPACE,
        default_timeout_s: float = 180.0,
    ) -> None:
        self.backend = backend
        self._network = network
        self._workspace = workspace
        self._limits = SandboxLimits.model_validate(dict(limits or {}))
        self._binds = [BindMount.model_validate(dict(b)) for b in binds or []]
        self._default_timeout_s = default_timeout_s
        self._running: dict[str, _Running] = {}

    async def create(self, spec: GymSandboxSpec) -> SandboxHandle:
        try:
            sandbox = open_sandbox(self.backend, self._our_spec(spec))
        except ValueError as e:
            raise SandboxCreateError(f"{self.name}: {e}") from None
        try:
            async with asyncio.timeout(spec.ready_timeout_s):
                await sandbox.start()
                workdir = await self._prepare_workdir(sandbox, sandbox.spec.workspace, spec.workdir)
        except BaseException as e:
            await sandbox.close()
            if isinstance(e, Exception) and not isinstance(e, SandboxCreateError):
                raise SandboxCreateError(f"{self.name} ({self.backend}) sandbox did not start: {e}") from e
            raise
        sandbox_id = f"{self.name}-{self.backend}-{uuid.uuid4().hex[:12]}"
        self._running[sandbox_id] = _Running(sandbox, workdir)
        return SandboxHandle(sandbox_id=sandbox_id, provider_name=self.name, raw=self._running[sandbox_id])

    async def exec(
        self,
        handle: SandboxHandle,
        command: str,
        *,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        timeout_s: int | float | None = None,
        user: str | int | None = None,
    ) -> SandboxExecResult:
        if user is not None:
            raise ValueError(
                f"the {self.name} provider runs commands as the sandbox's one user; `user` is not supported"
            )
        running = self._get(handle)
        timeout = float(timeout_s if timeout_s is not None else self._default_timeout_s)
        if any(not key or "=" in key or key.startswith("-") for key in env or {}):
            raise ValueError(f"invalid environment variable name among {sorted(env or {})}")
        assignments = [f"{key}={value}" for key, value in (env or {}).items()]
        marker = f"PRORL_STDERR_{secrets.token_hex(8)}"
        argv = ["env", *assignments, "bash", "-c", _SPLIT_STDERR, "gym-exec", command, cwd or running.workdir, marker]
        try:
            result = await running.sandbox.exec(argv, timeout=timeout)
        except SandboxError as e:
            return SandboxExecResult(stdout=None, stderr=str(e), return_code=RUNTIME_ERROR_CODE, error_type="sandbox")
        stdout, found, stderr = result.output.rpartition(f"\n{marker}\n")
        if not found:
            stdout, stderr = result.output, ""
        if result.timed_out:
            note = f"command timed out after {timeout:g}s"
            return SandboxExecResult(
                stdout=stdout,
                stderr=(stderr + "\n" + note).lstrip(),
                return_code=RUNTIME_ERROR_CODE,
                error_type="timeout",
            )
        if result.exit_code is None:
            return SandboxExecResult(stdout=stdout, stderr=stderr, return_code=RUNTIME_ERROR_CODE, error_type="sandbox")
        return SandboxExecResult(stdout=stdout, stderr=stderr, return_code=result.exit_code)

    async def upload_file(self, handle: SandboxHandle, source_path: Path, target_path: str) -> None:
        running = self._get(handle)
        data = await asyncio.to_thread(Path(source_path).read_bytes)
        await running.sandbox.write_file(_under(running.workdir, target_path), data)

    async def download_file(self, handle: SandboxHandle, source_path: str, target_path: Path) -> None:
        running = self._get(handle)
        data = await running.sandbox.read_file(_under(running.workdir, source_path))
        target = Path(target_path)
        await asyncio.to_thread(target.parent.mkdir, parents=True, exist_ok=True)
        await asyncio.to_thread(target.write_bytes, data)

    async def status(self, handle: SandboxHandle) -> SandboxStatus:
        running = self._running.get(handle.sandbox_id)
        if running is None:
            return SandboxStatus.STOPPED
        try:
            result = await running.sandbox.exec(["true"], timeout=30)
        except SandboxError:
            return SandboxStatus.STOPPED
        return SandboxStatus.RUNNING if result.exit_code == 0 else SandboxStatus.ERROR

    async def close(self, handle: SandboxHandle) -> None:
        running = self._running.pop(handle.sandbox_id, None)
        if running is not None:
            await running.sandbox.close()

    async def aclose(self) -> None:
        """Close every sandbox this provider still holds."""
        running, self._running = list(self._running.values()), {}
        results = await asyncio.gather(*(r.sandbox.close() for r in running), return_exceptions=True)
        for error in results:
            if isinstance(error, BaseException):
                raise error

    def _get(self, handle: SandboxHandle) -> _Running:
        running = self._running.get(handle.sandbox_id)
        if running is None:
            raise RuntimeError(f"sandbox {handle.sandbox_id} is not running in this {self.name} provider")
        return running

    def _our_spec(self, spec: GymSandboxSpec) -> SandboxSpec:
        options = dict(spec.provider_options)
        network = bool(options.pop("network", self._network))
        limits = {**self._limits.model_dump(), **dict(options.pop("limits", {}) or {})}
        binds = [BindMount.model_validate(dict(b)) for b in options.pop("binds", [])] or self._binds
        workspace = str(options.pop("workspace", self._workspace))
        resources = spec.resources
        if spec.ttl_s:
            limits["wall_clock_s"] = float(spec.ttl_s)
        if resources.memory_mib:
            limits["memory_mb"] = int(resources.memory_mib)
        ignored = [
            name
            for name, value in (
                ("resources.cpu", resources.cpu),
                ("resources.disk_gib", resources.disk_gib),
                ("resources.gpu", resources.gpu),
                ("resources.gpu_type", resources.gpu_type),
                ("entrypoint", spec.entrypoint),
                ("ports", spec.ports),
                *((f"provider_options.{key}", True) for key in options),
            )
            if value
        ]
        if ignored:
            LOGGER.warning(f"{self.name} sandbox provider ({self.backend}) ignores {', '.join(ignored)}")
        return SandboxSpec(
            image=spec.image,
            network=network,
            env=dict(spec.env),
            binds=binds,
            limits=SandboxLimits.model_validate(limits),
            workspace=workspace,
        )

    async def _prepare_workdir(self, sandbox: Sandbox, workspace: str, workdir: str | None) -> str:
        path = posixpath.normpath(posixpath.join(workspace, workdir)) if workdir else workspace
        in_workspace = PurePosixPath(path).is_relative_to(workspace)
        result = await sandbox.exec(["mkdir", "-p", path] if in_workspace else ["test", "-d", path], timeout=60)
        if result.exit_code != 0:
            raise SandboxCreateError(
                f"workdir {path} does not exist in the image (only directories under {workspace} are created): "
                f"{result.output.strip()}"
            )
        return path


class BwrapProvider(ProrlProvider):
    """`ProrlProvider` on bubblewrap: the host's /usr and /etc (or an image rootfs) read-only, no network."""

    name = "bwrap"

    def __init__(self, **options: Any) -> None:
        super().__init__("bwrap", **options)


def _under(workdir: str, path: str) -> str:
    """A Gym path as ours: relative ones are relative to the sandbox's workdir."""
    return path if path.startswith("/") else posixpath.join(workdir, path)


# -- any NeMo Gym provider as our sandbox ----------------------------------------------------------------------


def register_gym_backends() -> list[str]:
    """Make every NeMo Gym provider available to `open_sandbox` as `gym:<name>` (with its default settings)."""
    names = [f"gym:{name}" for name in list_providers()]
    for name in names:
        register_backend(name, partial(GymProviderSandbox, provider=name.removeprefix("gym:")))
    return names


def gym_apptainer_config(**sections: Mapping[str, Any]) -> dict[str, Any]:
    """A provider config (`{"apptainer": {...}}`) on which NeMo Gym's own `apptainer` provider runs here: our
    Apptainer (`find_apptainer`, the binary our backend uses) and, as root, `--userns` on `instance start`.

    As root Gym starts instances privileged, which fails on this host (the starter asks for a capability the host
    withholds: "Requesting capability set ... while permitted capability set is ..."); in a user namespace the
    instance starts and Gym's `exec` joins it. (`--no-privs` on both `instance start` and `exec` works too.)
    `sections` (`create`, `exec`, `probe`) are merged over these settings. Gym's `close` stops the instance but
    leaves Apptainer's log files of it: `apptainer.remove_instance_logs(handle.sandbox_id)` removes them."""
    binary = find_apptainer()
    if os.path.basename(binary) != "apptainer":
        raise SandboxError(f"NeMo Gym runs `<bin_path>/apptainer`, so it cannot use {binary}")
    create = {"extra_start_args": ["--userns"] if os.geteuid() == 0 else []}
    config: dict[str, Any] = {"bin_path": os.path.dirname(binary), "create": create}
    for name, values in sections.items():
        config[name] = {**config.get(name, {}), **values}
    return {"apptainer": config}
