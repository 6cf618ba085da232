"""The stored responses and the conversations kept in the state directory's SQLite database (--state-dir), beside
the Files and Batches API's state (batch/store.py, which owns the database, its tables and its lock).

Each write is one transaction, committed (WAL, synchronous=FULL) before the request that made it is answered, so
what a client was told was kept survives a restart and a SIGKILL. The bounds are MemoryStore's and
MemoryConversations' (per key), kept by queries over indexed columns: a write reads no more than the rows it
counts, and a read loads one entry or one page of items, never a key's whole store. Ages are wall-clock time, so
they go on across a restart. Every call blocks on the disk: the services make them from worker threads.
"""

from __future__ import annotations

import json
import sqlite3
import time
import uuid
from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol

from servelm.protocol.conversations import ConversationObject
from servelm.service.conversations import ConversationLimits, fresh_ids, unknown_after
from servelm.service.store import CLAIMS_PER_ENTRY, StoredResponse, StoreLimits


class Database(Protocol):
    """The state database (batch/store.py's BatchStore): one transaction at a time, and reads under its lock."""

    @property
    def kept(self) -> str:
        """Where it is, for /health."""
        ...

    def transaction(self) -> AbstractContextManager[sqlite3.Connection]: ...

    def rows(self, sql: str, args: Sequence[Any] = ()) -> list[Any]: ...


class SqlResponses:
    """A ResponseStore in the database's `responses` and `claims` tables."""

    def __init__(self, db: Database, limits: StoreLimits = StoreLimits(), clock: Any = time.time) -> None:
        self.db, self.limits, self._clock = db, limits, clock

    @property
    def kept(self) -> str:
        return self.db.kept

    def put(self, owner: str, response_id: str, entry: StoredResponse) -> None:
        body = json.dumps([entry.response, entry.input_items, entry.history])
        size, limits = len(body), self.limits
        if size > limits.max_bytes or limits.max_entries == 0:
            return  # larger than all a key may keep: it is not kept (a later GET answers 404)
        with self.db.transaction() as db:
            self._expire(db, owner)
            db.execute("INSERT OR REPLACE INTO responses VALUES (?, ?, ?, ?, ?)",
                       (owner, response_id, self._clock(), size, body))
            count, total = db.execute("SELECT COUNT(*), SUM(bytes) FROM responses WHERE owner = ?", (owner,)).fetchone()
            while count > limits.max_entries or total > limits.max_bytes:  # the key's oldest out, a page at a time
                page = db.execute("SELECT id, bytes FROM responses WHERE owner = ? ORDER BY stored_at, rowid LIMIT 64",
                                  (owner,)).fetchall()
                for oldest, taken in page:
                    if count <= limits.max_entries and total <= limits.max_bytes:
                        break
                    db.execute("DELETE FROM responses WHERE owner = ? AND id = ?", (owner, oldest))
                    count, total = count - 1, total - taken

    def get(self, owner: str, response_id: str) -> StoredResponse | None:
        found = self.db.rows("SELECT body FROM responses WHERE owner = ? AND id = ? AND stored_at >= ?",
                             (owner, response_id, self._oldest()))
        return StoredResponse(*json.loads(found[0][0])) if found else None

    def delete(self, owner: str, response_id: str) -> bool:
        with self.db.transaction() as db:
            return db.execute("DELETE FROM responses WHERE owner = ? AND id = ?", (owner, response_id)).rowcount > 0

    def claim(self, owner: str, key: str) -> bool:
        with self.db.transaction() as db:
            db.execute("DELETE FROM claims WHERE owner = ? AND at < ?", (owner, self._oldest()))
            if db.execute("INSERT OR IGNORE INTO claims VALUES (?, ?, ?)", (owner, key, self._clock())).rowcount == 0:
                return False
            db.execute("DELETE FROM claims WHERE owner = ? AND key NOT IN (SELECT key FROM claims WHERE owner = ? "
                       "ORDER BY at DESC, rowid DESC LIMIT ?)", (owner, owner, CLAIMS_PER_ENTRY * max(1, self.limits.max_entries)))
            return True

    def __len__(self) -> int:
        return int(self.db.rows("SELECT COUNT(*) FROM responses WHERE stored_at >= ?", (self._oldest(),))[0][0])

    def _oldest(self) -> float:
        return float(self._clock()) - self.limits.max_age_s

    def _expire(self, db: sqlite3.Connection, owner: str) -> None:
        db.execute("DELETE FROM responses WHERE owner = ? AND stored_at < ?", (owner, self._oldest()))


class SqlConversations:
    """A ConversationStore in the database's `conversations` and `conversation_items` tables (an item's `seq`
    orders a conversation's items)."""

    def __init__(self, db: Database, limits: ConversationLimits = ConversationLimits(), clock: Any = time.time) -> None:
        self.db, self.limits, self._clock = db, limits, clock

    @property
    def kept(self) -> str:
        return self.db.kept

    def create(self, owner: str, metadata: dict[str, str], items: list[dict[str, Any]]) -> ConversationObject:
        found = ConversationObject(id=f"conv_{uuid.uuid4().hex}", created_at=int(self._clock()), metadata=dict(metadata))
        with self.db.transaction() as db:
            self.limits.check_count(db.execute("SELECT COUNT(*) FROM conversations WHERE owner = ?",
                                               (owner,)).fetchone()[0])
            db.execute("INSERT INTO conversations VALUES (?, ?, ?, ?, 0, 0)",
                       (found.id, owner, found.created_at, json.dumps(found.metadata)))
            self._append(db, owner, found.id, items)
        return found

    def get(self, owner: str, conversation_id: str) -> ConversationObject | None:
        found = self.db.rows("SELECT id, created_at, metadata FROM conversations WHERE owner = ? AND id = ?",
                             (owner, conversation_id))
        return _conversation(*found[0]) if found else None

    def update(self, owner: str, conversation_id: str, metadata: dict[str, str]) -> ConversationObject | None:
        with self.db.transaction() as db:
            if db.execute("UPDATE conversations SET metadata = ? WHERE owner = ? AND id = ?",
                          (json.dumps(metadata), owner, conversation_id)).rowcount == 0:
                return None
            return _conversation(*db.execute("SELECT id, created_at, metadata FROM conversations WHERE id = ?",
                                             (conversation_id,)).fetchone())

    def delete(self, owner: str, conversation_id: str) -> bool:
        with self.db.transaction() as db:
            if db.execute("DELETE FROM conversations WHERE owner = ? AND id = ?", (owner, conversation_id)).rowcount == 0:
                return False
            db.execute("DELETE FROM conversation_items WHERE conversation_id = ?", (conversation_id,))
            return True

    def add(self, owner: str, conversation_id: str, items: list[dict[str, Any]]) -> list[dict[str, Any]] | None:
        with self.db.transaction() as db:
            if not _owns(db, owner, conversation_id):
                return None
            return self._append(db, owner, conversation_id, items)

    def items(self, owner: str, conversation_id: str) -> list[dict[str, Any]] | None:
        with self.db.transaction() as db:  # one snapshot: the conversation and all its items
            if not _owns(db, owner, conversation_id):
                return None
            return [json.loads(row[0]) for row in db.execute(
                "SELECT body FROM conversation_items WHERE conversation_id = ? ORDER BY seq", (conversation_id,))]

    def page(self, owner: str, conversation_id: str, order: str, limit: int,
             after: str | None) -> tuple[list[dict[str, Any]], bool] | None:
        ascending = order == "asc"
        with self.db.transaction() as db:
            if not _owns(db, owner, conversation_id):
                return None
            since = None
            if after is not None:
                found = db.execute("SELECT seq FROM conversation_items WHERE conversation_id = ? AND id = ?",
                                   (conversation_id, after)).fetchone()
                if found is None:
                    raise unknown_after(after)
                since = found[0]
            where = "" if since is None else (" AND seq > ?" if ascending else " AND seq < ?")
            rows = db.execute(f"SELECT body FROM conversation_items WHERE conversation_id = ?{where} ORDER BY seq "
                              f"{'ASC' if ascending else 'DESC'} LIMIT ?",
                              (conversation_id, *(() if since is None else (since,)), limit + 1)).fetchall()
        return [json.loads(row[0]) for row in rows[:limit]], len(rows) > limit

    def item(self, owner: str, conversation_id: str, item_id: str) -> dict[str, Any] | None:
        found = self.db.rows("SELECT i.body FROM conversation_items i JOIN conversations c ON c.id = i.conversation_id "
                             "WHERE c.owner = ? AND c.id = ? AND i.id = ?", (owner, conversation_id, item_id))
        return json.loads(found[0][0]) if found else None

    def remove_item(self, owner: str, conversation_id: str, item_id: str) -> bool:
        with self.db.transaction() as db:
            if not _owns(db, owner, conversation_id):
                return False
            found = db.execute("SELECT bytes FROM conversation_items WHERE conversation_id = ? AND id = ?",
                               (conversation_id, item_id)).fetchone()
            if found is None:
                return False
            db.execute("DELETE FROM conversation_items WHERE conversation_id = ? AND id = ?", (conversation_id, item_id))
            db.execute("UPDATE conversations SET items = items - 1, bytes = bytes - ? WHERE id = ?",
                       (found[0], conversation_id))
            return True

    def _append(self, db: sqlite3.Connection, owner: str, conversation_id: str,
                items: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """All the items or none (LimitReached past a bound, and the transaction rolled back); as kept."""
        def taken(item_id: str) -> bool:
            return db.execute("SELECT 1 FROM conversation_items WHERE conversation_id = ? AND id = ?",
                              (conversation_id, item_id)).fetchone() is not None

        kept, size = fresh_ids(items, taken)
        held, key_bytes = db.execute("SELECT (SELECT items FROM conversations WHERE id = ?), "
                                     "(SELECT COALESCE(SUM(bytes), 0) FROM conversations WHERE owner = ?)",
                                     (conversation_id, owner)).fetchone()
        self.limits.check(held + len(kept), key_bytes + size)
        seq = db.execute("SELECT COALESCE(MAX(seq), -1) FROM conversation_items WHERE conversation_id = ?",
                         (conversation_id,)).fetchone()[0]
        db.executemany("INSERT INTO conversation_items VALUES (?, ?, ?, ?, ?)",
                       [(conversation_id, seq + n, item["id"], len(body), body)
                        for n, (item, body) in enumerate(((i, json.dumps(i)) for i in kept), 1)])
        db.execute("UPDATE conversations SET items = items + ?, bytes = bytes + ? WHERE id = ?",
                   (len(kept), size, conversation_id))
        return kept


def _owns(db: sqlite3.Connection, owner: str, conversation_id: str) -> bool:
    return db.execute("SELECT 1 FROM conversations WHERE owner = ? AND id = ?",
                      (owner, conversation_id)).fetchone() is not None


def _conversation(conversation_id: str, created_at: int, metadata: str) -> ConversationObject:
    return ConversationObject(id=conversation_id, created_at=created_at, metadata=json.loads(metadata))
