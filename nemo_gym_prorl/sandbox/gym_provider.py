"""NeMo Gym sandboxes, both ways round.

**Our backends as Gym providers.** `ProrlProvider` implements NeMo Gym's `SandboxProvider` protocol over any
backend `open_sandbox` knows (`backend="bwrap"` by default; `"apptainer"` once registered); `BwrapProvider` is
the same pinned to bubblewrap. Both are published in the `nemo_gym.sandbox_providers` entry-point group (as
`prorl` and `bwrap`), so once this package is installed any Gym user gets them by name::

    async with AsyncSandbox({"bwrap": {"limits": {"memory_mb": 1024}}}, SandboxSpec(workdir="/workspace")) as box:
        await box.start()
        result = await box.exec("python3 -c 'print(6 * 7)'")

Gym's spec maps onto ours: `image` (None: the host's /usr and /etc; a rootfs directory; a .sif for apptainer),
`env`, `ttl_s` (wall-clock limit), `resources.memory_mib` (address-space limit), `workdir` (the default cwd of
`exec`; created when under the workspace, otherwise it must exist in the image); `provider_options` may override the
provider's `network`, `limits`, `binds` and `workspace` (where the workspace is mounted: /workspace unless set, e.g.
/testbed for SWE-bench's eval scripts; it hides what the image holds there). `exec` runs `bash -c COMMAND` outside
the persistent shell, with stdout and stderr apart (our sandboxes capture one stream; stderr goes through a temp
file inside). Output is kept up to `limits.max_output_bytes` (head and tail). Commands run as the sandbox's one
unprivileged user, so `user` is refused. Files move only inside the workspace (everything else in the sandbox is
read-only); a relative path is relative to `workdir`. cpu/gpu/disk requests, ports and entrypoints are not supported
and are logged.

**Any Gym provider as our sandbox.** `GymProviderSandbox(spec, provider)` implements our `Sandbox` over a Gym
provider (a name such as `"local"`, a `{name: kwargs}` config, or a provider object), so our environments run on any
of them; `register_gym_backends()` makes each Gym provider available to `open_sandbox` as `gym:<name>`. Gym
providers run one command per `exec` (`bash -c`), so the persistent shell is emulated: the cwd and the exported
variables a command leaves behind are saved in the workspace's hidden `.prorl/shell/` and restored before the next
one; unexported variables, functions, aliases, shell options and job control do not carry over. A timed-out command
is killed by the provider, and the shell state stays as it was before that command. The workspace is the provider's
working directory (`workdir`: our spec's `workspace` when that is not the default, else what the provider picks: a
host temp dir for `local`); paths under the spec's `workspace` are mapped onto it. Every command carries the
environment variable `PRORL_SANDBOX_ID`, and `close()` kills whatever process still carries it before the provider
closes the sandbox, so background processes (the python tool's interpreter, say) do not outlive it even on `local`.
Isolation, network and resource limits are whatever the provider enforces: Gym's `local` enforces none.
`gym_apptainer_config()` is the config on which Gym's own `apptainer` provider runs here, with our Apptainer.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import posixpath
import secrets
import shlex
import shutil
import tempfile
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
    SandboxProvider,
    SandboxStatus,
    create_provider,
    list_providers,
)
from nemo_gym.sandbox import SandboxSpec as GymSandboxSpec

from nemo_gym_prorl.sandbox import open_sandbox, register_backend
from nemo_gym_prorl.sandbox.apptainer import find_apptainer
from nemo_gym_prorl.sandbox.base import (
    WORKSPACE,
    BindMount,
    ExecResult,
    NotARegularFileError,
    Sandbox,
    SandboxError,
    SandboxLimits,
    SandboxSpec,
)
from nemo_gym_prorl.sandbox.lifecycle import SandboxLifecycle
from nemo_gym_prorl.sandbox.workspace import lexical_relative, read_capped

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

_STATE_DIR = ".prorl/shell"
_ID_VARIABLE = "PRORL_SANDBOX_ID"

# One `run`: restore the saved cwd and exported variables, run the command with stderr merged into stdout, save
# them again. Formatted with shlex-quoted values.
_RUN_SCRIPT = """\
__prorl_state={state}
cd -- "$(cat "$__prorl_state/cwd" 2>/dev/null)" 2>/dev/null || cd -- {workdir}
if [ -f "$__prorl_state/env" ]; then . "$__prorl_state/env" 2>/dev/null; fi
exec 2>&1 </dev/null
eval {command}
__prorl_rc=$?
{{ pwd > "$__prorl_state/cwd"; export -p > "$__prorl_state/env"; }} 2>/dev/null
exit $__prorl_rc
"""

# Kill every process that carries this sandbox's id, again while new ones turn up (a dying parent's last forks).
_CLEANUP_SCRIPT = """\
for _ in 1 2 3 4 5; do
  pids=$(grep -lsxzaF "{variable}={sandbox_id}" /proc/[0-9]*/environ | cut -d/ -f3)
  [ -z "$pids" ] && exit 0
  kill -9 $pids 2>/dev/null
done
"""

_PROBE_SCRIPT = (
    'if [ -d "$1" ]; then echo dir; elif [ -p "$1" ] || [ -S "$1" ] || [ -b "$1" ] || [ -c "$1" ]; then echo special; '
    'elif [ -e "$1" ]; then echo other; else echo missing; fi'
)


class GymProviderSandbox(SandboxLifecycle):
    """Our `Sandbox` over a NeMo Gym provider; see the module docstring for what the emulated shell keeps."""

    def __init__(
        self,
        spec: SandboxSpec | None = None,
        provider: str | Mapping[str, Any] | SandboxProvider = "local",
        *,
        workdir: str | None = None,
    ) -> None:
        self.spec = spec or SandboxSpec()
        self._provider_config = {provider: {}} if isinstance(provider, str) else provider
        self._provider: SandboxProvider | None = None
        if workdir is None and self.spec.workspace != WORKSPACE:
            workdir = self.spec.workspace
        self._requested_workdir = workdir
        self.workdir: str | None = None
        """The workspace as commands inside see it (the provider's working directory); None before start."""
        self._id = uuid.uuid4().hex
        self._handle: SandboxHandle | None = None
        self._run_lock = asyncio.Lock()
        self._made_dirs: set[str] = set()

    async def start(self) -> None:
        if self._handle is not None or self._close_task is not None:
            raise SandboxError("sandbox already started")
        if self.spec.binds:
            raise SandboxError("bind mounts are not supported on NeMo Gym providers")
        try:
            config = self._provider_config
            self._provider = create_provider(config) if isinstance(config, Mapping) else config
            limits = self.spec.limits
            gym_spec = GymSandboxSpec(
                image=self.spec.image,
                ttl_s=limits.wall_clock_s,
                workdir=self._requested_workdir,
                env=dict(self.spec.env),
                resources={"memory_mib": limits.memory_mb},
            )
            self._handle = await self._provider.create(gym_spec)
            found = await self._provider.exec(self._handle, "pwd", cwd=self._requested_workdir, timeout_s=60)
            workdir = (found.stdout or "").strip()
            if found.return_code != 0 or not workdir.startswith("/"):
                raise SandboxError(f"cannot find the sandbox's working directory: {found.stderr or found.stdout}")
            self.workdir = workdir
            made = await self._provider.exec(
                self._handle,
                f"mkdir -p {shlex.quote(self._state_dir())} && pwd > {shlex.quote(self._state_dir() + '/cwd')}",
                cwd=workdir,
                timeout_s=60,
            )
            if made.return_code != 0:
                raise SandboxError(f"cannot write the workspace {workdir}: {made.stderr or made.stdout}")
        except BaseException as e:
            await self.close()
            if isinstance(e, Exception) and not isinstance(e, SandboxError):
                raise SandboxError(f"NeMo Gym sandbox did not start: {type(e).__name__}: {e}") from e
            raise
        self._arm_wall_clock()

    async def run(self, command: str, timeout: float) -> ExecResult:
        async with self._run_lock:
            workdir = self._live()
            script = _RUN_SCRIPT.format(
                state=shlex.quote(self._state_dir()), workdir=shlex.quote(workdir), command=shlex.quote(command)
            )
            result = await self._exec(script, timeout)
        if result.timed_out:
            result.output = _join(
                result.output,
                f"[timed out after {timeout:g}s: the command was killed; cwd and exported variables are as "
                "they were before it]\n",
            )
        return result

    async def exec(self, argv: list[str], timeout: float) -> ExecResult:
        self._live()
        return await self._exec(shlex.join(argv) + " 2>&1 </dev/null", timeout)

    async def write_file(self, path: str, data: bytes) -> None:
        target = self._inside(path)
        parent = posixpath.dirname(target)
        if parent != self.workdir and parent not in self._made_dirs:
            made = await self._exec(f"mkdir -p -- {shlex.quote(parent)}", 60)
            if made.exit_code != 0:
                raise OSError(errno.EIO, f"cannot create {parent}: {made.output.strip()}", path)
            self._made_dirs.add(parent)
        with tempfile.TemporaryDirectory(prefix="prorl-upload-") as tmp:
            source = Path(tmp) / "data"
            await asyncio.to_thread(source.write_bytes, data)
            provider, handle = self._live_provider()
            try:
                await provider.upload_file(handle, source, target)
            except shutil.SpecialFileError:  # Gym's local provider copies with shutil, which refuses a FIFO
                raise NotARegularFileError(errno.EINVAL, "not a regular file; refused", path) from None
            except OSError:
                raise
            except Exception as e:
                raise OSError(errno.EIO, f"cannot write: {type(e).__name__}: {e}", path) from e

    async def read_file(self, path: str) -> bytes:
        source = self._inside(path)
        with tempfile.TemporaryDirectory(prefix="prorl-download-") as tmp:
            target = Path(tmp) / "data"
            provider, handle = self._live_provider()
            try:
                await provider.download_file(handle, source, target)
            except Exception as e:
                probe = await self._exec(f"bash -c {shlex.quote(_PROBE_SCRIPT)} probe {shlex.quote(source)}", 60)
                kind = probe.output.strip()
                if kind == "dir":
                    raise IsADirectoryError(errno.EISDIR, "Is a directory", path) from None
                if kind == "missing":
                    raise FileNotFoundError(errno.ENOENT, "No such file or directory", path) from None
                if kind == "special":
                    raise NotARegularFileError(errno.EINVAL, "not a regular file; refused", path) from None
                raise OSError(errno.EIO, f"cannot read: {e}", path) from e
            with open(target, "rb") as f:  # what the provider downloaded, read only up to limits.max_read_mb
                return await asyncio.to_thread(read_capped, f, self.spec.limits.max_read_mb * 2**20, path)

    # -- internals ---------------------------------------------------------------------------------------------

    def _state_dir(self) -> str:
        return f"{self.workdir}/{_STATE_DIR}"

    def _live(self) -> str:
        self._check_open()
        if self._handle is None or self.workdir is None:
            raise SandboxError("sandbox is not started")
        return self.workdir

    def _inside(self, path: str) -> str:
        """`path` (relative to the workspace, or absolute under it or under the spec's `workspace`) as an absolute
        path."""
        workdir = self._live()
        return f"{workdir}/{lexical_relative(path, workdir, aliases=(self.spec.workspace,))}"

    async def _exec(self, command: str, timeout: float) -> ExecResult:
        started = asyncio.get_running_loop().time()
        provider, handle = self._live_provider()
        try:
            result = await provider.exec(
                handle, command, cwd=self.workdir, env={_ID_VARIABLE: self._id}, timeout_s=timeout
            )
        except Exception as e:
            raise SandboxError(
                f"NeMo Gym provider {provider.name!r} failed to run a command: {type(e).__name__}: {e}"
            ) from e
        timed_out = result.error_type == "timeout"
        note = f"[sandbox error ({result.error_type})]" if result.error_type is not None and not timed_out else ""
        output = _join(result.stdout or "", result.stderr or "", note)
        limit = self.spec.limits.max_output_bytes
        raw = output.encode("utf-8", "replace")
        truncated = len(raw) > limit
        if truncated:
            dropped = len(raw) - limit
            raw = raw[: limit // 2] + f"\n[... {dropped} bytes truncated ...]\n".encode() + raw[-(limit - limit // 2) :]
        return ExecResult(
            output=raw.decode("utf-8", "replace"),
            exit_code=None if result.error_type is not None else result.return_code,
            timed_out=timed_out,
            truncated=truncated,
            duration_s=asyncio.get_running_loop().time() - started,
        )

    def _live_provider(self) -> tuple[SandboxProvider, SandboxHandle]:
        self._live()
        assert self._provider is not None and self._handle is not None
        return self._provider, self._handle

    async def _close(self) -> None:
        """Kill what this sandbox started, close it at the provider, release the provider."""
        provider, handle = self._provider, self._handle
        self._handle = None
        try:
            if provider is not None and handle is not None:
                try:
                    await provider.exec(
                        handle,
                        _CLEANUP_SCRIPT.format(variable=_ID_VARIABLE, sandbox_id=self._id),
                        timeout_s=30,
                    )
                except Exception as e:
                    LOGGER.warning(f"could not kill the processes of sandbox {handle.sandbox_id}: {e}")
                finally:
                    await provider.close(handle)
        finally:
            if provider is not None and isinstance(self._provider_config, Mapping):
                with contextlib.suppress(Exception):
                    await provider.aclose()


def _join(*parts: str) -> str:
    """Texts one after the other, each non-empty one starting on a new line."""
    out = ""
    for part in parts:
        if part:
            out += ("\n" if out and not out.endswith("\n") else "") + part
    return out


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
