"""BwrapSandbox.fork: copy-on-write copies of a sandbox's workspace for the samples of a GRPO group."""

from __future__ import annotations

import asyncio
import tempfile
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import psutil
import pytest
from sandbox_helpers import reachable_temp_dir

from nemo_gym_prorl.contracts.sandbox import ForkableSandbox, PathOutsideWorkspaceError
from nemo_gym_prorl.sandbox import BwrapSandbox, SandboxError, SandboxLimits, SandboxSpec

_: type[ForkableSandbox] = BwrapSandbox  # BwrapSandbox implements the fork contract (checked by the type checker)

SPEC = SandboxSpec(env={"TASK": "t1"}, limits=SandboxLimits(memory_mb=512, max_processes=64))


@pytest.fixture
def private_tmp(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """Sandboxes of this test put their temp dirs here, so the test sees exactly what they leave behind."""
    with reachable_temp_dir() as path:
        monkeypatch.setattr(tempfile, "tempdir", str(path))
        yield path


@pytest.fixture
def outside_children() -> set[int]:
    """Child processes of the test run that are not this test's (a session's model server, say)."""
    return set(children())


@pytest.fixture
async def parent(private_tmp: Path, outside_children: set[int]) -> AsyncIterator[BwrapSandbox]:
    async with BwrapSandbox(SPEC) as sandbox:
        await sandbox.run("mkdir -p src/pkg && echo v1 > src/pkg/mod.py && echo bye > gone.txt && ln -s src link", 5)
        yield sandbox


def leftovers(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir())


async def close_all(sandboxes: list[BwrapSandbox]) -> None:
    await asyncio.gather(*(s.close() for s in sandboxes))


async def test_forks_see_the_workspace_and_write_only_their_own_copy(parent: BwrapSandbox) -> None:
    forks = await parent.fork(3)
    try:
        assert all(isinstance(fork, BwrapSandbox) and fork.spec == parent.spec for fork in forks)
        for i, fork in enumerate(forks):
            result = await fork.run(
                f"cat link/pkg/mod.py; echo v2-{i} > src/pkg/mod.py; echo {i} > new.txt; rm gone.txt;"
                f" mv src/pkg src/moved; ls -1A; echo $TASK",
                5,
            )
            assert result.output == "v1\nlink\nnew.txt\nsrc\nt1\n"
        await parent.run("echo parent-later > later.txt", 5)
        assert (await parent.run("cat src/pkg/mod.py gone.txt; ls -1A", 5)).output == (
            "v1\nbye\ngone.txt\nlater.txt\nlink\nsrc\n"
        )
        for i, fork in enumerate(forks):
            seen = await fork.run("cat src/moved/mod.py new.txt; ls -1A; ls -1 src", 5)
            assert seen.output == f"v2-{i}\n{i}\nlink\nnew.txt\nsrc\nmoved\n"
    finally:
        await close_all(forks)


async def test_forks_share_one_snapshot_and_store_only_their_changes(parent: BwrapSandbox, private_tmp: Path) -> None:
    await parent.run("head -c 20000000 /dev/urandom > big.bin", 20)
    forks = await parent.fork(4)
    try:
        snapshots = [p for p in private_tmp.iterdir() if p.name.startswith("prorl-sbx-snap-")]
        assert len(snapshots) == 1 and (snapshots[0] / "tree/big.bin").stat().st_size == 20_000_000
        await forks[0].run("echo small > note.txt", 5)
        for fork in forks:
            assert fork.writable_dir is not None and fork.workspace is None
            upper = sorted(p.name for p in (fork.writable_dir / "upper").iterdir())
            assert upper == (["note.txt"] if fork is forks[0] else [])  # big.bin is read from the snapshot
        sums = {(await fork.run("md5sum big.bin", 20)).output for fork in forks}
        assert sums == {(await parent.run("md5sum big.bin", 20)).output}
    finally:
        await close_all(forks)


async def test_a_fork_lists_exactly_the_paths_it_changed(parent: BwrapSandbox) -> None:
    """What taking a fork's patch relies on: every changed path, deletions and a directory replaced whole included,
    nothing it only read, nothing of its siblings'; a sandbox that is no fork has nothing to compare against."""
    await parent.run("mkdir -p docs/api && echo a > docs/api/a.md && echo b > docs/b.md && echo k > keep.txt", 5)
    forks = await parent.fork(2)
    try:
        await forks[0].run(
            "cat keep.txt src/pkg/mod.py; ls -R docs >/dev/null; echo v2 >> src/pkg/mod.py; rm gone.txt;"
            " mv src/pkg src/moved; chmod +x keep.txt; rm -rf docs && mkdir docs && echo c > docs/c.md;"
            " ln -sfn /etc link2; mkdir -p new/deep && echo n > new/deep/n.txt; mkdir empty",
            5,
        )
        assert await forks[0].changed_paths() == [
            "docs", "gone.txt", "keep.txt", "link2", "new/deep/n.txt", "src/moved/mod.py", "src/pkg",
        ]  # fmt: skip
        assert await forks[1].changed_paths() == []
        assert await forks[0].changed_paths(limit=3) is None  # past the limit: the caller walks the tree itself
        assert await parent.changed_paths() is None
    finally:
        await close_all(forks)


async def test_closing_the_parent_keeps_forks_and_the_last_fork_removes_the_snapshot(
    parent: BwrapSandbox, private_tmp: Path
) -> None:
    forks = await parent.fork(2)
    await parent.close()
    assert (await forks[0].run("cat src/pkg/mod.py", 5)).output == "v1\n"
    await forks[0].close()
    assert (await forks[1].run("cat gone.txt", 5)).output == "bye\n"
    assert [p for p in leftovers(private_tmp) if "snap" in p]
    await forks[1].close()
    assert leftovers(private_tmp) == []


async def test_fork_and_close_hands_the_workspace_over_without_copying(parent: BwrapSandbox, private_tmp: Path) -> None:
    """For a GRPO group whose init sandbox has no further use: the parent is closed and its workspace becomes the
    forks' snapshot as it is, the same files (inode for inode), not a copy."""
    await parent.run("head -c 1000000 /dev/urandom > big.bin", 20)
    assert parent.workspace is not None and parent.temp_dir is not None
    inode, parent_dir = (parent.workspace / "big.bin").stat().st_ino, parent.temp_dir
    forks = await parent.fork(3, close=True)
    try:
        with pytest.raises(SandboxError, match="closed"):
            await parent.run("true", 5)
        assert not parent_dir.exists()
        (snapshot,) = [p for p in private_tmp.iterdir() if p.name.startswith("prorl-sbx-snap-")]
        assert (snapshot / "tree/big.bin").stat().st_ino == inode
        for i, fork in enumerate(forks):
            result = await fork.run(f"cat src/pkg/mod.py; echo {i} > src/pkg/mod.py; cat link/pkg/mod.py", 5)
            assert result.output == f"v1\n{i}\n"
        assert len({(await fork.run("md5sum big.bin", 20)).output for fork in forks}) == 1
    finally:
        await close_all(forks)
    assert leftovers(private_tmp) == []


async def test_a_fork_closed_as_it_forks_hands_over_a_copy_of_its_view(parent: BwrapSandbox) -> None:
    (first,) = await parent.fork(1, close=True)
    await first.run("echo changed > src/pkg/mod.py", 5)
    grandchildren = await first.fork(2, close=True)  # a fork's workspace is an overlay: copied, then it closes
    try:
        with pytest.raises(SandboxError, match="closed"):
            await first.run("true", 5)
        for child in grandchildren:
            assert (await child.run("cat src/pkg/mod.py", 5)).output == "changed\n"
    finally:
        await close_all(grandchildren)


async def test_fork_of_a_fork_starts_from_the_forks_view(parent: BwrapSandbox) -> None:
    (first,) = await parent.fork(1)
    try:
        await first.run("echo changed > src/pkg/mod.py; rm gone.txt; echo added > added.txt", 5)
        grandchildren = await first.fork(2)
        try:
            await grandchildren[0].run("echo only-here > mine.txt", 5)
            for child in grandchildren:
                result = await child.run("cat src/pkg/mod.py added.txt; ls -1A", 5)
                extra = "mine.txt\n" if child is grandchildren[0] else ""
                assert result.output == f"changed\nadded\nadded.txt\nlink\n{extra}src\n"
            assert (await first.run("ls -1A", 5)).output == "added.txt\nlink\nsrc\n"
        finally:
            await close_all(grandchildren)
    finally:
        await first.close()


async def test_fork_files_and_exec_go_through_the_forks_view(parent: BwrapSandbox) -> None:
    (fork,) = await parent.fork(1)
    try:
        assert await fork.read_file("src/pkg/mod.py") == b"v1\n"
        assert await fork.read_file("/workspace/link/pkg/mod.py") == b"v1\n"
        await fork.write_file("deep/new/file.bin", bytes(range(256)))
        assert (await fork.run("stat -c '%U %s' deep/new/file.bin", 5)).output == "sandbox 256\n"
        assert await fork.read_file("deep/new/file.bin") == bytes(range(256))
        result = await fork.exec(["sh", "-c", "cat src/pkg/mod.py; ls deep/new"], 5)
        assert result.output == "v1\nfile.bin\n" and result.exit_code == 0
        assert (await parent.run("ls deep", 5)).exit_code != 0
        await fork.run("ln -s /etc/passwd out; ln -s ../../.. up", 5)
        for path in ("out", "up/etc/passwd", "../x", "/etc/passwd"):
            with pytest.raises(PathOutsideWorkspaceError):
                await fork.read_file(path)
            with pytest.raises(PathOutsideWorkspaceError):
                await fork.write_file(path, b"x")
        with pytest.raises(FileNotFoundError):
            await fork.read_file("missing.txt")
        with pytest.raises(IsADirectoryError):
            await fork.read_file("src")
    finally:
        await fork.close()


def failing_start(n: int) -> Callable[[BwrapSandbox], None]:
    """`BwrapSandbox._prepare_host_dirs` that fails ("disk full") for the n-th sandbox to start from now on."""
    original = BwrapSandbox._prepare_host_dirs
    calls = 0

    def prepare(self: BwrapSandbox) -> None:
        nonlocal calls
        calls += 1
        if calls == n:
            raise OSError("disk full")
        original(self)

    return prepare


async def test_a_failed_or_cancelled_fork_leaves_nothing(
    parent: BwrapSandbox, private_tmp: Path, monkeypatch: pytest.MonkeyPatch, outside_children: set[int]
) -> None:
    before = leftovers(private_tmp)
    with monkeypatch.context() as patch:
        patch.setattr(BwrapSandbox, "_prepare_host_dirs", failing_start(3))
        with pytest.raises(OSError, match="disk full"):
            await parent.fork(4)
    assert leftovers(private_tmp) == before
    for delay in (0.0, 0.005, 0.02, 0.05, 0.1):
        task = asyncio.create_task(parent.fork(3))
        await asyncio.sleep(delay)  # the moment of cancellation, not a synchronisation
        task.cancel()
        try:
            forks = await task
        except asyncio.CancelledError:
            pass
        else:
            await close_all(forks)
        assert leftovers(private_tmp) == before
        assert set(children()) - outside_children == {parent.pid}  # the parent's bwrap is our only one left
    assert (await parent.run("cat src/pkg/mod.py", 5)).output == "v1\n"


async def test_a_failed_fork_and_close_still_closes_and_leaves_nothing(
    parent: BwrapSandbox, private_tmp: Path, monkeypatch: pytest.MonkeyPatch, outside_children: set[int]
) -> None:
    monkeypatch.setattr(BwrapSandbox, "_prepare_host_dirs", failing_start(2))
    with pytest.raises(OSError, match="disk full"):
        await parent.fork(3, close=True)
    with pytest.raises(SandboxError, match="closed"):
        await parent.run("true", 5)
    assert leftovers(private_tmp) == []
    assert set(children()) - outside_children == set()


def children() -> list[int]:
    return [p.pid for p in psutil.Process().children() if p.status() != psutil.STATUS_ZOMBIE]


async def test_fork_needs_a_running_sandbox(private_tmp: Path) -> None:
    sandbox = BwrapSandbox(SPEC)
    with pytest.raises(SandboxError, match="not started"):
        await sandbox.fork(1)
    async with sandbox:
        with pytest.raises(ValueError):
            await sandbox.fork(0)
    with pytest.raises(SandboxError, match="closed"):
        await sandbox.fork(1)
    assert leftovers(private_tmp) == []
