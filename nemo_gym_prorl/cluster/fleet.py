"""The head's rollout workers: started on every Ray node, placed by free sandbox slots, replaced when lost.

Each alive node gets ``ray.workers_per_node`` worker actors (default: the node's CPUs; a node offering none gets
none), pinned to it. A rollout goes to the node with the most free sandbox slots (each worker has
``sandbox_slots_per_worker``), and there to its least busy worker; with ``keep_group_on_node`` the samples of one
job (a GRPO group) follow the first to its node while any of them is live there. A worker that dies, or whose node
goes, is dropped at once; the head looks for nodes every ``node_poll_s`` and starts workers on those that lack them,
so a node that comes back is used again (its new workers sweep the sandboxes the dead ones left).

Ray sees a worker whose process is stopped or whose event loop is stuck (a blocking call, a livelock) as alive, and
its rollouts would wait for it forever. So the head pings each worker every ``worker_ping_interval_s`` (one tiny
call on the worker's event loop, however many rollouts it runs); one that has not answered within
``worker_unresponsive_s`` is killed (``ray.kill``: its calls fail at once, Ray kills the process a few seconds
later, its sandboxes die with it) and counted lost like a dead one, and a worker on its node sweeps what its
sandboxes left once its process is gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter
from typing import Any

import ray
from ray.exceptions import RayActorError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from nemo_gym_prorl.agent.loop import AgentLoop
from nemo_gym_prorl.cluster.fleet_pool import FleetPool
from nemo_gym_prorl.cluster.placement import WorkerRef
from nemo_gym_prorl.cluster.remote_rollout import RemoteAgentLoop, RemoteEnvironment
from nemo_gym_prorl.cluster.settings import RaySettings
from nemo_gym_prorl.cluster.worker import Backend, RolloutWorker, WorkerSpec
from nemo_gym_prorl.contracts.sampling import SamplingParams
from nemo_gym_prorl.envs import Environment
from nemo_gym_prorl.tool_calls import tool_call_format

_log = logging.getLogger(__name__)
_WORKER_START_S = 300.0


class NoWorkers(RuntimeError):
    """The cluster offers no node a worker can run on."""


class WorkerFleet:
    """``async with WorkerFleet(settings, spec, pool) as fleet``: workers up on every node until the block ends."""

    def __init__(self, settings: RaySettings, spec: WorkerSpec, pool: FleetPool) -> None:
        self.settings, self.spec, self.pool = settings, spec, pool
        self.workers: list[WorkerRef] = []
        self.lost_workers = 0
        self._groups: dict[str, tuple[str, int]] = {}  # group -> (its node, its rollouts holding a slot there)
        self._changed = asyncio.Event()
        self._refreshing = asyncio.Lock()
        self._started_ray = False
        self._poll: asyncio.Task[None] | None = None
        self._background: set[asyncio.Task[Any]] = set()  # liveness pings and sweeps after a kill
        self._unswept: dict[str, list[int]] = {}  # node -> pids of workers killed as unresponsive, not swept yet
        self._serial = 0

    # -- lifetime ---------------------------------------------------------------------------------------------------

    async def __aenter__(self) -> WorkerFleet:
        s = self.settings
        if not ray.is_initialized():
            if s.address is not None:
                ray.init(address=s.address, namespace=s.namespace, log_to_driver=False)
            else:
                # "local": a Ray of its own even where another runs on this machine (without it, ray.init joins
                # that one, then refuses num_cpus)
                ray.init(
                    address="local", num_cpus=s.local_workers, object_store_memory=s.object_store_mb << 20,
                    include_dashboard=False, namespace=s.namespace, log_to_driver=False,
                )  # fmt: skip
            self._started_ray = True
        try:
            await self.refresh()
            if not self.ready_workers():
                raise NoWorkers(
                    "no Ray node runs a rollout worker: every node offers 0 CPUs and ray.workers_per_node is unset"
                )
        except BaseException:
            await self.aclose()
            raise
        self.pool.attach(self)
        self._poll = asyncio.create_task(self._poll_nodes(), name="ray-node-poll")
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        tasks = [*self._background, *([self._poll] if self._poll is not None else [])]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        workers, self.workers = self.workers, []
        with contextlib.suppress(Exception):
            async with asyncio.timeout(60):
                await asyncio.gather(*(w.actor.shutdown.remote() for w in workers), return_exceptions=True)
        for worker in workers:
            with contextlib.suppress(Exception):
                ray.kill(worker.actor)
        if self._started_ray:
            ray.shutdown()
            self._started_ray = False

    # -- nodes and workers ------------------------------------------------------------------------------------------

    async def refresh(self) -> None:
        """Drop workers of nodes that are gone; start workers on alive nodes that lack them."""
        async with self._refreshing:
            nodes = {n["NodeID"]: n for n in await asyncio.to_thread(ray.nodes) if n["Alive"]}
            for worker in [w for w in self.workers if w.node_id not in nodes]:
                self._drop(worker)
            have = Counter(w.node_id for w in self.workers)
            new = [
                self._create(node_id)
                for node_id, node in nodes.items()
                for _ in range(self._wanted(node) - have[node_id])
            ]
            await asyncio.gather(*(self._ready(w) for w in new))

    def _wanted(self, node: dict[str, Any]) -> int:
        if self.settings.workers_per_node is not None:
            return self.settings.workers_per_node
        return int(node["Resources"].get("CPU", 0))

    def _create(self, node_id: str) -> WorkerRef:
        self._serial += 1
        pool = self.pool
        spec = self.spec.model_copy(
            update={"backends": pool.backend_list(), "paused": pool.paused, "policy_version": pool.policy_version}
        )
        actor = (
            ray.remote(RolloutWorker)
            .options(
                num_cpus=0, max_restarts=0, max_concurrency=self.settings.worker_max_concurrency,
                scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
            )  # fmt: skip
            .remote(spec)
        )
        worker = WorkerRef(actor, node_id, f"w{self._serial}", self.settings.sandbox_slots_per_worker)
        self.workers.append(worker)
        return worker

    async def _ready(self, worker: WorkerRef) -> None:
        try:
            async with asyncio.timeout(_WORKER_START_S):
                worker.info = await worker.actor.start.remote()
        except Exception as e:  # its node went meanwhile, or it could not start: the next poll tries again
            _log.warning("rollout worker %s on node %s did not start: %s", worker.name, worker.node_id, e)
            self._drop(worker)
            return
        worker.ready = True
        _log.info("rollout worker %s up on node %s (%s)", worker.name, worker.node_id, worker.info)
        worker.watch = self._spawn(self._watch(worker), f"ray-ping-{worker.name}")
        if pids := self._unswept.pop(worker.node_id, None):
            self._spawn(self._sweep_after(worker, pids), f"ray-sweep-{worker.name}")
        self._notify()

    def _drop(self, worker: WorkerRef) -> None:
        if worker in self.workers:
            self.workers.remove(worker)
            if worker.watch is not None and worker.watch is not asyncio.current_task():
                worker.watch.cancel()
            with contextlib.suppress(Exception):
                ray.kill(worker.actor)
            self._notify()

    def lost(self, worker: WorkerRef, error: BaseException | str) -> None:
        """`worker` is dead, or the head gave up on it: route nothing more to it, kill it (its calls in flight fail
        with Ray's actor error, which ends or re-runs their rollouts); the poll starts its replacement."""
        if worker in self.workers:
            self.lost_workers += 1
            worker.lost_reason = worker.lost_reason or (error if isinstance(error, str) else type(error).__name__)
            pid = worker.info.get("pid")
            _log.warning("rollout worker %s (pid %s) on node %s lost: %s", worker.name, pid, worker.node_id, error)
            self._drop(worker)

    async def _watch(self, worker: WorkerRef) -> None:
        """Ping `worker` every ``worker_ping_interval_s``; after ``worker_unresponsive_s`` without an answer it is
        lost (killed): Ray would call a stopped or wedged worker alive for as long as its process exists."""
        s = self.settings
        while worker in self.workers:
            await asyncio.sleep(s.worker_ping_interval_s)  # a period, not a synchronisation
            try:
                async with asyncio.timeout(s.worker_unresponsive_s):
                    await worker.actor.ping.remote()
            except TimeoutError:
                self._kill_unresponsive(worker)
            except RayActorError as e:  # died between two calls: nothing else would notice before a rollout
                self.lost(worker, e)
            except Exception as e:  # Ray's own trouble, not the worker's: ask again next period
                _log.warning("pinging rollout worker %s failed: %r", worker.name, e)

    def _kill_unresponsive(self, worker: WorkerRef) -> None:
        if worker not in self.workers:  # lost meanwhile by other means
            return
        self.lost(worker, f"unresponsive for {self.settings.worker_unresponsive_s:g} s, no answer to a ping")
        node = worker.node_id
        self._unswept.setdefault(node, []).append(worker.info["pid"])
        sweeper = next((w for w in self.ready_workers() if w.node_id == node), None)
        if sweeper is not None:  # else the node's next worker, once ready
            self._spawn(self._sweep_after(sweeper, self._unswept.pop(node)), f"ray-sweep-{sweeper.name}")

    async def _sweep_after(self, worker: WorkerRef, pids: list[int]) -> None:
        """Have `worker` sweep the sandbox leftovers of the killed workers `pids` of its node once they are gone."""
        try:
            swept = await worker.actor.sweep_after.remote(pids)
        except Exception as e:  # that worker went too: the node's next one sweeps at its start
            _log.warning("rollout worker %s could not sweep after killed workers %s: %s", worker.name, pids, e)
        else:
            _log.info("rollout worker %s swept %d sandbox(es) of killed workers %s", worker.name, len(swept), pids)

    def _spawn(self, coro: Any, name: str) -> asyncio.Task[Any]:
        task = asyncio.create_task(coro, name=name)
        self._background.add(task)
        task.add_done_callback(self._forget)
        return task

    def _forget(self, task: asyncio.Task[Any]) -> None:
        """A background task is over: a bug that ended it is said here (no task's exception goes unretrieved)."""
        self._background.discard(task)
        if not task.cancelled() and (error := task.exception()) is not None:
            _log.error("%s failed", task.get_name(), exc_info=error)

    async def _poll_nodes(self) -> None:
        while True:
            await asyncio.sleep(self.settings.node_poll_s)  # a period, not a synchronisation
            try:
                await self.refresh()
            except Exception as e:
                _log.warning("looking for Ray nodes failed: %s", e)

    def ready_workers(self) -> list[WorkerRef]:
        return [w for w in self.workers if w.ready]

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def _some_ready(self) -> list[WorkerRef]:
        while not (ready := self.ready_workers()):
            await self._changed.wait()
        return ready

    # -- placement --------------------------------------------------------------------------------------------------

    async def place(self, group: str) -> WorkerRef:
        """A worker for a new rollout of `group` (it holds one of the worker's sandbox slots until `release`)."""
        ready = await self._some_ready()
        node = None
        if self.settings.keep_group_on_node and group in self._groups:
            node = self._groups[group][0]
            if not any(w.node_id == node for w in ready):
                node = None
        if node is None:
            free: Counter[str] = Counter()
            live: Counter[str] = Counter()
            for w in ready:
                free[w.node_id] += w.slots - w.live
                live[w.node_id] += w.live
            node = max(free, key=lambda n: (free[n], -live[n]))
        worker = min((w for w in ready if w.node_id == node), key=lambda w: w.live)
        return self.place_on(worker, group)

    def place_on(self, worker: WorkerRef, group: str) -> WorkerRef:
        """`worker` for a rollout of `group` (one forked from its group's init there, or a new one): it holds one of
        the worker's sandbox slots until `release`."""
        worker.live += 1
        held = self._groups.get(group)
        self._groups[group] = (worker.node_id, held[1] + 1 if held and held[0] == worker.node_id else 1)
        return worker

    def release(self, worker: WorkerRef, group: str) -> None:
        worker.live -= 1
        held = self._groups.get(group)
        if held is not None and held[0] == worker.node_id:
            if held[1] <= 1:
                del self._groups[group]
            else:
                self._groups[group] = (held[0], held[1] - 1)

    async def any_worker(self, prefer: WorkerRef | None = None) -> WorkerRef:
        """A worker for work that holds no sandbox slot (grading): `prefer` while it lives, else the least busy."""
        ready = await self._some_ready()
        if prefer is not None and prefer in ready:
            return prefer
        return min(ready, key=lambda w: w.live)

    def bind(
        self, env: Environment, group: str, trajectory_id: str, sampling: SamplingParams
    ) -> tuple[Environment, AgentLoop]:
        """The orchestrator's `RemoteRollouts`: a rollout's environment and agent loop, run on the workers."""
        remote = RemoteEnvironment(env, self, group, trajectory_id)
        fmt = tool_call_format(env.task.tool_call_format or self.spec.model.tool_call_format)
        return remote, RemoteAgentLoop(remote, fmt, env.task.max_turns, trajectory_id, sampling)

    def status(self) -> dict[str, Any]:
        nodes: dict[str, dict[str, int]] = {}
        for w in self.ready_workers():
            node = nodes.setdefault(w.node_id, {"workers": 0, "slots": 0, "live": 0})
            node["workers"] += 1
            node["slots"] += w.slots
            node["live"] += w.live
        return {"nodes": nodes, "lost_workers": self.lost_workers}

    # -- model backends and weight sync (the head's pool calls these) -----------------------------------------------

    def add_backend(self, backend: Backend) -> None:
        for w in self.workers:
            w.actor.add_backend.remote(backend)

    def remove_backend(self, address: str) -> None:
        for w in self.workers:
            w.actor.remove_backend.remote(address)

    async def pause(self) -> None:
        """Every worker's requests stop; returns when none is at a model server (a lost worker has none)."""
        await asyncio.gather(*(w.actor.pause_llm.remote() for w in self.workers), return_exceptions=True)

    async def llm_waiting(self) -> int:
        """Model requests waiting on every worker (for a resume or a healthy backend)."""
        counts = await asyncio.gather(*(w.actor.llm_waiting.remote() for w in self.workers), return_exceptions=True)
        return sum(c for c in counts if isinstance(c, int))

    def resume(self, policy_version: int | None = None) -> None:
        for w in self.workers:
            w.actor.resume_llm.remote(policy_version)
