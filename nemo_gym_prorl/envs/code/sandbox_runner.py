"""Runs untrusted programs against test inputs. This file is copied into a grading sandbox and runs there only.

    PRORL_GRADING_SANDBOX=1 python3 -I sandbox_runner.py JOB.json RESULTS.jsonl

Standard library only, and few modules of it (their imports are most of a grading sandbox's start). Each program
runs in a process forked off this runner, in a session of its own, with its output file and CPU time bounded; its
tests run there one after another, each with real files on fds 0/1/2 and a wall-clock limit this runner enforces
(a test that kills or hangs its process ends it; the next test gets a new one). After each problem every other
process of the sandbox is killed, and only then are its results written (one JSON line per problem). Expected
outputs never enter the sandbox: outputs and return values come back raw and are judged outside (`grading.py`).

Design notes (the job and result shapes): docs/code-and-stem.md#envscodesandbox_runnerpy
"""

import json
import os
import resource
import select
import signal
import sys
import time

_STDERR_TAIL = 2000
SANDBOX_MARKER = "PRORL_GRADING_SANDBOX"


def _limit_self(output_cap: int, cpu_s: int) -> None:
    os.setsid()
    signal.signal(signal.SIGXFSZ, signal.SIG_DFL)  # Python ignores it; past the output cap the kernel stops us
    resource.setrlimit(resource.RLIMIT_FSIZE, (output_cap, output_cap))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def _cpu_used() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _redirect(stdin_path: str, stdout_path: str, stderr_path: str) -> None:
    for fd, path, flags in (
        (0, stdin_path, os.O_RDONLY),
        (1, stdout_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
        (2, stderr_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
    ):
        opened = os.open(path, flags, 0o600)
        os.dup2(opened, fd)
        os.close(opened)
    sys.stdin = open(0, "r", closefd=False)
    sys.stdout = open(1, "w", closefd=False)
    sys.stderr = open(2, "w", closefd=False)


def _send(fd: int, nonce: str, message: dict) -> None:
    data = (nonce + " " + json.dumps(message) + "\n").encode()
    while data:
        data = data[os.write(fd, data):]


def _program_process(problem: dict, job: dict, workdir: str, start: int, report_fd: int, nonce: str) -> None:
    """In the forked child: the program's tests from `start` on, one after another in this one process (as
    LiveCodeBench runs them; a fork a test costs more than most tests), each in a namespace of its own with real
    files on fds 0/1/2, announced and reported on `report_fd`. Never returns."""
    code = 0
    try:
        inputs = problem.get("inputs") or [""]
        timeout_s = job["timeout_s"]
        cpu_cap = int(_cpu_used() + (len(inputs) - start) * (timeout_s + 1)) + 2
        _limit_self(job["output_cap_bytes"], cpu_cap)
        os.chdir(workdir)
        base: dict = {"__builtins__": __builtins__}
        if problem["kind"] != "humaneval" and job.get("prelude"):
            exec(compile(job["prelude"], "prelude.py", "exec"), base)
        program: list = []  # the compiled program, once
        for i in range(start, len(inputs)):
            _send(report_fd, nonce, {"start": i})
            soft = min(cpu_cap, int(_cpu_used() + timeout_s) + 1)
            resource.setrlimit(resource.RLIMIT_CPU, (soft, cpu_cap))
            result = _test_in_process(problem, i, inputs[i], workdir, base, program, job["output_cap_bytes"])
            _send(report_fd, nonce, {"result": i, **result})
    except BaseException:
        code = 70  # this runner's own failure, told on the test's stderr
        try:
            import traceback

            traceback.print_exc()
            sys.stderr.flush()
        except BaseException:
            pass
    finally:
        os._exit(code)


def _test_in_process(
    problem: dict, i: int, test_input: str, workdir: str, base: dict, program: list, output_cap: int
) -> dict:
    """Test `i` here; what it printed, returned and raised, and whether it got to the end."""
    stdout_path, stderr_path = os.path.join(workdir, "stdout.txt"), os.path.join(workdir, "stderr.txt")
    _redirect(os.path.join(workdir, f"in-{i}.txt"), stdout_path, stderr_path)
    kind, exit_code, completed, value = problem["kind"], 0, False, None
    started = time.monotonic()
    try:
        if kind == "bigcodebench":
            completed = _run_unittest(problem) == 0
            exit_code = 0 if completed else 1
        else:
            if not program:
                program.append(compile(problem["program"], "solution.py", "exec"))
            namespace = dict(base, __name__="__main__" if kind == "stdin" else "solution")
            if kind == "stdin":
                sys.argv = ["solution.py"]
                exec(program[0], namespace)
            elif kind == "call":
                exec(program[0], namespace)
                fn_name = problem["fn_name"]
                if "class Solution" in problem["program"] and "Solution" in namespace:  # LeetCode style
                    fn = getattr(namespace["Solution"](), fn_name, None)
                else:
                    fn = namespace.get(fn_name)
                if fn is None:
                    raise NameError(f"the program defines no {fn_name!r}")
                args = [json.loads(line) for line in test_input.split("\n") if line.strip()]
                value = json.dumps(fn(*args), default=repr)
            else:  # humaneval
                exec(program[0], namespace)
                exec(compile(problem["test"], "test.py", "exec"), namespace)
                namespace["check"](namespace[problem["entry_point"]])
                completed = True
    except SystemExit as e:
        exit_code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException as e:
        try:  # the program's own frames, not this runner's
            import traceback

            frames = [f for f in traceback.extract_tb(e.__traceback__) if f.filename != __file__]
            sys.stderr.write("Traceback (most recent call last):\n" + "".join(traceback.format_list(frames))
                             + "".join(traceback.format_exception_only(type(e), e)))
        except BaseException:
            pass
        exit_code = 1
    elapsed = time.monotonic() - started
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        try:
            stream.flush()
        except BaseException:
            pass
    return {"exit_code": exit_code if 0 <= exit_code < 256 else 1, "completed": completed, "return_json": value,
            "time_s": round(elapsed, 4), "output": _read(stdout_path, output_cap), "stderr": _tail(stderr_path)}


def _run_unittest(problem: dict) -> int:
    """BigCodeBench's way (``bigcodebench.eval.unsafe_execute``): the program and its tests as one module
    ``__test__`` (``sys``, ``os`` and ``environ`` in scope, the clock in UTC, one BLAS thread, a headless matplotlib),
    then every test of its ``TestCases``; passed (0) when none failed or erred, else 1 with the
    failures on stderr, ending in a line ``N of M tests failed: <their names>``."""
    import types
    import unittest

    os.environ.update(TZ="UTC", OMP_NUM_THREADS="1", MPLBACKEND="Agg")
    time.tzset()
    module = types.ModuleType("__test__")
    module.__dict__.update(__file__="__test__.py", sys=sys, os=os, environ=os.environ)
    exec(compile(problem["program"] + "\n" + problem["test"], "__test__.py", "exec"), module.__dict__)
    sys.modules["__test__"] = module
    suite = unittest.TestLoader().loadTestsFromTestCase(module.TestCases)
    result = unittest.TestResult()
    suite.run(result)
    issues = result.failures + result.errors
    if issues:
        names = [test.id().split(".")[-1] for test, _ in issues]
        for name, (_, trace) in zip(names, issues):  # each trace's end: where it failed and why
            sys.stderr.write("FAIL " + name + ": ..." + trace.strip()[-300:] + "\n")
        sys.stderr.write(str(len(issues)) + " of " + str(result.testsRun) + " tests failed: " + ", ".join(names) + "\n")
        return 1
    return 0


def _wait_until_group_gone(pgid: int, within_s: float = 10.0) -> None:
    """Until every process of the group is reaped (a killed process counts against the user's process limit
    until then): the next test must not fail to fork because a fork bomb's thousands of killed processes are
    still being reaped, which under load takes seconds. Bounded: a group that outlives it is left to the sweep."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            return
        time.sleep(0.01)


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _stat(pid: str) -> "tuple[int, str] | None":
    """(parent pid, state letter) of a visible process; None once it is gone."""
    try:
        with open("/proc/" + pid + "/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()  # after the command name, which may hold anything
    except (OSError, IndexError):
        return None
    return int(fields[1]), fields[0].decode()


def _ancestors() -> "set[int]":
    """This process and every one between it and the sandbox's init: the shell that started the runner (under
    Apptainer a process of the sandbox's user, not its init) must outlive the sweep."""
    chain, pid = set(), os.getpid()
    while pid > 1 and pid not in chain:
        chain.add(pid)
        info = _stat(str(pid))
        pid = info[0] if info is not None else 0
    return chain


def _others(protected: "set[int]") -> "list[tuple[int, str]] | None":
    """(pid, state letter) of each live process but the sandbox's init (pid 1) and `protected`; None when one of them
    runs as another user: then this is no sandbox with a pid namespace of its own (on a host, root's and other
    users' processes are visible), and nothing may be swept."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or entry == "1" or int(entry) in protected:
            continue
        try:
            if os.stat("/proc/" + entry).st_uid != os.geteuid():
                return None
        except FileNotFoundError:
            continue
        info = _stat(entry)
        if info is not None and info[1] not in "ZX":  # a zombie only waits for its parent
            found.append((int(entry), info[1]))
    return found


def _kill_everything_else(rounds: int = 500) -> None:
    """Every process but the sandbox's init, this runner and its ancestors: what a problem left behind (a daemon in
    a session of its own). Each round stops what still runs (a stopped process forks no more); a round that finds
    only stopped processes kills them all; done when none is left. Not `kill(-1)`: under Apptainer the shell that
    runs the runner is no init but a process of the same user, and would go too. Only where `_others` says this is
    a sandbox (outside one, this would kill the user's whole session)."""
    if os.geteuid() == 0:
        return
    protected = _ancestors()
    for _ in range(rounds):
        others = _others(protected)
        if not others:
            break
        running = [pid for pid, state in others if state not in "Tt"]
        for pid in running:
            _signal(pid, signal.SIGSTOP)
        if not running:
            for pid, _ in others:
                _signal(pid, signal.SIGKILL)
    try:
        while os.waitpid(-1, os.WNOHANG)[0]:
            pass
    except ChildProcessError:
        pass


def _signal(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except (ProcessLookupError, PermissionError):
        pass


def _read(path: str, limit: int) -> str:
    try:
        with open(path, "rb") as f:
            return f.read(limit).decode("utf-8", errors="replace")
    except OSError:
        return ""


def _tail(path: str) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - _STDERR_TAIL))
            return f.read().decode("utf-8", errors="replace")
    except OSError:
        return ""


def _status(problem: dict, facts: dict) -> dict:
    """A test's result: what its process reported or left (`facts`), and how it ended."""
    result = {"output": facts.get("output", ""), "stderr": facts.get("stderr", ""), "time_s": facts["time_s"],
              "exit_code": facts.get("exit_code"), "signal": facts.get("signal")}
    if problem["kind"] == "call":
        result["return_json"] = facts.get("return_json")
    if facts.get("timed_out"):
        result["status"] = "timeout"
    elif result["signal"] == signal.SIGXFSZ:
        result["status"] = "output_limit"
    elif result["signal"] == signal.SIGXCPU:
        result["status"] = "timeout"
    elif result["signal"] is not None:
        result["status"] = "killed"
    elif result["exit_code"] != 0:
        result["status"] = "runtime_error"
    elif problem["kind"] in ("humaneval", "bigcodebench") and not facts.get("completed"):
        result["status"] = "runtime_error"
        result["stderr"] += "\n[the program exited before its tests finished]"
    else:
        result["status"] = "ok"
    return result


def _failed(problem: dict, i: int, result: dict) -> bool:
    line_counts = problem.get("line_counts") or []
    return result["status"] != "ok" or (
        i < len(line_counts) and len(result["output"].strip().split("\n")) != line_counts[i]
    )


def _outputs(workdir: str, job: dict) -> dict:
    return {"output": _read(os.path.join(workdir, "stdout.txt"), job["output_cap_bytes"]),
            "stderr": _tail(os.path.join(workdir, "stderr.txt"))}


def _run_program(problem: dict, job: dict, workdir: str, start: int) -> "tuple[list, bool]":
    """Tests from `start` on in one program process: their results, and whether to stop (a failure under
    stop_on_failure). It ends early where a test kills it or overruns its wall-clock limit (then killed with its
    group); the caller starts another for the tests after that one."""
    nonce = os.urandom(16).hex()
    read_end, write_end = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        os.close(read_end)
        _program_process(problem, job, workdir, start, write_end, nonce)
    os.close(write_end)
    os.set_blocking(read_end, False)  # a process the program left alive may hold the write end open
    pidfd = os.pidfd_open(pid)
    results, current, started, pending, stop, timed_out = [], None, 0.0, b"", False, False
    try:
        while not stop:
            wait_s = None if current is None else max(0.0, started + job["timeout_s"] - time.monotonic())
            ready, _, _ = select.select([read_end, pidfd], [], [], wait_s)
            timed_out = not ready  # the current test overran its limit
            if timed_out:
                break
            try:
                while True:
                    chunk = os.read(read_end, 1 << 16)
                    if not chunk:
                        break
                    pending += chunk
            except BlockingIOError:
                pass
            *lines, pending = pending.split(b"\n")
            for line in lines:
                word, _, body = line.partition(b" ")
                if word.decode(errors="replace") != nonce:
                    continue
                message = json.loads(body)
                if "start" in message:
                    current, started = message["start"], time.monotonic()
                elif message.get("result") == current:
                    results.append(_status(problem, message))
                    stop = job.get("stop_on_failure", True) and _failed(problem, current, results[-1])
                    current = None
                    if stop:
                        break
            if pidfd in ready:
                break
        _kill_group(pid)
        _, status = os.waitpid(pid, 0)
        if current is not None:  # the test that overran or ended its process: what it left, and how it ended
            facts = {**_outputs(workdir, job), "time_s": round(time.monotonic() - started, 4), "timed_out": timed_out,
                     "exit_code": os.WEXITSTATUS(status) if os.WIFEXITED(status) else None,
                     "signal": os.WTERMSIG(status) if os.WIFSIGNALED(status) and not timed_out else None}
            results.append(_status(problem, facts))
            stop = job.get("stop_on_failure", True) and _failed(problem, current, results[-1])
    finally:
        os.close(pidfd)
        os.close(read_end)
        _kill_group(pid)
        _wait_until_group_gone(pid)
    return results, stop


def _remove_tree(path: str) -> None:
    """What a problem left in its directory, as far as it can go (``shutil`` would cost every program its import)."""
    for top, dirs, files in os.walk(path, topdown=False):
        for name in files + dirs:
            entry = os.path.join(top, name)
            try:
                if os.path.isdir(entry) and not os.path.islink(entry):
                    os.rmdir(entry)
                else:
                    os.unlink(entry)
            except OSError:
                pass
    try:
        os.rmdir(path)
    except OSError:
        pass


def _run_problem(problem: dict, job: dict, root: str) -> list:
    workdir = os.path.join(root, "p-" + os.urandom(6).hex())
    os.mkdir(workdir, 0o700)
    inputs = problem.get("inputs") or [""]
    results: list = []
    try:
        for i, test_input in enumerate(inputs):
            with open(os.path.join(workdir, f"in-{i}.txt"), "w") as f:
                f.write(test_input)
        while len(results) < len(inputs):
            more, stop = _run_program(problem, job, workdir, len(results))
            results += more
            if stop or not more:
                break
    finally:
        _kill_everything_else()
        _remove_tree(workdir)
    return results


def main() -> None:
    if os.environ.get(SANDBOX_MARKER) != "1" or os.geteuid() == 0:
        sys.exit(f"sandbox_runner runs model code: only inside a grading sandbox ({SANDBOX_MARKER}=1, "
                 "not root)")
    job_path, results_path = sys.argv[1], sys.argv[2]
    with open(job_path) as f:
        job = json.load(f)
    root = os.path.dirname(os.path.abspath(results_path))
    if job.get("prelude"):  # trusted; imported here once, so each test's child finds its modules loaded
        exec(compile(job["prelude"], "prelude.py", "exec"), {})
    for problem in job["problems"]:
        line = json.dumps({"id": problem["id"], "results": _run_problem(problem, job, root)}) + "\n"
        with open(results_path, "a") as f:  # after the problem's sweep: nothing of it is alive to interfere
            f.write(line)


if __name__ == "__main__":
    main()
