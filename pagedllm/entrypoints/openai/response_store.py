"""Stored responses of ``/v1/responses``: one SQLite file that every front-end of a server opens.

A server with several front-end processes (``--api-server-count``, data parallel) gives them one file
in a directory the launcher creates and removes; a single front-end makes its own. So a response
stored through one front-end is read, continued (``previous_response_id``), cancelled or deleted
through any other.

Invariants:

- An entry belongs to the API key that created it (``owner``: a digest of the key; ``""`` on a
  server without keys) and every read, write and delete names that owner: another key's entry is
  "not found", exactly as a missing one.
- At most ``max_entries`` entries and ``max_bytes`` bytes of stored JSON are kept. After each write
  the least recently used entries are evicted until both bounds hold, except entries still running
  (``queued``/``in_progress``: a background response is never lost while it runs) and the entry just
  written (so one entry larger than ``max_bytes`` stays until the next write). Reading an entry
  (GET, ``previous_response_id``, input items) counts as a use.
- A cancelled entry stays cancelled: the final write of a running response only lands while the
  entry is still running and not cancelled (``finish``), so a cancel and the end of generation can
  race in any order and the stored status is the first of the two.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import sqlite3
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Any

# Statuses of a response that is still being generated (in the background).
RUNNING = ("queued", "in_progress")

DEFAULT_MAX_ENTRIES = 1000
DEFAULT_MAX_BYTES = 256 * 1024 * 1024
STORE_FILE = "responses.sqlite3"

_SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    id TEXT PRIMARY KEY,
    owner TEXT NOT NULL,
    status TEXT NOT NULL,
    response TEXT NOT NULL,  -- the Response object's JSON
    context TEXT NOT NULL,   -- the JSON list of input items it answered (earlier turns included)
    nbytes INTEGER NOT NULL,
    used REAL NOT NULL,      -- time of the last write or read (the LRU order)
    cancelled INTEGER NOT NULL DEFAULT 0
)
"""


def owner_of(api_key: str | None) -> str:
    """The owner recorded for requests made with ``api_key`` (never the key itself)."""
    if not api_key:
        return ""
    return hashlib.sha256(b"pagedllm-responses\0" + api_key.encode()).hexdigest()[:32]


@dataclass
class StoredResponse:
    id: str
    status: str
    response: dict[str, Any]  # the Response object as returned by GET
    context: list[dict[str, Any]]  # the input items it answered, those of earlier responses first
    cancelled: bool


@dataclass
class StoreLimits:
    max_entries: int = DEFAULT_MAX_ENTRIES
    max_bytes: int = DEFAULT_MAX_BYTES

    def __post_init__(self) -> None:
        if self.max_entries < 1:
            raise ValueError(f"responses store max {self.max_entries}: must be at least 1")
        if self.max_bytes < 1:
            raise ValueError(f"responses store max bytes {self.max_bytes}: must be at least 1")


class ResponseStore:
    """The store in the file ``responses.sqlite3`` of ``directory`` (created when missing; with no
    directory, a private one made at the first use and removed by :meth:`close`). Nothing touches
    the disk before the first call. Thread-safe; every call is a short transaction, so callers on an
    event loop run them with ``asyncio.to_thread``."""

    def __init__(self, directory: str | None = None, limits: StoreLimits | None = None) -> None:
        self.directory = directory
        self.limits = limits or StoreLimits()
        self._owns_directory = directory is None
        self._lock = threading.Lock()
        self._conn: sqlite3.Connection | None = None

    @property
    def _db(self) -> sqlite3.Connection:
        """The connection, opened at the first use (call with the lock held)."""
        if self._conn is None:
            if self.directory is None:
                self.directory = tempfile.mkdtemp(prefix="pagedllm-responses-")
            path = os.path.join(self.directory, STORE_FILE)
            conn = sqlite3.connect(path, timeout=30.0, check_same_thread=False, isolation_level=None)
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=NORMAL")
            conn.execute(_SCHEMA)
            self._conn = conn
        return self._conn

    def close(self) -> None:
        """Close the file (and remove the private directory, with what was stored)."""
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None
            if self._owns_directory and self.directory is not None:
                shutil.rmtree(self.directory, ignore_errors=True)
                self.directory = None

    # -- writes ---------------------------------------------------------------------------------

    def put(self, owner: str, response: dict[str, Any], context: list[dict[str, Any]]) -> None:
        """Store (or replace) ``response`` with the input items it answered, then evict."""
        body = json.dumps(response, ensure_ascii=False)
        items = json.dumps(context, ensure_ascii=False)
        with self._transaction() as db:
            db.execute(
                "INSERT OR REPLACE INTO responses (id, owner, status, response, context, nbytes, used)"
                " VALUES (?, ?, ?, ?, ?, ?, ?)",
                (response["id"], owner, response["status"], body, items, len(body) + len(items), time.time()),
            )
            self._evict(db, keep=response["id"])

    def finish(self, owner: str, response: dict[str, Any]) -> bool:
        """Replace a running entry's response with ``response`` (its new status); False when the
        entry was cancelled, deleted or evicted meanwhile (nothing changes then)."""
        body = json.dumps(response, ensure_ascii=False)
        with self._transaction() as db:
            row = db.execute(
                "SELECT length(context) FROM responses WHERE id = ? AND owner = ? AND cancelled = 0"
                f" AND status IN ({','.join('?' * len(RUNNING))})",
                (response["id"], owner, *RUNNING),
            ).fetchone()
            if row is None:
                return False
            db.execute(
                "UPDATE responses SET status = ?, response = ?, nbytes = ?, used = ? WHERE id = ?",
                (response["status"], body, len(body) + int(row[0]), time.time(), response["id"]),
            )
            self._evict(db, keep=response["id"])
            return True

    def cancel(self, owner: str, response_id: str) -> StoredResponse | None:
        """Mark a running entry cancelled (its response says ``cancelled``); the entry as it is now
        (cancelled or already finished), None when there is none for ``owner``."""
        with self._transaction() as db:
            found = self._read(db, owner, response_id)
            if found is None or found.status not in RUNNING:
                return found
            found.response["status"] = found.status = "cancelled"
            found.cancelled = True
            db.execute(
                "UPDATE responses SET status = 'cancelled', response = ?, cancelled = 1 WHERE id = ?",
                (json.dumps(found.response, ensure_ascii=False), response_id),
            )
            return found

    def delete(self, owner: str, response_id: str) -> bool:
        with self._transaction() as db:
            cursor = db.execute("DELETE FROM responses WHERE id = ? AND owner = ?", (response_id, owner))
            return cursor.rowcount > 0

    # -- reads ----------------------------------------------------------------------------------

    def get(self, owner: str, response_id: str) -> StoredResponse | None:
        """The entry (a use: it moves to the back of the eviction order); None for another owner's."""
        with self._transaction() as db:
            found = self._read(db, owner, response_id)
            if found is not None:
                db.execute("UPDATE responses SET used = ? WHERE id = ?", (time.time(), response_id))
            return found

    def should_stop(self, response_id: str) -> bool:
        """Whether a running entry was cancelled, deleted or evicted (its generation should stop)."""
        with self._lock:
            row = self._db.execute("SELECT cancelled FROM responses WHERE id = ?", (response_id,)).fetchone()
        return row is None or bool(row[0])

    def usage(self) -> tuple[int, int]:
        """(entries, bytes) held now."""
        with self._lock:
            count, nbytes = self._db.execute(
                "SELECT count(*), coalesce(sum(nbytes), 0) FROM responses"
            ).fetchone()
        return int(count), int(nbytes)

    # -- internals ------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _transaction(self) -> Any:
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    @staticmethod
    def _read(db: sqlite3.Connection, owner: str, response_id: str) -> StoredResponse | None:
        row = db.execute(
            "SELECT status, response, context, cancelled FROM responses WHERE id = ? AND owner = ?",
            (response_id, owner),
        ).fetchone()
        if row is None:
            return None
        return StoredResponse(response_id, row[0], json.loads(row[1]), json.loads(row[2]), bool(row[3]))

    def _evict(self, db: sqlite3.Connection, keep: str) -> None:
        count, nbytes = db.execute("SELECT count(*), coalesce(sum(nbytes), 0) FROM responses").fetchone()
        if count <= self.limits.max_entries and nbytes <= self.limits.max_bytes:
            return
        candidates = db.execute(
            "SELECT id, nbytes FROM responses WHERE id != ?"
            f" AND status NOT IN ({','.join('?' * len(RUNNING))}) ORDER BY used",
            (keep, *RUNNING),
        ).fetchall()
        doomed = []
        for response_id, size in candidates:
            if count <= self.limits.max_entries and nbytes <= self.limits.max_bytes:
                break
            doomed.append((response_id,))
            count -= 1
            nbytes -= size
        db.executemany("DELETE FROM responses WHERE id = ?", doomed)


def new_store_dir() -> str:
    """A private directory for the store shared by a server's front-ends (the caller removes it)."""
    return tempfile.mkdtemp(prefix="pagedllm-responses-")


__all__ = [
    "DEFAULT_MAX_BYTES",
    "DEFAULT_MAX_ENTRIES",
    "RUNNING",
    "ResponseStore",
    "StoreLimits",
    "StoredResponse",
    "new_store_dir",
    "owner_of",
]
