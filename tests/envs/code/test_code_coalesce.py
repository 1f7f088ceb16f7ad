"""The coalescer's edges: a cancelled rollout's grading does not keep a sandbox busy for nobody."""

from __future__ import annotations

import asyncio

from nemo_gym_prorl.envs.code.coalesce import Coalescer


async def test_a_batch_whose_callers_are_all_cancelled_is_cancelled_and_the_next_one_runs() -> None:
    started, cancelled = asyncio.Event(), asyncio.Event()

    async def batch(items: list[int]) -> list[int]:
        if items == [1]:
            started.set()
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                cancelled.set()
                raise
        return [i * 10 for i in items]

    coalescer = Coalescer(batch, slots=1, max_items=4)
    stuck = asyncio.create_task(coalescer.run([1]))
    await started.wait()
    queued = [asyncio.create_task(coalescer.run([i])) for i in (2, 3)]
    stuck.cancel()
    await asyncio.wait_for(cancelled.wait(), 5)
    assert await asyncio.gather(*queued) == [[20], [30]]


async def test_a_failing_batch_fails_each_of_its_callers() -> None:
    async def batch(items: list[int]) -> list[int]:
        raise RuntimeError("sandbox would not start")

    coalescer = Coalescer(batch, slots=1, max_items=4)
    results = await asyncio.gather(coalescer.run([1]), coalescer.run([2]), return_exceptions=True)
    assert [str(r) for r in results] == ["sandbox would not start"] * 2
