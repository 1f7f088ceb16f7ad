"""Durable jobs and results: SQLite in WAL mode, so an accepted job or a finished result survives a crash.

Every write commits before the service answers about it. A consumer (a trainer) acknowledges the results it has
taken, so a restarted trainer's stream brings only the rest, each result once. After a restart, finished results are served as before;
jobs that were in flight come back re-queued (their unfinished samples run again) or failed with a clear error,
as configured — never silently gone.
"""

from __future__ import annotations

import json
import sqlite3
import time
from pathlib import Path
from typing import Any, Literal, NamedTuple

from pydantic import BaseModel

from nemo_gym_prorl.contracts.trajectory import Trajectory

JobState = Literal["queued", "running", "done", "cancelled"]
RecoveryPolicy = Literal["requeue", "fail"]

_SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    job_id TEXT PRIMARY KEY,
    request TEXT NOT NULL,
    n INTEGER NOT NULL,
    state TEXT NOT NULL,
    created REAL NOT NULL,
    updated REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS results (
    job_id TEXT NOT NULL REFERENCES jobs(job_id),
    sample INTEGER NOT NULL,
    trajectory TEXT NOT NULL,
    PRIMARY KEY (job_id, sample)
);
CREATE TABLE IF NOT EXISTS acknowledged (
    consumer TEXT NOT NULL,
    job_id TEXT NOT NULL REFERENCES jobs(job_id),
    sample INTEGER NOT NULL,
    PRIMARY KEY (consumer, job_id, sample)
);
"""


class StoredJob(BaseModel):
    job_id: str
    request: dict[str, Any]
    n: int
    state: JobState
    created: float
    updated: float


# In a query over `jobs`: how many samples of the row's job have a stored result.
_FINISHED = "(SELECT COUNT(*) FROM results WHERE results.job_id = jobs.job_id)"


class JobProgress(NamedTuple):
    n: int
    state: JobState
    finished: int  # samples with a stored result


class JobStore:
    """One SQLite file; ``":memory:"`` for a store that dies with the process."""

    def __init__(self, path: str | Path) -> None:
        if str(path) != ":memory:":
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(str(path), isolation_level=None, check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(_SCHEMA)

    def close(self) -> None:
        self._db.close()

    def add_job(self, job_id: str, request: dict[str, Any], n: int) -> None:
        """Record an accepted job; raises KeyError if the id is taken."""
        now = time.time()
        try:
            self._db.execute(
                "INSERT INTO jobs VALUES (?, ?, ?, 'queued', ?, ?)", (job_id, json.dumps(request), n, now, now)
            )
        except sqlite3.IntegrityError:
            raise KeyError(job_id) from None

    def set_state(self, job_id: str, state: JobState) -> None:
        self._db.execute("UPDATE jobs SET state = ?, updated = ? WHERE job_id = ?", (state, time.time(), job_id))

    def add_result(self, job_id: str, sample: int, trajectory: Trajectory) -> None:
        self._db.execute(
            "INSERT OR REPLACE INTO results VALUES (?, ?, ?)", (job_id, sample, trajectory.model_dump_json())
        )

    def job(self, job_id: str) -> StoredJob | None:
        row = self._db.execute(
            "SELECT job_id, request, n, state, created, updated FROM jobs WHERE job_id = ?", (job_id,)
        ).fetchone()
        return _job(row) if row else None

    def progress(self, job_id: str) -> JobProgress | None:
        """How far a job is, without reading its request or any result: cheap enough for every finished sample."""
        row = self._db.execute(f"SELECT n, state, {_FINISHED} FROM jobs WHERE job_id = ?", (job_id,)).fetchone()
        return JobProgress(*row) if row else None

    def finished(self, job_id: str) -> int:
        """How many samples of a job have a stored result."""
        return self._db.execute("SELECT COUNT(*) FROM results WHERE job_id = ?", (job_id,)).fetchone()[0]

    def result_samples(self, job_id: str) -> set[int]:
        return {s for (s,) in self._db.execute("SELECT sample FROM results WHERE job_id = ?", (job_id,))}

    def result_json(self, job_id: str, sample: int) -> str | None:
        """A finished sample's trajectory as stored: JSON, ready to send."""
        row = self._db.execute(
            "SELECT trajectory FROM results WHERE job_id = ? AND sample = ?", (job_id, sample)
        ).fetchone()
        return row[0] if row else None

    def results(self, job_id: str) -> dict[int, Trajectory]:
        rows = self._db.execute(
            "SELECT sample, trajectory FROM results WHERE job_id = ? ORDER BY sample", (job_id,)
        ).fetchall()
        return {sample: Trajectory.model_validate_json(text) for sample, text in rows}

    def acknowledge(self, consumer: str, job_id: str, samples: list[int]) -> None:
        """`consumer` has what it needs of these samples: its streams skip them from now on, across restarts."""
        self._db.executemany(
            "INSERT OR IGNORE INTO acknowledged VALUES (?, ?, ?)", [(consumer, job_id, s) for s in samples]
        )

    def acknowledged(self, consumer: str, job_id: str) -> set[int]:
        rows = self._db.execute("SELECT sample FROM acknowledged WHERE consumer = ? AND job_id = ?", (consumer, job_id))
        return {s for (s,) in rows}

    def results_after(self, rowid: int) -> list[tuple[int, str, int, str | None, str]]:
        """Results stored after SQLite row `rowid` (a rewritten result comes again, with a new row id), oldest first:
        (rowid, job_id, sample, the job's task as requested, trajectory JSON). For readers that follow the store."""
        return self._db.execute(
            "SELECT results.rowid, results.job_id, sample, json_extract(request, '$.task'), trajectory "
            "FROM results JOIN jobs ON jobs.job_id = results.job_id WHERE results.rowid > ? ORDER BY results.rowid",
            (rowid,),
        ).fetchall()

    def unfinished_jobs(self) -> list[StoredJob]:
        rows = self._db.execute(
            "SELECT job_id, request, n, state, created, updated FROM jobs WHERE state IN ('queued', 'running') "
            f"OR (state = 'cancelled' AND {_FINISHED} < n) "
            "ORDER BY created"
        ).fetchall()
        return [_job(row) for row in rows]

    def counts(self) -> dict[str, int]:
        return dict(self._db.execute("SELECT state, COUNT(*) FROM jobs GROUP BY state").fetchall())


def _job(row: tuple[Any, ...]) -> StoredJob:
    job_id, request, n, state, created, updated = row
    return StoredJob(job_id=job_id, request=json.loads(request), n=n, state=state, created=created, updated=updated)
