"""The sandbox contract: a spec to start from, the result of a command, and the protocol every backend implements.

A sandbox is an isolated place where an agent's commands run. It holds a persistent shell (cwd and environment
survive between commands), moves files in and out of its workspace, and is always torn down: `close()` is
idempotent and leaves no process, mount or temp dir behind, whatever happened before it.
"""

from __future__ import annotations

import posixpath
from typing import Protocol, Self

from pydantic import BaseModel, ConfigDict, Field, field_validator

WORKSPACE = "/workspace"
"""Where a sandbox's workspace is mounted unless its spec says otherwise (`SandboxSpec.workspace`)."""
IMAGE_PATH = "/usr/local/bin:/usr/bin:/bin:/usr/local/sbin:/usr/sbin:/sbin"
"""A sandbox's PATH unless its spec's environment sets one."""
_RESERVED = ("/proc", "/dev", "/tmp", "/sys", "/.prorl")


class SandboxLimits(BaseModel):
    """Resource limits applied to everything that runs inside one sandbox."""

    model_config = ConfigDict(extra="forbid")  # a misspelt limit would silently be no limit

    wall_clock_s: float = Field(1800.0, gt=0, description="lifetime of the sandbox; past it, it is killed")
    memory_mb: int = Field(2048, gt=0, description="address-space limit of each process inside")
    cpu_time_s: int | None = Field(None, gt=0, description="CPU seconds per process (RLIMIT_CPU)")
    max_processes: int | None = Field(256, gt=0, description="processes alive in the sandbox at once")
    file_size_mb: int | None = Field(1024, gt=0, description="largest file a process may write (RLIMIT_FSIZE)")
    disk_mb: int | None = Field(
        4096, gt=0, description="total size of the sandbox's writable workspace, enforced by the kernel (root only)"
    )
    max_open_files: int | None = Field(1024, gt=0, description="open files per process (RLIMIT_NOFILE)")
    max_read_mb: int = Field(64, gt=0, description="largest file read_file brings to the host")
    max_output_bytes: int = Field(64_000, gt=0, description="bytes of one command's output kept (head and tail)")


class BindMount(BaseModel):
    source: str = Field(description="host path")
    target: str = Field(description="path inside the sandbox")
    writable: bool = False


class SandboxSpec(BaseModel):
    """What to start a sandbox from."""

    image: str | None = Field(
        None, description="None: the host's /usr and /etc read-only; a directory: a rootfs; a .sif file (Apptainer)"
    )
    network: bool = False
    env: dict[str, str] = Field(default_factory=dict)
    binds: list[BindMount] = Field(default_factory=list)
    limits: SandboxLimits = Field(default_factory=lambda: SandboxLimits())
    workspace: str = Field(
        WORKSPACE,
        description="where the workspace is mounted inside (the shell's cwd and HOME; file paths are relative to "
        "it); SWE-bench images and eval scripts expect /testbed. It hides what the image holds at that path",
    )

    @field_validator("workspace")
    @classmethod
    def _workspace_path(cls, path: str) -> str:
        if not path.startswith("/") or path.startswith("//") or posixpath.normpath(path) != path or path == "/":
            raise ValueError(f"workspace {path!r} must be a normalised absolute path below / (e.g. /testbed)")
        if any(c in path for c in ",:\\\n"):
            raise ValueError(f"workspace {path!r} contains ',', ':', '\\' or a newline (mount options split on them)")
        clash = next((r for r in _RESERVED if path == r or path.startswith(r + "/") or r.startswith(path + "/")), None)
        if clash is not None:
            raise ValueError(f"workspace {path!r} would be mounted over or under {clash}, which the sandbox needs")
        return path


class ExecResult(BaseModel):
    """What one command produced."""

    output: str
    exit_code: int | None = Field(description="None when the command did not finish (timeout, sandbox died)")
    timed_out: bool = False
    truncated: bool = False
    duration_s: float = 0.0


def with_note(output: str, note: str) -> str:
    """`output`, then `note` from the start of a line of its own."""
    return output + ("" if not output or output.endswith("\n") else "\n") + note


class SandboxError(RuntimeError):
    """The sandbox itself failed (could not start, died); a command's own failure is an ExecResult instead."""


class PathOutsideWorkspaceError(ValueError):
    """A file path given to write_file/read_file leads outside the sandbox's workspace."""


class NotARegularFileError(OSError):
    """write_file/read_file found something other than a regular file or directory at the path (a FIFO, a socket,
    a device): refused without opening it for I/O, which could block the host."""


class FileTooLargeError(OSError):
    """read_file found a file larger than `limits.max_read_mb` (sparse files cost no disk but would cost the host
    their whole size in memory)."""


class Sandbox(Protocol):
    """An isolated workspace with a persistent shell. Use as `async with`."""

    async def start(self) -> None: ...

    async def run(self, command: str, timeout: float) -> ExecResult:
        """Run `command` in the persistent shell; cwd and environment persist to the next call."""
        ...

    async def exec(self, argv: list[str], timeout: float) -> ExecResult:
        """Run one program inside the sandbox outside the persistent shell (whose state it leaves untouched)."""
        ...

    async def write_file(self, path: str, data: bytes) -> None:
        """Write `data` at `path`, relative to the workspace or absolute under it (PathOutsideWorkspaceError if
        it leads outside)."""
        ...

    async def read_file(self, path: str) -> bytes:
        """The content of the regular file at `path` (same paths as `write_file`). Never blocks on what the sandbox
        put there: NotARegularFileError for a FIFO, socket or device, FileTooLargeError past `limits.max_read_mb`."""
        ...

    async def close(self) -> None: ...

    async def __aenter__(self) -> Self: ...

    async def __aexit__(self, *exc: object) -> None: ...


class ForkableSandbox(Sandbox, Protocol):
    """A sandbox that can start copy-on-write copies of itself (GRPO groups: one init, n samples)."""

    async def fork(self, n: int, *, close: bool = False) -> list[Sandbox]:
        """n started sandboxes, each seeing this one's workspace as it is now, each writing only to its own copy.
        `close=True` closes this one on the way (its workspace may then be handed over rather than copied)."""
        ...
