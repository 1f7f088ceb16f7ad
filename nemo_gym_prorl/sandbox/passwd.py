"""The sandbox user's /etc/passwd entry, with its home where HOME points: the spec's workspace.

Every backend sets HOME to `SandboxSpec.workspace` (/testbed for SWE), but the passwd entry of the uid the sandbox
runs as came from the image (`agent:...:/workspace` in ours, `nobody:...:/nonexistent` for Apptainer's uid 65534) or
from bwrap's own file. Programs that ask passwd rather than $HOME (`getent passwd $(id -u)`, `~user`, Python's
`pwd`, ssh, some installers) then saw a home that does not exist. Each backend gives the sandbox this rewritten
file instead.
"""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Iterator
from typing import BinaryIO

_MAX_BYTES = 1 << 20


def with_home(passwd: str, uid: int, home: str, name: str = "sandbox") -> str:
    """`passwd` with the home of every entry of `uid` set to `home`; an entry `name` is added when there is none."""
    lines, found = [], False
    for line in passwd.splitlines():
        fields = line.split(":")
        if len(fields) == 7 and fields[2] == str(uid):
            fields[5], found = home, True
            line = ":".join(fields)
        lines.append(line)
    if not found:
        lines.append(f"{name}:x:{uid}:{uid}:{name}:{home}:/bin/bash")
    return "\n".join(lines) + "\n"


@contextlib.contextmanager
def _passwd_file(root_fd: int, mode: str) -> Iterator[BinaryIO | None]:
    """`etc/passwd` under `root_fd` opened in `mode` ("rb" or "r+b"), following no symlink (a tree's own links
    could lead out of it, into the host's files); None when there is no regular file there (an image whose /etc or
    /etc/passwd is a link keeps its file as it is)."""
    flags = (os.O_RDWR if mode == "r+b" else os.O_RDONLY) | os.O_NOFOLLOW | os.O_NOCTTY | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        etc = os.open("etc", os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=root_fd)
        try:
            fd = os.open("passwd", flags, dir_fd=etc)
        finally:
            os.close(etc)
    except OSError:
        yield None
        return
    with os.fdopen(fd, mode) as file:
        yield file if stat.S_ISREG(os.fstat(fd).st_mode) else None


def read_beneath(root_fd: int) -> str | None:
    """The /etc/passwd of the tree `root_fd` opens (an image, a container's root); None when it has none."""
    with _passwd_file(root_fd, "rb") as file:
        return None if file is None else file.read(_MAX_BYTES).decode("utf-8", "replace")


def rewrite_beneath(root_fd: int, uid: int, home: str) -> bool:
    """Give `uid` the home `home` in the writable /etc/passwd of the tree `root_fd` opens, in place; False when
    there is none to rewrite."""
    with _passwd_file(root_fd, "r+b") as file:
        if file is None:
            return False
        new = with_home(file.read(_MAX_BYTES).decode("utf-8", "replace"), uid, home).encode()
        file.seek(0)
        file.write(new)
        file.truncate()
    return True
