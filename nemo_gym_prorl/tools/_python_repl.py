"""The `python` tool's interpreter: a program copied into the sandbox and run there by the sandbox's own python3.

Two roles, one file (any Python >= 3.8, standard library only): ``repl.py serve FD``, the persistent interpreter on
a listening Unix socket, one namespace for its whole life; and ``repl.py call CELL --timeout T --grace G --tag TAG
--max-output N``, one tool call run in the sandbox's shell, which starts the interpreter when none answers, sends
the cell, interrupts it after T seconds (SIGINT; the group killed G seconds later) and prints TAG, a JSON status
line and the capped output. Everything lives in the directory holding this file (the workspace's `.prorl/python`).

Design notes: docs/sandboxes.md#tools_python_replpy
"""

import argparse
import ast
import builtins
import fcntl
import json
import linecache
import os
import signal
import socket
import subprocess
import sys
import time
import traceback

SOCKET = "repl.sock"
PIDFILE = "driver.pid"
LOCKFILE = "client.lock"
LOGFILE = "driver.log"
OUTPUT = "output"

STATE_DIR = os.path.dirname(os.path.abspath(__file__))
PROGRAM = os.path.abspath(__file__)


# -- the interpreter -------------------------------------------------------------------------------------------


class Interpreter:
    def __init__(self):
        self.namespace = {"__name__": "__main__", "__builtins__": builtins, "__doc__": None}
        self.executing = False
        self.shell_cwd = None
        self.cells = 0

    def on_sigint(self, signum, frame):
        if self.executing:
            raise KeyboardInterrupt

    def serve(self, listener):
        signal.signal(signal.SIGINT, self.on_sigint)
        while True:
            conn, _ = listener.accept()
            try:
                self.handle(conn)
            except (OSError, ValueError, KeyboardInterrupt):
                pass  # the caller went away, or an interrupt landed between cells: wait for the next one
            finally:
                conn.close()

    def handle(self, conn):
        data = b""
        while not data.endswith(b"\n"):
            chunk = conn.recv(1 << 20)
            if not chunk:
                return
            data += chunk
        request = json.loads(data.decode("utf-8"))
        cwd = request.get("cwd")
        if cwd and cwd != self.shell_cwd:
            self.shell_cwd = cwd
            try:
                os.chdir(cwd)
            except OSError:
                pass
        try:
            status = self.run_captured(request["code"], os.path.join(STATE_DIR, OUTPUT))
        except Exception as e:  # the cell could not even be set up (the state dir unwritable, say)
            status = f"internal-error: {type(e).__name__}: {e}"
        conn.sendall((json.dumps({"status": status}) + "\n").encode("utf-8"))

    def run_captured(self, code, output_path):
        """Run one cell with fds 1 and 2 on `output_path`; its status: ok, error, interrupted or exit."""
        fd = os.open(output_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        _flush()
        saved = os.dup(1), os.dup(2)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        try:
            return self.run_cell(code)
        except KeyboardInterrupt:  # landed after the cell, while reporting it
            return "interrupted"
        finally:
            _flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])

    def run_cell(self, code):
        self.cells += 1
        filename = f"<cell {self.cells}>"
        linecache.cache[filename] = (len(code), None, code.splitlines(True), filename)
        try:
            tree = ast.parse(code, filename, "exec")
        except (SyntaxError, ValueError) as e:
            sys.stderr.write("".join(traceback.format_exception_only(type(e), e)))
            return "error"
        last = None
        if tree.body and isinstance(tree.body[-1], ast.Expr):
            last = ast.Expression(tree.body.pop().value)
        self.executing = True
        try:
            exec(compile(tree, filename, "exec"), self.namespace)
            if last is not None:
                value = eval(compile(last, filename, "eval"), self.namespace)
                if value is not None:
                    self.namespace["_"] = value
                    print(repr(value))
            status = "ok"
        except KeyboardInterrupt as e:
            self.executing = False
            _print_exception(e)
            status = "interrupted"
        except SystemExit as e:
            self.executing = False
            sys.stderr.write(f"[SystemExit({e.code!r}) ignored: the interpreter keeps running]\n")
            status = "exit"
        except BaseException as e:
            self.executing = False
            _print_exception(e)
            status = "error"
        finally:
            self.executing = False
        return status


def _print_exception(e):
    """The traceback without this program's own frames (the cell's caller, the SIGINT handler)."""
    root = traceback.TracebackException(type(e), e, e.__traceback__)
    pending, seen = [root], set()
    while pending:
        te = pending.pop()
        if te is None or id(te) in seen:
            continue
        seen.add(id(te))
        te.stack = traceback.StackSummary.from_list([f for f in te.stack if f.filename != PROGRAM])
        pending += [te.__cause__, te.__context__]
    sys.stderr.write("".join(root.format()))


def _flush():
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass


def serve(fd):
    listener = socket.socket(fileno=fd)
    listener.set_inheritable(False)
    sys.path[0] = ""  # like the interactive interpreter: imports from the current directory, not from here
    sys.argv = [""]
    for stream in (sys.stdout, sys.stderr):
        stream.reconfigure(encoding="utf-8", errors="backslashreplace", line_buffering=True)
    Interpreter().serve(listener)


# -- one call --------------------------------------------------------------------------------------------------


def _is_interpreter(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
    except OSError:
        return False
    return PROGRAM.encode() in argv and b"serve" in argv


def _signal_group(pid, sig):
    if pid is not None and _is_interpreter(pid):
        try:
            os.killpg(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def _connect():
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(SOCKET)  # relative: the caller is in STATE_DIR
    except (FileNotFoundError, ConnectionRefusedError):
        sock.close()
        return None
    return sock


def _start_interpreter(cwd):
    try:
        os.unlink(SOCKET)
    except FileNotFoundError:
        pass
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind(SOCKET)
        listener.listen(4)
        with open(LOGFILE, "wb") as log:
            proc = subprocess.Popen(
                [sys.executable, PROGRAM, "serve", str(listener.fileno())],
                pass_fds=(listener.fileno(),),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=cwd,
                start_new_session=True,
            )
    finally:
        listener.close()
    with open(PIDFILE, "w") as f:
        f.write(str(proc.pid))
    return proc.pid


def _read_pid():
    try:
        with open(PIDFILE) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


class _Answer:
    """Reads the interpreter's one-line answer, within deadlines."""

    def __init__(self, sock):
        self.sock = sock
        self.data = b""

    def wait(self, timeout):
        """The answer's status, "timeout", or "eof" (the interpreter closed the connection: it died)."""
        deadline = time.monotonic() + timeout
        while b"\n" not in self.data:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return "timeout"
            self.sock.settimeout(remaining)
            try:
                chunk = self.sock.recv(65536)
            except socket.timeout:  # TimeoutError only from Python 3.10 on
                return "timeout"
            except OSError:
                return "eof"
            if not chunk:
                return "eof"
            self.data += chunk
        return json.loads(self.data.split(b"\n", 1)[0].decode("utf-8")).get("status", "error")


def _read_output(limit):
    try:
        with open(OUTPUT, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size <= limit:
                return f.read().decode("utf-8", "replace")
            head = f.read(limit // 2)
            f.seek(size - (limit - limit // 2))
            tail = f.read()
    except FileNotFoundError:
        return ""
    note = f"\n[... {size - len(head) - len(tail)} bytes of output truncated ...]\n"
    return head.decode("utf-8", "replace") + note + tail.decode("utf-8", "replace")


def _run_cell(sock, pid, code, cwd, args, notes):
    """Send the cell, await its answer within the timeout (then SIGINT, then SIGKILL); the call's status."""
    request = json.dumps({"code": code, "cwd": cwd}, ensure_ascii=True) + "\n"
    sock.sendall(request.encode("ascii"))
    answer = _Answer(sock)
    status = answer.wait(args.timeout)
    if status == "eof":
        notes.append(
            "[the Python interpreter exited while running this cell (os._exit, a crash, or it was killed, e.g. for "
            "memory); the next call starts a new one]"
        )
        return "exited"
    if status.startswith("internal-error"):
        notes.append(f"[python tool: {status}]")
        return "tool-error"
    if status != "timeout":
        return status
    _signal_group(pid, signal.SIGINT)
    if answer.wait(args.grace) != "timeout":
        notes.append(
            f"[timed out after {args.timeout:g}s: interrupted with KeyboardInterrupt; the interpreter and its "
            "variables survive]"
        )
        return "interrupted"
    _signal_group(pid, signal.SIGKILL)
    notes.append(
        f"[timed out after {args.timeout:g}s and did not stop on KeyboardInterrupt: the interpreter was killed; "
        "the next call starts a new one, without the variables and imports defined so far]"
    )
    return "killed"


def call(args):
    try:
        cwd = os.getcwd()
    except OSError:  # the shell's directory was removed
        cwd = None
    os.chdir(STATE_DIR)
    notes = []
    pid = None
    status = "error"
    try:
        with open(args.cell, encoding="utf-8", errors="replace") as f:
            code = f.read()
        os.unlink(args.cell)
        with open(LOCKFILE, "a") as lock:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
            sock = _connect()
            if sock is None:
                had_one = os.path.exists(PIDFILE)
                pid = _start_interpreter(cwd if cwd is not None else STATE_DIR)
                if had_one:
                    notes.append(
                        "[a new Python interpreter was started: variables and imports from earlier calls are gone]"
                    )
                sock = _connect()
                if sock is None:
                    raise RuntimeError(f"the Python interpreter did not start; see {os.path.join(STATE_DIR, LOGFILE)}")
            else:
                pid = _read_pid()
            with sock:
                status = _run_cell(sock, pid, code, cwd, args, notes)
    except KeyboardInterrupt:  # the shell interrupted this call: pass it on to the cell
        _signal_group(pid if pid is not None else _read_pid(), signal.SIGINT)
        status = "interrupted"
        notes.append("[interrupted]")
    except Exception as e:
        status = "tool-error"
        notes.append(f"[python tool error: {type(e).__name__}: {e}]")
    output = _read_output(args.max_output) if status not in ("tool-error",) else ""
    if notes and output and not output.endswith("\n"):
        output += "\n"
    text = output + "\n".join(notes)
    out = sys.stdout.buffer
    out.write(f"{args.tag} {json.dumps({'status': status})}\n".encode())
    out.write(text.encode("utf-8", "replace"))
    out.flush()


def main():
    parser = argparse.ArgumentParser(prog="repl.py")
    sub = parser.add_subparsers(dest="role", required=True)
    p_serve = sub.add_parser("serve")
    p_serve.add_argument("fd", type=int)
    p_call = sub.add_parser("call")
    p_call.add_argument("cell")
    p_call.add_argument("--timeout", type=float, required=True)
    p_call.add_argument("--grace", type=float, default=2.0)
    p_call.add_argument("--tag", required=True)
    p_call.add_argument("--max-output", type=int, default=32000)
    args = parser.parse_args()
    if args.role == "serve":
        serve(args.fd)
    else:
        call(args)


if __name__ == "__main__":
    main()
