"""Sandbox life cycles, measured in one run: (a) start -> first command -> close on each backend, and (b) a GRPO group
of 8 sandboxes made ready from one forked SWE-style init versus 8 fresh inits.

(a) ours-bwrap (with and without a disk of its own), ours-apptainer and NeMo Gym's own `apptainer` provider on the
same SIF, taking turns round after round; goals: bwrap <= 30 ms and Apptainer <= 0.6 s (p50), the disk <= 1.0x.
(b) a repository with a C extension, committed, installed editable, built and imported: 8 fresh inits at once
against one init handed to `fork(8, close=True)`, timed until all 8 are ready, with the group's CPU time beside it
(`--native-modules 0`: a pure-Python package). The last line is the ratio of the medians (goal >= 5x).

Design notes: docs/benchmarks.md#benchsandboxpy
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import resource
import statistics
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from nemo_gym.sandbox import SandboxSpec as GymSandboxSpec

from nemo_gym_prorl.bench.tools import default_images, gym_sandbox, p50_p95, take_turns
from nemo_gym_prorl.contracts.sandbox import Sandbox, SandboxLimits, SandboxSpec
from nemo_gym_prorl.gym.sandbox_providers import gym_apptainer_config
from nemo_gym_prorl.sandbox.apptainer import ApptainerSandbox
from nemo_gym_prorl.sandbox.bwrap import BwrapSandbox

# -- (a) start -> first command -> close ---------------------------------------------------------------------------


@dataclass
class Lifecycle:
    name: str
    goal_s: float | None
    cycle: Callable[[], Awaitable[tuple[float, float, float]]]
    samples: list[tuple[float, float, float]] = field(default_factory=list)  # start, first command, close

    async def measure(self) -> None:
        self.samples.append(await self.cycle())

    def totals(self) -> list[float]:
        return [sum(phases) for phases in self.samples]


def our_cycle(make: Callable[[], Sandbox]) -> Callable[[], Awaitable[tuple[float, float, float]]]:
    async def cycle() -> tuple[float, float, float]:
        sandbox = make()
        t0 = time.perf_counter()
        try:
            await sandbox.start()
            t1 = time.perf_counter()
            result = await sandbox.run("echo hi", 30)
            t2 = time.perf_counter()
        finally:
            await sandbox.close()
        t3 = time.perf_counter()
        if result.output != "hi\n":
            raise RuntimeError(f"{type(sandbox).__name__} answered {result.output!r}")
        return t1 - t0, t2 - t1, t3 - t2

    return cycle


def gym_apptainer_cycle(sif: str) -> Callable[[], Awaitable[tuple[float, float, float]]]:
    async def cycle() -> tuple[float, float, float]:
        t0 = time.perf_counter()
        async with gym_sandbox(gym_apptainer_config(), GymSandboxSpec(image=sif, workdir="/sandbox")) as box:
            t1 = time.perf_counter()
            result = await box.exec("echo hi", timeout_s=30)
            t2 = time.perf_counter()
            await box.stop()  # the context's own stop is then a no-op; it also removes Gym's instance logs
            t3 = time.perf_counter()
        if result.stdout != "hi\n":
            raise RuntimeError(f"Gym's apptainer provider answered {result!r}")
        return t1 - t0, t2 - t1, t3 - t2

    return cycle


async def lifecycles(rootfs: str, sif: str, rounds: int, apptainer: bool) -> None:
    no_disk = SandboxSpec(image=rootfs, limits=SandboxLimits(disk_mb=None))
    sides = [
        Lifecycle("ours, bwrap", 0.030, our_cycle(lambda: BwrapSandbox(SandboxSpec(image=rootfs)))),
        Lifecycle("ours, bwrap, no disk", 0.030, our_cycle(lambda: BwrapSandbox(no_disk))),
    ]
    if apptainer:
        sides += [
            Lifecycle("ours, Apptainer instance", 0.6, our_cycle(lambda: ApptainerSandbox(SandboxSpec(image=sif)))),
            Lifecycle("NeMo Gym apptainer provider", None, gym_apptainer_cycle(sif)),
        ]
    await take_turns(sides, rounds, warmup=1)  # warm-up: page cache, Python imports
    print(f"(a) start -> first command -> close, {rounds} rounds per side (p50 of each phase; total p50/p95):")
    for side in sides:
        start, first, close = (statistics.median(phase) for phase in zip(*side.samples, strict=True))
        p50, p95 = p50_p95(side.totals())
        goal = f"   (goal <= {side.goal_s * 1e3:g} ms)" if side.goal_s is not None else ""
        print(
            f"  {side.name:<28} start {start * 1e3:7.1f}  first command {first * 1e3:6.1f}  close {close * 1e3:7.1f}"
            f"  total p50 {p50 * 1e3:7.1f} ms  p95 {p95 * 1e3:7.1f} ms{goal}"
        )
    bwrap, no_disk, *apptainers = (statistics.median(side.totals()) for side in sides)
    print(f"  ours-bwrap with its disk / without (p50 start -> close): {bwrap / no_disk:.2f}x (goal <= 1.0x)")
    if apptainers:
        ours, gym = apptainers
        print(f"  ours-apptainer vs Gym apptainer (p50): {gym / ours:.1f}x faster; ours-bwrap vs Gym: {gym / bwrap:.0f}x")


# -- (b) a GRPO group from one forked init ---------------------------------------------------------------------------

MAKE_REPO = '''
import os, sys, textwrap
root, n_files, n_native = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
modules = n_files // 2
os.makedirs(f"{root}/src/benchpkg")
os.makedirs(f"{root}/tests")
os.makedirs(f"{root}/native")
def write(path, text):
    with open(f"{root}/{path}", "w") as f:
        f.write(textwrap.dedent(text).lstrip())
write("pyproject.toml", """
    [project]
    name = "benchpkg"
    version = "0.1.0"
    [tool.setuptools.packages.find]
    where = ["src"]
""")
write("README.md", "# benchpkg\\n\\nA package of generated modules.\\n")
write(".gitignore", "__pycache__/\\n*.pyc\\nbuild/\\n*.so\\n")
write("src/benchpkg/__init__.py", "".join(f"from benchpkg import mod_{i}\\n" for i in range(0, modules, 25)))
for i in range(modules):
    write(f"src/benchpkg/mod_{i}.py", f"""
        \\"\\"\\"Module {i}: records, parsing and a small state machine.\\"\\"\\"
        from __future__ import annotations

        import dataclasses
        import enum
        import re

        PATTERN_{i} = re.compile(r"(?P<key>[a-z_]+)=(?P<value>\\\\d+)")


        class State{i}(enum.Enum):
            IDLE = 0
            RUNNING = 1
            DONE = 2


        @dataclasses.dataclass
        class Record{i}:
            key: str
            value: int
            tags: list[str] = dataclasses.field(default_factory=list)

            def scaled(self, factor: int = {i % 7 + 2}) -> int:
                return self.value * factor + len(self.tags)


        def parse_{i}(text: str) -> list[Record{i}]:
            records = []
            for match in PATTERN_{i}.finditer(text):
                records.append(Record{i}(match["key"], int(match["value"])))
            return records


        def step_{i}(state: State{i}, budget: int) -> tuple[State{i}, int]:
            if state is State{i}.IDLE:
                return State{i}.RUNNING, budget
            if state is State{i}.RUNNING and budget > 0:
                return State{i}.RUNNING, budget - 1
            return State{i}.DONE, 0


        def summarize_{i}(records: list[Record{i}]) -> dict[str, int]:
            totals: dict[str, int] = {{}}
            for record in records:
                totals[record.key] = totals.get(record.key, 0) + record.scaled()
            return dict(sorted(totals.items()))
    """)
    write(f"tests/test_mod_{i}.py", f"""
        from benchpkg.mod_{i} import State{i}, parse_{i}, step_{i}, summarize_{i}


        def test_parse_and_summarize():
            records = parse_{i}("a=1 b=2 a=3")
            assert [r.key for r in records] == ["a", "b", "a"]
            assert summarize_{i}(records) == {{"a": {(1 + 3) * (i % 7 + 2)}, "b": {2 * (i % 7 + 2)}}}


        def test_state_machine():
            state, budget = State{i}.IDLE, 2
            while state is not State{i}.DONE:
                state, budget = step_{i}(state, budget)
            assert budget == 0
    """)

# The C extension benchpkg._native: n_native sources of 40 small loops each, one function per source exported.
write("Makefile", """
    PY ?= python3
    INCLUDE := $(shell $(PY) -c 'import sysconfig; print(sysconfig.get_paths()["include"])')
    SUFFIX := $(shell $(PY) -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')
    OBJECTS := $(patsubst native/%.c,build/%.o,$(wildcard native/*.c))
    src/benchpkg/_native$(SUFFIX): $(OBJECTS)
    \\t$(CC) -shared -o $@ $^
    build/%.o: native/%.c | build
    \\t$(CC) -O2 -fPIC -I$(INCLUDE) -c $< -o $@
    build:
    \\tmkdir -p build
""")
for i in range(n_native):
    loops = "".join(f"""
        static long f_{i}_{j}(long x) {{
            long acc = {j + 1};
            for (long k = 0; k < x; k++) {{
                acc = (acc * {31 + j} + k) % 1000003;
                if (acc & 1) acc ^= k << {j % 7 + 1};
                else acc += (k * k) % {j + 3};
            }}
            return acc;
        }}
    """ for j in range(40))
    total = " + ".join(f"f_{i}_{j}(x)" for j in range(40))
    write(f"native/part_{i}.c", f"""
        #define PY_SSIZE_T_CLEAN
        #include <Python.h>
        {loops}
        PyObject *native_{i}(PyObject *self, PyObject *arg) {{
            long x = PyLong_AsLong(arg);
            if (x == -1 && PyErr_Occurred()) return NULL;
            return PyLong_FromLong({total});
        }}
    """)
if n_native:
    declarations = "".join(f"PyObject *native_{i}(PyObject *, PyObject *);\\n" for i in range(n_native))
    methods = "".join(f'{{"f{i}", native_{i}, METH_O, NULL}},\\n' for i in range(n_native))
    write("native/module.c", f"""
        #define PY_SSIZE_T_CLEAN
        #include <Python.h>
        {declarations}
        static PyMethodDef methods[] = {{
        {methods}{{NULL, NULL, 0, NULL}}
        }};
        static struct PyModuleDef module = {{PyModuleDef_HEAD_INIT, "_native", NULL, -1, methods}};
        PyMODINIT_FUNC PyInit__native(void) {{ return PyModule_Create(&module); }}
    """)
'''

STAGE = """set -e
python3 /workspace/.stage/make_repo.py /workspace/repo {files} {native}
cd /workspace/repo
git init -q
git add -A
git -c user.name=bench -c user.email=bench@example.invalid commit -q -m 'initial import'
python3 -m venv --without-pip /workspace/.venv
site=$(/workspace/.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
echo /workspace/repo/src > "$site/benchpkg.pth"
if [ {native} -gt 0 ]; then make -s -j"$(nproc)" PY=/workspace/.venv/bin/python; fi
/workspace/.venv/bin/python -m compileall -q -j 0 src tests
/workspace/.venv/bin/python -c 'import benchpkg.mod_0'
echo staged
"""

READY = (
    "cd /workspace/repo && git status --porcelain && ../.venv/bin/python -c 'import benchpkg.mod_1' && "
    "if [ {native} -gt 0 ]; then ../.venv/bin/python -c 'from benchpkg import _native; _native.f0(100)'; fi && "
    "echo ready"
)


@dataclass(frozen=True)
class Workload:
    """The SWE-style repository: `files` Python files (modules and their tests) and `native` C sources."""

    files: int
    native: int

    def describe(self) -> str:
        extension = f", a C extension of {self.native} sources built with make -j" if self.native else ""
        return f"{self.files} files{extension}: git commit, venv, editable install, compileall"


async def init(sandbox: BwrapSandbox, workload: Workload) -> None:
    """Start `sandbox` and stage the SWE-style workspace in it."""
    await sandbox.start()
    await sandbox.write_file(".stage/make_repo.py", MAKE_REPO.encode())
    result = await sandbox.run(STAGE.format(files=workload.files, native=workload.native), 600)
    if result.exit_code != 0 or not result.output.endswith("staged\n"):
        raise RuntimeError(f"staging failed (exit {result.exit_code}):\n{result.output}")


async def check_ready(sandbox: Sandbox, workload: Workload) -> None:
    result = await sandbox.run(READY.format(native=workload.native), 120)
    if result.output != "ready\n":
        raise RuntimeError(f"sample not ready (exit {result.exit_code}):\n{result.output}")


def cpu_seconds() -> float:
    """CPU time of this process and of its descendants reaped so far."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


@dataclass
class GroupRun:
    ready_s: float
    cpu_s: float = 0.0
    init_s: float = 0.0


async def fresh_group(spec: SandboxSpec, group: int, workload: Workload) -> float:
    async with contextlib.AsyncExitStack() as stack:
        sandboxes = [BwrapSandbox(spec) for _ in range(group)]
        for sandbox in sandboxes:
            stack.push_async_callback(sandbox.close)
        started = time.perf_counter()

        async def sample(sandbox: BwrapSandbox) -> None:
            await init(sandbox, workload)
            await check_ready(sandbox, workload)

        await asyncio.gather(*(sample(s) for s in sandboxes))
        return time.perf_counter() - started


async def forked_group(spec: SandboxSpec, group: int, workload: Workload) -> tuple[float, float]:
    """(seconds until all are ready, seconds of which the one init took)."""
    async with contextlib.AsyncExitStack() as stack:
        parent = BwrapSandbox(spec)
        stack.push_async_callback(parent.close)
        started = time.perf_counter()
        await init(parent, workload)
        staged = time.perf_counter()
        forks = await parent.fork(group, close=True)
        for fork in forks:
            stack.push_async_callback(fork.close)
        await asyncio.gather(*(check_ready(f, workload) for f in forks))
        return time.perf_counter() - started, staged - started


async def measured(side: Callable[[], Awaitable[GroupRun]]) -> GroupRun:
    cpu = cpu_seconds()
    run = await side()  # returns once every sandbox of the group is closed (and reaped)
    run.cpu_s = cpu_seconds() - cpu
    return run


async def fork_groups(rootfs: str, group: int, workload: Workload, rounds: int) -> None:
    spec = SandboxSpec(image=rootfs)

    async def fresh() -> GroupRun:
        return GroupRun(await fresh_group(spec, group, workload))

    async def forked() -> GroupRun:
        ready, init_s = await forked_group(spec, group, workload)
        return GroupRun(ready, init_s=init_s)

    fresh_runs, forked_runs = [], []
    print(f"(b) GRPO group of {group}, SWE-style init ({workload.describe()}):")
    for r in range(rounds):
        order = (fresh, forked) if r % 2 == 0 else (forked, fresh)
        runs = {side: await measured(side) for side in order}
        fresh_runs.append(runs[fresh])
        forked_runs.append(runs[forked])
        print(
            f"  round {r + 1}/{rounds}: {group} fresh inits {runs[fresh].ready_s:.2f} s ({runs[fresh].cpu_s:.1f} CPU s)"
            f"   1 init + fork({group}) {runs[forked].ready_s:.2f} s ({runs[forked].cpu_s:.1f} CPU s)"
        )

    def median(runs: list[GroupRun], field: str) -> float:
        return statistics.median(getattr(run, field) for run in runs)

    one_init, fresh_s, forked_s = (median(forked_runs, "init_s"), median(fresh_runs, "ready_s"),
                                   median(forked_runs, "ready_s"))  # fmt: skip
    fresh_cpu, forked_cpu = median(fresh_runs, "cpu_s"), median(forked_runs, "cpu_s")
    print(f"  one init alone (start + staging): {one_init:.2f} s")
    print(f"  {group} fresh inits at once, until all ready: {fresh_s:.2f} s, {fresh_cpu:.1f} CPU s")
    print(f"  1 init + fork({group}, close=True), until all ready: {forked_s:.2f} s, {forked_cpu:.1f} CPU s")
    print(f"  bound for any fork here: fresh / one init = {fresh_s / one_init:.1f}x")
    print(f"  CPU ratio (fresh / forked): {fresh_cpu / forked_cpu:.1f}x")
    print(f"fork ratio (fresh / forked, time until all {group} ready): {fresh_s / forked_s:.1f}x (goal >= 5x)")


async def _run(args: argparse.Namespace, workload: Workload) -> None:
    rootfs, sif = default_images()
    if not args.skip_lifecycle:
        await lifecycles(rootfs, sif, args.rounds, apptainer=not args.skip_apptainer)
    if not args.skip_forks:
        await fork_groups(rootfs, args.group, workload, args.fork_rounds)


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="prorl bench sandbox")
    parser.add_argument("--rounds", type=int, default=20, help="start/command/close cycles per side")
    parser.add_argument("--group", type=int, default=8, help="samples per GRPO group")
    parser.add_argument("--files", type=int, default=400, help="Python files in the staged repository")
    parser.add_argument("--native-modules", type=int, default=16, help="C sources of its extension (0: none)")
    parser.add_argument("--fork-rounds", type=int, default=3, help="fresh-vs-forked group comparisons")
    parser.add_argument("--skip-lifecycle", action="store_true", help="only (b)")
    parser.add_argument("--skip-forks", action="store_true", help="only (a)")
    parser.add_argument("--skip-apptainer", action="store_true", help="(a) on bwrap alone (with and without a disk)")
    args = parser.parse_args(argv)
    if args.rounds < 2 or args.fork_rounds < 1 or args.native_modules < 0:
        parser.error("--rounds must be >= 2, --fork-rounds >= 1 and --native-modules >= 0")
    if args.skip_lifecycle and args.skip_forks:
        parser.error("--skip-lifecycle and --skip-forks leave nothing to measure")
    asyncio.run(_run(args, Workload(args.files, args.native_modules)))
