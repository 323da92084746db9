"""Optional persistence of the orchestrator's actions and results (SQLite, standard library).

With a state file, a restarted orchestrator resumes: queued actions queue again, stored results are
resent to clients that resubmit, and actions that were running when it died are reported failed
(they may have had side effects, so running them again could run them twice). Writes are batched
per loop turn in one transaction.
"""

from __future__ import annotations

import sqlite3
from dataclasses import dataclass
from pathlib import Path

from tangram_env.protocol import Action, Result

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


@dataclass
class Stored:
    """One action as the state file remembers it."""

    action: Action
    owner: bytes
    state: str
    result: Result | None


class StateStore:
    """The orchestrator's durable memory; call :meth:`commit` once per loop turn."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(_SCHEMA)
        self._ops: list[tuple[str, tuple[object, ...]]] = []

    def load(self) -> tuple[list[Stored], set[str]]:
        """Everything remembered: actions (with their state and result) and acknowledged ids."""
        stored = [
            Stored(Action.model_validate_json(a), bytes(o), s, Result.model_validate_json(r) if r else None)
            for o, a, s, r in self._db.execute("SELECT owner, action, state, result FROM actions")
        ]
        acked = {row[0] for row in self._db.execute("SELECT id FROM acked")}
        return stored, acked

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

    def commit(self) -> None:
        """Write what this loop turn changed, atomically."""
        if not self._ops:
            return
        ops, self._ops = self._ops, []
        with self._db:
            self._db.execute("BEGIN")
            for sql, params in ops:
                self._db.execute(sql, params)

    def close(self) -> None:
        """Flush and close the file."""
        self.commit()
        self._db.close()
