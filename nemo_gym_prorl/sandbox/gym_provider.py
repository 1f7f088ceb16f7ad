"""Any NeMo Gym sandbox provider as our sandbox backend (``gym:<provider>``).

`GymProviderSandbox(spec, provider)` implements our `Sandbox` over a Gym provider (a name such as `"local"`, a
`{name: kwargs}` config, or a provider object), so our environments run on any of them. Gym
providers run one command per `exec` (`bash -c`), so the persistent shell is emulated: the cwd and the exported
variables a command leaves behind are saved in the workspace's hidden `.prorl/shell/` and restored before the next
one; unexported variables, functions, aliases, shell options and job control do not carry over. A timed-out command
is killed by the provider, and the shell state stays as it was before that command. The workspace is the provider's
working directory (`workdir`: our spec's `workspace` when that is not the default, else what the provider picks: a
host temp dir for `local`); paths under the spec's `workspace` are mapped onto it. Every command carries the
environment variable `PRORL_SANDBOX_ID`, and `close()` kills whatever process still carries it before the provider
closes the sandbox, so background processes (the python tool's interpreter, say) do not outlive it even on `local`.
Isolation, network and resource limits are whatever the provider enforces: Gym's `local` enforces none.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import posixpath
import shlex
import shutil
import tempfile
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from nemo_gym.sandbox import (
    SandboxHandle,
    SandboxProvider,
    create_provider,
)
from nemo_gym.sandbox import SandboxSpec as GymSandboxSpec

from nemo_gym_prorl.contracts.sandbox import (
    WORKSPACE,
    ExecResult,
    NotARegularFileError,
    SandboxError,
    SandboxSpec,
)
from nemo_gym_prorl.sandbox.lifecycle import SandboxLifecycle
from nemo_gym_prorl.sandbox.workspace import lexical_relative, read_capped

LOGGER = logging.getLogger(__name__)

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
