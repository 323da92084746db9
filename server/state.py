"""Optional persistence of the orchestrator's actions and results (SQLite, standard library).

With a state file, a restarted orchestrator resumes: queued actions queue again, stored results are
resent to clients that resubmit, and actions that were running when it died are reported failed
(they may have had side effects, so running them again could run them twice). Writes are batched
per loop turn in one transaction.

One orchestrator at a time uses a state file: it holds a lock on ``FILE.lock`` beside it for its whole
life, and a second one refuses to start, naming the first. The file records its layout (SQLite's
``user_version``); a file of another layout is refused at start rather than half read. A write that
fails (a full disk) raises :class:`StateWriteError`, and the orchestrator stops: serving on with its
memory and its file disagreeing would run again, after the next restart, what already ran.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import socket
import sqlite3
from dataclasses import dataclass
from pathlib import Path

from pydantic import ValidationError

from tangram_env.errors import TangramError, TangramRuntimeError, describe_validation_error
from tangram_env.protocol import Action, Result
from tangram_env.server.lifecycle import ACKED_IDS_KEPT

log = logging.getLogger(__name__)

#: The layout this code reads and writes, kept in the file's ``PRAGMA user_version``. Version 1 is the
#: first recorded one; files written before versions were recorded (0) with the same tables are adopted.
SCHEMA_VERSION = 1
#: The columns of each table, in order; a file whose tables differ is refused.
COLUMNS: dict[str, tuple[str, ...]] = {
    "actions": ("id", "owner", "action", "state", "result"),
    "acked": ("id",),
}
_SCHEMA = """
CREATE TABLE IF NOT EXISTS actions (
    id TEXT PRIMARY KEY,
    owner BLOB NOT NULL,
    action TEXT NOT NULL,
    state TEXT NOT NULL,
    result TEXT
);
CREATE TABLE IF NOT EXISTS acked (id TEXT PRIMARY KEY);
"""
# Acknowledged ids the file keeps: the newest ACKED_IDS_KEPT, as many as the orchestrator remembers.
# Rows of ``acked`` are only ever appended (rowid one past the largest) and trimmed from the oldest, so
# their rowids run without gaps.

#: State files this process holds (their lock files' device and inode): POSIX locks are per process,
#: so a second store opened here on the same file would take the lock again without noticing.
_HELD: set[tuple[int, int]] = set()


class StateFileError(TangramError):
    """The state file cannot be used: another orchestrator holds it, it is not a database, or its
    layout is not the one this version reads.
    """


class StateWriteError(TangramRuntimeError):
    """A write to the state file failed (a full disk, an I/O error): the orchestrator must stop."""


@dataclass
class Stored:
    """One action as the state file remembers it."""

    action: Action
    owner: bytes
    state: str
    result: Result | None


class StateStore:
    """The orchestrator's durable memory; call :meth:`commit` once per loop turn.

    Raises :class:`StateFileError` when the file is held by another orchestrator, is not a SQLite
    database, or has another layout.
    """

    def __init__(self, path: str | Path, *, acked_kept: int = ACKED_IDS_KEPT) -> None:
        self.path = Path(path)
        self.acked_kept = acked_kept
        self.failed: str | None = None  # why a write failed: nothing is written after that
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock_fd, self._lock_key = _lock(self.path)
        try:
            self._db = _open(self.path)
            try:
                with self._db:  # a file from before acknowledged ids were trimmed keeps them all
                    self._db.execute("BEGIN")
                    self._trim_acked()
            except sqlite3.Error as exc:
                self._db.close()
                raise StateFileError(
                    f"cannot write the state file {self.path}: {exc} ({_hint(exc)})"
                ) from exc
        except BaseException:
            _unlock(self._lock_fd, self._lock_key)
            raise
        self._ops: list[tuple[str, tuple[object, ...]]] = []
        self._acked_added = False

    def load(self) -> tuple[list[Stored], list[str]]:
        """Everything remembered: actions (with their state and result) and the acknowledged ids, oldest
        first (the newest ``acked_kept``).

        A row this version cannot read (written by another version) is skipped with a warning naming its
        id; if it had started, its id is returned as acknowledged, so that it is never run again.
        """
        stored: list[Stored] = []
        ran: list[str] = []
        try:
            rows = self._db.execute("SELECT id, owner, action, state, result FROM actions ORDER BY rowid")
            for action_id, owner, action, state, result in rows:
                try:
                    stored.append(
                        Stored(
                            Action.model_validate_json(action),
                            bytes(owner),
                            state,
                            Result.model_validate_json(result) if result else None,
                        )
                    )
                except (ValidationError, ValueError, TypeError) as exc:
                    why = describe_validation_error(exc) if isinstance(exc, ValidationError) else str(exc)
                    then = "refused as a duplicate" if state != "queued" else "run as a new action"
                    log.warning(
                        "not restoring action %r from %s: its row does not parse (%s; written by another "
                        "version?); a resubmission of that id is %s",
                        action_id,
                        self.path,
                        why,
                        then,
                    )
                    if state != "queued":  # it may have run: never again
                        ran.append(action_id)
            newest = self._db.execute(
                "SELECT id FROM acked ORDER BY rowid DESC LIMIT ?", (self.acked_kept,)
            ).fetchall()
        except sqlite3.DatabaseError as exc:
            raise StateFileError(
                f"cannot read the state file {self.path}: {exc} ({_hint(exc)}); give the server another "
                "--state-db (or move this one away)"
            ) from exc
        return stored, [row[0] for row in reversed(newest)] + ran

    def added(self, action: Action, owner: bytes) -> None:
        """A new action entered the queue."""
        self._ops.append(
            (
                "INSERT OR REPLACE INTO actions VALUES (?, ?, ?, 'queued', NULL)",
                (action.id, owner, action.model_dump_json()),
            )
        )

    def started(self, action_id: str) -> None:
        """The action was handed to a worker."""
        self._ops.append(("UPDATE actions SET state='running' WHERE id=?", (action_id,)))

    def requeued(self, action_id: str) -> None:
        """The action is waiting again (its worker was lost)."""
        self._ops.append(("UPDATE actions SET state='queued' WHERE id=?", (action_id,)))

    def finished(self, result: Result) -> None:
        """The action has its result."""
        self._ops.append(
            (
                "UPDATE actions SET state='done', result=? WHERE id=?",
                (result.model_dump_json(), result.action_id),
            )
        )

    def acknowledged(self, action_id: str) -> None:
        """The client has the result: forget it, but remember that the id ran."""
        self._ops.append(("DELETE FROM actions WHERE id=?", (action_id,)))
        self._ops.append(("INSERT OR IGNORE INTO acked VALUES (?)", (action_id,)))
        self._acked_added = True

    def expired(self, action_id: str) -> None:
        """The result expired unread: forgotten as if acknowledged (the id is refused as a duplicate)."""
        self.acknowledged(action_id)

    def commit(self) -> None:
        """Write what this loop turn changed, atomically.

        Raises :class:`StateWriteError` if the write fails, and on every call after: the batch is not
        dropped silently, and nothing later is written over a gap.
        """
        if self.failed is not None:
            raise StateWriteError(self.failed)
        if not self._ops:
            return
        ops, trim = self._ops, self._acked_added
        try:
            with self._db:
                self._db.execute("BEGIN")
                for sql, params in ops:
                    self._db.execute(sql, params)
                if trim:
                    self._trim_acked()
        except sqlite3.Error as exc:
            self.failed = (
                f"cannot write the state file {self.path}: {exc} ({_hint(exc)}); the orchestrator stops "
                "so that its memory and the file never disagree: fix that and start it again (it resumes "
                "from the file; actions that were running are reported lost, not rerun)"
            )
            raise StateWriteError(self.failed) from exc
        self._ops, self._acked_added = [], False

    def close(self) -> None:
        """Flush and close the file, and let another orchestrator have it."""
        try:
            if self.failed is None:
                self.commit()
        finally:
            self._db.close()
            _unlock(self._lock_fd, self._lock_key)

    def _trim_acked(self) -> None:
        self._db.execute(
            "DELETE FROM acked WHERE rowid <= (SELECT max(rowid) FROM acked) - ?", (self.acked_kept,)
        )


# --- opening -------------------------------------------------------------------------------------------
def _lock(path: Path) -> tuple[int, tuple[int, int]]:
    """Hold ``PATH.lock`` (a POSIX lock: released when this process ends, however it ends; not
    inherited by the processes it forks) and write our pid and host in it; refuse if another holds it.
    """
    lock_path = path.with_name(path.name + ".lock")
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        st = os.fstat(fd)
        key = (st.st_dev, st.st_ino)
        if key in _HELD:
            raise StateFileError(
                f"the state file {path} is already open in this process: give each orchestrator its "
                "own --state-db"
            )
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = _read_holder(fd) or "unknown"
            raise StateFileError(
                f"the state file {path} is in use by another orchestrator ({holder}, per {lock_path}): "
                "stop that one first, or give this one another --state-db"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
    except BaseException:
        os.close(fd)
        raise
    _HELD.add(key)
    return fd, key


def _read_holder(fd: int) -> str:
    with contextlib.suppress(OSError):
        return os.pread(fd, 256, 0).decode(errors="replace").strip()
    return ""


def _unlock(fd: int, key: tuple[int, int]) -> None:
    _HELD.discard(key)
    with contextlib.suppress(OSError):
        os.close(fd)  # releases the lock


def _open(path: Path) -> sqlite3.Connection:
    """Connect, and check the layout (or write it, in a new file)."""
    db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    try:
        _check_layout(db, path)
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=NORMAL")
        if db.execute("PRAGMA user_version").fetchone()[0] < SCHEMA_VERSION:
            with db:
                db.execute("BEGIN")
                for statement in _SCHEMA.split(";"):
                    if statement.strip():
                        db.execute(statement)
                db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
        return db
    except sqlite3.DatabaseError as exc:
        db.close()
        raise StateFileError(
            f"cannot open the state file {path}: {exc} ({_hint(exc)}); give the server another --state-db "
            "(or move this one away)"
        ) from exc
    except BaseException:
        db.close()
        raise


def _check_layout(db: sqlite3.Connection, path: Path) -> None:
    """Refuse a file of another layout, with one line saying what to do."""
    version = db.execute("PRAGMA user_version").fetchone()[0]
    if version > SCHEMA_VERSION:
        raise StateFileError(
            f"the state file {path} was written by a newer tangram-server (layout {version}; this one "
            f"reads {SCHEMA_VERSION}): run that version, or give this one another --state-db"
        )
    tables = {row[0] for row in db.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    for name, expected in COLUMNS.items():
        if name not in tables:
            continue
        columns = tuple(row[1] for row in db.execute(f"PRAGMA table_info({name})"))
        if columns != expected:
            raise StateFileError(
                f"the state file {path} is not one this tangram-server reads: its table {name!r} has the "
                f"columns ({', '.join(columns)}), not ({', '.join(expected)}); written by another version? "
                "run the version that wrote it, or give this one another --state-db"
            )
    ours = tables & set(COLUMNS)
    if (version == SCHEMA_VERSION and ours != set(COLUMNS)) or (ours and ours != set(COLUMNS)):
        missing = ", ".join(sorted(set(COLUMNS) - ours))
        raise StateFileError(
            f"the state file {path} lacks the table(s) {missing}: it is damaged; give the server another "
            "--state-db (or move this one away)"
        )
    if not ours and tables:
        raise StateFileError(
            f"the state file {path} holds other tables ({', '.join(sorted(tables)[:5])}): it is not a "
            "tangram state file; give the server another --state-db"
        )


def _hint(exc: sqlite3.Error) -> str:
    text = str(exc).lower()
    if "full" in text:
        return "free space on its disk"
    if "locked" in text or "busy" in text:
        return "another program holds the database; stop it"
    if "not a database" in text or "malformed" in text or "corrupt" in text:
        return "the file is not a tangram state file, or is damaged"
    if "readonly" in text or "read-only" in text:
        return "the file or its folder is not writable"
    return "check the file and its disk"
