"""Runs untrusted programs against test inputs. This file is copied into a grading sandbox and runs there only.

    PRORL_GRADING_SANDBOX=1 python3 -I sandbox_runner.py JOB.json RESULTS.jsonl

Standard library only. Each test is a child forked off this runner, in a session of its own, with its output file
and CPU time bounded and real files on fds 0/1/2; after each problem every other process of the sandbox is killed,
and only then are its results written (one JSON line per problem). Expected outputs never enter the sandbox:
outputs and return values come back raw and are judged outside (`grading.py`).

Design notes (the job and result shapes): docs/code-and-stem.md#envscodesandbox_runnerpy
"""

import json
import os
import resource
import secrets
import select
import shutil
import signal
import sys
import time
import traceback

_STDERR_TAIL = 2000
SANDBOX_MARKER = "PRORL_GRADING_SANDBOX"


def _limit_self(output_cap: int, cpu_s: int) -> None:
    os.setsid()
    signal.signal(signal.SIGXFSZ, signal.SIG_DFL)  # Python ignores it; past the output cap the kernel stops us
    resource.setrlimit(resource.RLIMIT_FSIZE, (output_cap, output_cap))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 1))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


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


def _run_child(problem: dict, test_input: str, workdir: str, job: dict, token_fd: int, token: str) -> None:
    """In the forked child: limits, real stdio, then the program. Never returns."""
    code = 1
    try:
        _limit_self(job["output_cap_bytes"], int(job["timeout_s"]) + 1)
        os.chdir(workdir)
        _redirect(os.path.join(workdir, "stdin.txt"), os.path.join(workdir, "stdout.txt"),
                  os.path.join(workdir, "stderr.txt"))
        kind = problem["kind"]
        if kind == "bigcodebench":
            code = _run_unittest(problem, token_fd, token)
            return  # the finally below exits
        namespace = {"__name__": "__main__" if kind == "stdin" else "solution", "__builtins__": __builtins__}
        if kind != "humaneval" and job.get("prelude"):
            exec(compile(job["prelude"], "prelude.py", "exec"), namespace)
        compiled = compile(problem["program"], "solution.py", "exec")
        if kind == "stdin":
            sys.argv = ["solution.py"]
            exec(compiled, namespace)
        elif kind == "call":
            exec(compiled, namespace)
            fn_name = problem["fn_name"]
            if "class Solution" in problem["program"] and "Solution" in namespace:  # LeetCode style
                fn = getattr(namespace["Solution"](), fn_name, None)
            else:
                fn = namespace.get(fn_name)
            if fn is None:
                raise NameError(f"the program defines no {fn_name!r}")
            args = [json.loads(line) for line in test_input.split("\n") if line.strip()]
            value = fn(*args)
            with open(os.path.join(workdir, "return.json"), "w") as out:
                json.dump(value, out, default=repr)
        else:  # humaneval
            exec(compiled, namespace)
            exec(compile(problem["test"], "test.py", "exec"), namespace)
            namespace["check"](namespace[problem["entry_point"]])
            os.write(token_fd, token.encode())
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException as e:
        try:  # the program's own frames, not this runner's
            frames = [f for f in traceback.extract_tb(e.__traceback__) if f.filename != __file__]
            sys.stderr.write("Traceback (most recent call last):\n" + "".join(traceback.format_list(frames))
                             + "".join(traceback.format_exception_only(type(e), e)))
        except BaseException:
            pass
        code = 1
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        except BaseException:
            pass
        os._exit(code if 0 <= code < 256 else 1)


def _run_unittest(problem: dict, token_fd: int, token: str) -> int:
    """BigCodeBench's way (``bigcodebench.eval.unsafe_execute``): the program and its tests as one module
    ``__test__`` (``sys``, ``os`` and ``environ`` in scope, the clock in UTC, one BLAS thread, a headless matplotlib),
    then every test of its ``TestCases``; passed (0, the token written) when none failed or erred, else 1 with the
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
    os.write(token_fd, token.encode())
    return 0


def _wait(pid: int, timeout_s: float) -> "tuple[int | None, bool, float]":
    """(wait status, timed out, seconds) of child `pid`; a child past `timeout_s` is killed with its group."""
    start = time.monotonic()
    pidfd = os.pidfd_open(pid)
    try:
        ready, _, _ = select.select([pidfd], [], [], timeout_s)
    finally:
        os.close(pidfd)
    timed_out = not ready
    if timed_out:
        _kill_group(pid)
    _, status = os.waitpid(pid, 0)
    elapsed = time.monotonic() - start
    _kill_group(pid)  # whatever the test left running in its group
    _wait_until_group_gone(pid)
    return status, timed_out, elapsed


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


def _run_test(problem: dict, test_input: str, workdir: str, job: dict) -> dict:
    for name in ("stdout.txt", "stderr.txt", "return.json"):
        try:
            os.unlink(os.path.join(workdir, name))
        except FileNotFoundError:
            pass
    with open(os.path.join(workdir, "stdin.txt"), "w") as f:
        f.write(test_input)
    token = secrets.token_hex(16)
    read_end, write_end = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        os.close(read_end)
        _run_child(problem, test_input, workdir, job, write_end, token)
    os.close(write_end)
    status, timed_out, elapsed = _wait(pid, job["timeout_s"])
    os.set_blocking(read_end, False)  # a process the test left alive may hold the write end open
    try:
        reported = os.read(read_end, 64).decode(errors="replace")
    except BlockingIOError:
        reported = ""
    os.close(read_end)
    result = {
        "output": _read(os.path.join(workdir, "stdout.txt"), job["output_cap_bytes"]),
        "stderr": _tail(os.path.join(workdir, "stderr.txt")),
        "time_s": round(elapsed, 4),
        "exit_code": os.WEXITSTATUS(status) if os.WIFEXITED(status) else None,
        "signal": os.WTERMSIG(status) if os.WIFSIGNALED(status) else None,
    }
    if problem["kind"] == "call":
        result["return_json"] = _read(os.path.join(workdir, "return.json"), job["output_cap_bytes"]) or None
    if timed_out:
        result["status"] = "timeout"
    elif result["signal"] == signal.SIGXFSZ:
        result["status"] = "output_limit"
    elif result["signal"] == signal.SIGXCPU:
        result["status"] = "timeout"
    elif result["signal"] is not None:
        result["status"] = "killed"
    elif result["exit_code"] != 0:
        result["status"] = "runtime_error"
    elif problem["kind"] in ("humaneval", "bigcodebench") and reported != token:
        result["status"] = "runtime_error"
        result["stderr"] += "\n[the program exited before its tests finished]"
    else:
        result["status"] = "ok"
    return result


def _run_problem(problem: dict, job: dict, root: str) -> list:
    workdir = os.path.join(root, "p-" + secrets.token_hex(6))
    os.mkdir(workdir, 0o700)
    results = []
    try:
        line_counts = problem.get("line_counts") or []
        for i, test_input in enumerate(problem.get("inputs") or [""]):
            result = _run_test(problem, test_input, workdir, job)
            results.append(result)
            if job.get("stop_on_failure", True) and (
                result["status"] != "ok"
                or (i < len(line_counts) and len(result["output"].strip().split("\n")) != line_counts[i])
            ):
                break
    finally:
        _kill_everything_else()
        shutil.rmtree(workdir, ignore_errors=True)
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
