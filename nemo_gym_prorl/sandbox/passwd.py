"""The sandbox user's /etc/passwd entry, with its home where HOME points: the spec's workspace.

Every backend sets HOME to `SandboxSpec.workspace` (/testbed for SWE), but the passwd entry of the uid the sandbox
runs as came from the image (`agent:...:/workspace` in ours, `nobody:...:/nonexistent` for Apptainer's uid 65534) or
from bwrap's own file. Programs that ask passwd rather than $HOME (`getent passwd $(id -u)`, `~user`, Python's
`pwd`, ssh, some installers) then saw a home that does not exist. Each backend gives the sandbox this rewritten
file instead.
"""

from __future__ import annotations

import os
import stat

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


def _open_passwd(root_fd: int, flags: int) -> int:
    """`etc/passwd` under `root_fd`, following no symlink (a tree's own links could lead out of it, into the host's
    files): an image whose /etc or /etc/passwd is a link keeps its file as it is."""
    etc = os.open("etc", os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=root_fd)
    try:
        return os.open("passwd", flags | os.O_NOFOLLOW | os.O_NOCTTY | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=etc)
    finally:
        os.close(etc)


def read_beneath(root_fd: int) -> str | None:
    """The /etc/passwd of the tree `root_fd` opens (an image, a container's root); None when it has none (or a link,
    a directory, ...)."""
    try:
        fd = _open_passwd(root_fd, os.O_RDONLY)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as file:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        return file.read(_MAX_BYTES).decode("utf-8", "replace")


def rewrite_beneath(root_fd: int, uid: int, home: str) -> bool:
    """Give `uid` the home `home` in the writable /etc/passwd of the tree `root_fd` opens, in place; False when
    there is none to rewrite."""
    try:
        fd = _open_passwd(root_fd, os.O_RDWR)
    except OSError:
        return False
    with os.fdopen(fd, "r+b") as file:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return False
        new = with_home(file.read(_MAX_BYTES).decode("utf-8", "replace"), uid, home).encode()
        file.seek(0)
        file.write(new)
        file.truncate()
    return True
