"""`prorl swe check`: every instance of a swe task is sound: its gold patch resolves and an empty patch does not,
graded by the SWE environment itself (fresh sandboxes, real tests, swebench's grading). The generator's gate is
the same check; this one runs it on a shipped suite (or any swe task), e.g. after changing the environment.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time

from pydantic import BaseModel

from nemo_gym_prorl.contracts.task import TaskInstance, load_task
from nemo_gym_prorl.envs.dataset import load_instances
from nemo_gym_prorl.envs.swe.env import SweEnvironment


class InstanceCheck(BaseModel):
    instance_id: str
    gold_resolves: bool
    empty_resolves: bool
    why: str = ""

    @property
    def sound(self) -> bool:
        return self.gold_resolves and not self.empty_resolves


async def check_instance(env: SweEnvironment, instance: TaskInstance) -> InstanceCheck:
    """Grade the instance's gold patch and an empty one, at once (`env` must run the tests for an empty patch:
    `skip_empty_patch: false`)."""
    if env.settings.skip_empty_patch:
        raise ValueError("check_instance needs an environment with skip_empty_patch: false")
    gold, empty = await asyncio.gather(
        env.grade(instance, {"patch": instance.data.get("patch") or ""}), env.grade(instance, {"patch": ""})
    )
    why = []
    if not gold.resolved:
        why.append(f"gold: {gold.details.get('reason')}")
    if empty.resolved:
        why.append("the empty patch resolves it")
    return InstanceCheck(instance_id=instance.instance_id, gold_resolves=gold.resolved,
                         empty_resolves=empty.resolved, why="; ".join(why))  # fmt: skip


async def check_task(
    task_name: str, backend: str, instance_ids: list[str] | None, limit: int | None, jobs: int = 1
) -> int:
    task = load_task(task_name)
    task.verifier = task.verifier | {"skip_empty_patch": False}
    env = SweEnvironment(task, backend)
    instances = load_instances(task.dataset)
    if instance_ids:
        unknown = set(instance_ids) - {i.instance_id for i in instances}
        if unknown:
            raise SystemExit(f"prorl swe check: no instance {', '.join(sorted(unknown))} in task {task_name}")
        instances = [i for i in instances if i.instance_id in instance_ids]
    instances = instances[:limit] if limit else instances
    started = time.perf_counter()
    slots = asyncio.Semaphore(jobs)
    done = 0

    async def one(instance: TaskInstance) -> bool:
        nonlocal done
        async with slots:
            result = await check_instance(env, instance)
        done += 1
        verdict = "ok" if result.sound else f"UNSOUND: {result.why}"
        print(f"[{done}/{len(instances)}] {result.instance_id}: {verdict}", flush=True)
        return result.sound

    unsound = (await asyncio.gather(*(one(i) for i in instances))).count(False)
    minutes = (time.perf_counter() - started) / 60
    print(f"{len(instances) - unsound}/{len(instances)} instances of {task_name} on {backend}: gold patch resolves, "
          f"empty patch does not ({minutes:.1f} min)")  # fmt: skip
    return 1 if unsound else 0


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="prorl swe check", description=__doc__.split("\n\n")[0])
    parser.add_argument("--task", default="swe/offline", help="a swe task (default: the shipped offline suite)")
    parser.add_argument("--backend", default="bwrap", help="sandbox backend (apptainer with an image: default-sif)")
    parser.add_argument("--instances", nargs="*", help="only these instance ids")
    parser.add_argument("--limit", type=int, help="only the first N instances")
    parser.add_argument("--jobs", type=int, default=1, help="instances checked at once (each grades two at once)")
    args = parser.parse_args(argv)
    return asyncio.run(check_task(args.task, args.backend, args.instances, args.limit, max(1, args.jobs)))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
