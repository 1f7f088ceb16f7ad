"""Where the viewer's rows come from: a JSONL file (read once, each row re-read from its bytes when opened), or a
running service's job store (followed as results arrive)."""

from __future__ import annotations

import mmap
import os
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import orjson

from nemo_gym_prorl.service.store import JobStore
from nemo_gym_prorl.telemetry.report import read_config_record
from nemo_gym_prorl.viewer.records import RowShapeError, Summary, summarize

_YIELD_EVERY = 8  # rows the background reader parses between two chances for the server's thread to run


class RolloutFileError(ValueError):
    """A file the viewer cannot show; the message names the file and line."""


class RolloutSource(Protocol):
    kind: str  # "file" or "service"
    title: str
    complete: threading.Event  # set once every row is in
    expected: int | None  # how many rows there will be, when known before they are read
    error: str | None  # what stopped the reading early

    def summaries(self) -> Sequence[Summary]: ...

    def row(self, index: int) -> dict[str, Any] | None: ...


class FileSource:
    """Every row of a JSONL file summarised; a row's full JSON is parsed again only when it is opened.

    The first `first_rows` rows are read before the source is returned, the rest by a thread of its own, so the
    first page shows at once however long the file; `complete` is set when every row is in (or a bad line stopped
    the reading: then `error` names its line, and the rows before it are shown). `expected` is an estimate until
    then."""

    kind = "file"

    def __init__(self, path: Path, task: str | None = None, first_rows: int = 100) -> None:
        self.path = path
        self.title = str(path)
        if task is None:
            tasks = read_config_record(path).get("tasks") or [{}]
            task = tasks[0].get("name") if isinstance(tasks[0], dict) else None
        self._task = task
        try:
            with path.open("rb") as file:  # mapped, not read: the first page needs only the first rows' bytes
                size = os.fstat(file.fileno()).st_size
                self._bytes: bytes | mmap.mmap = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) if size else b""
        except OSError as e:
            raise RolloutFileError(f"{path}: {e.strerror or e}") from None
        self.error: str | None = None
        self.complete = threading.Event()
        self._spans: list[tuple[int, int]] = []
        self._summaries: list[Summary] = []
        rest = self._read(0, 0, first_rows)
        if rest is None:
            self.expected: int | None = len(self._summaries)
            self.complete.set()
        else:  # until every row is read, the total shown is estimated from the first rows' length
            self.expected = round(size / (rest[0] / len(self._summaries))) if self._summaries else None
            threading.Thread(target=self._read_rest, args=rest, name=f"index {path.name}", daemon=True).start()

    def _read(self, start: int, line: int, limit: int | None) -> tuple[int, int] | None:
        """Rows from byte `start` (line number `line` before it) until `limit` rows are in; where to go on from, or
        None at the end of the file. A bad line raises RolloutFileError."""
        data, read = self._bytes, 0
        while start < len(data):
            if limit is not None and read >= limit:
                return start, line
            end = data.find(b"\n", start)
            end = len(data) if end < 0 else end
            line += 1
            chunk = data[start:end]
            if chunk.strip():
                try:
                    summary = summarize(len(self._spans), orjson.loads(chunk), self._task)
                except orjson.JSONDecodeError as e:
                    raise RolloutFileError(f"{self.path}:{line}: not JSON ({e.msg})") from None
                except RowShapeError as e:
                    raise RolloutFileError(f"{self.path}:{line}: {e}") from None
                self._spans.append((start, end))
                self._summaries.append(summary)
                read += 1
                if limit is None and read % _YIELD_EVERY == 0:
                    time.sleep(0)  # hand the interpreter to the server's thread: pages answer while this reads
            start = end + 1
        return None

    def _read_rest(self, start: int, line: int) -> None:
        try:
            self._read(start, line, None)
        except RolloutFileError as e:
            self.error = str(e)
        finally:
            self.expected = len(self._summaries)
            self.complete.set()

    def summaries(self) -> Sequence[Summary]:
        return self._summaries[:]  # a snapshot: the reading thread appends

    def row(self, index: int) -> dict[str, Any] | None:
        if not 0 <= index < len(self._spans):
            return None
        start, end = self._spans[index]
        return orjson.loads(self._bytes[start:end])


class StoreSource:
    """The results a running service has stored, in the order they were stored; new ones are read at each look."""

    kind = "service"

    def __init__(self, store: JobStore, default_task: str | None, title: str = "rollout service") -> None:
        self.title = title
        self._store = store
        self._default_task = default_task
        self.complete = threading.Event()
        self.complete.set()  # a look reads whatever is stored by then
        self.expected: int | None = None
        self.error: str | None = None
        self._lock = threading.Lock()
        self._rowid = 0
        self._positions: dict[tuple[str, int], int] = {}
        self._keys: list[tuple[str, int]] = []
        self._summaries: list[Summary] = []

    def summaries(self) -> Sequence[Summary]:
        with self._lock:
            for rowid, job_id, sample, task, trajectory in self._store.results_after(self._rowid):
                self._rowid = rowid
                key = (job_id, sample)
                index = self._positions.setdefault(key, len(self._keys))
                summary = summarize(index, orjson.loads(trajectory), task or self._default_task)
                if index == len(self._keys):
                    self._keys.append(key)
                    self._summaries.append(summary)
                else:
                    self._summaries[index] = summary
            return list(self._summaries)

    def row(self, index: int) -> dict[str, Any] | None:
        if not 0 <= index < len(self._keys):
            return None
        text = self._store.result_json(*self._keys[index])
        return orjson.loads(text) if text is not None else None
