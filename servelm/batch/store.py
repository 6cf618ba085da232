"""The server's state under --state-dir: an SQLite database and a directory of files. The Files and Batches API
keeps its files and batches here; the Responses API's stored responses and the conversations are kept in the
same database by service/durable.py, through `transaction` and `rows` (their tables are declared here, so that
start-up knows every table of ours).

A file's bytes are written (to a temporary name, synced, renamed) before its row is committed, so a row always
names a whole file. At start, what the database does not know is never deleted: a file without a row (a crash in
between, or a database lost or replaced) and anything else in files/ is moved aside into orphans/<UTC time>/, and
the log and /health say how many and where (only a temporary name of ours, a write cut short, is removed, and
logged). A database that is damaged or not servelm's stops the start (StoreDamaged: the file and what to do), and
damage met later is a 503 `store_damaged`, logged once and told by /health. A batch is one row
holding its object as OpenAI's spec has it; each answered line is a row of its own, committed in the same
transaction as the batch's counts, so a restart knows exactly which lines were answered: none is answered twice
in the output and none is dropped. Every read and write names the owner (an API key's digest, "" on an open
server): another owner's file or batch is not found.
"""

from __future__ import annotations

import fcntl
import logging
import os
import re
import secrets
import shutil
import sqlite3
import tempfile
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, BinaryIO

from servelm.batch.objects import Batch, FieldValue, OpenAIFile, Status
from servelm.errors import ServiceUnavailable
from servelm.gguf_header import open_regular

log = logging.getLogger("servelm.batch")
CHUNK = 1 << 16  # a file's bytes are copied and read this much at a time

UNFINISHED = ("validating", "in_progress", "finalizing", "cancelling")
ENDED = ("completed", "failed", "expired", "cancelled")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    id TEXT PRIMARY KEY, owner TEXT NOT NULL, filename TEXT NOT NULL, purpose TEXT NOT NULL, bytes INTEGER NOT NULL,
    created_at INTEGER NOT NULL, expires_at INTEGER);
CREATE TABLE IF NOT EXISTS batches (
    id TEXT PRIMARY KEY, owner TEXT NOT NULL, created_at INTEGER NOT NULL, status TEXT NOT NULL, body TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS lines (
    batch_id TEXT NOT NULL, line INTEGER NOT NULL, ok INTEGER NOT NULL, output TEXT NOT NULL,
    input_tokens INTEGER NOT NULL DEFAULT 0, cached_tokens INTEGER NOT NULL DEFAULT 0,
    output_tokens INTEGER NOT NULL DEFAULT 0, PRIMARY KEY (batch_id, line));
CREATE TABLE IF NOT EXISTS responses (
    owner TEXT NOT NULL, id TEXT NOT NULL, stored_at REAL NOT NULL, bytes INTEGER NOT NULL, body TEXT NOT NULL,
    PRIMARY KEY (owner, id));
CREATE INDEX IF NOT EXISTS responses_by_age ON responses (owner, stored_at);
CREATE TABLE IF NOT EXISTS claims (owner TEXT NOT NULL, key TEXT NOT NULL, at REAL NOT NULL, PRIMARY KEY (owner, key));
CREATE TABLE IF NOT EXISTS conversations (
    id TEXT PRIMARY KEY, owner TEXT NOT NULL, created_at INTEGER NOT NULL, metadata TEXT NOT NULL,
    items INTEGER NOT NULL, bytes INTEGER NOT NULL);
CREATE INDEX IF NOT EXISTS conversations_by_owner ON conversations (owner);
CREATE TABLE IF NOT EXISTS conversation_items (
    conversation_id TEXT NOT NULL, seq INTEGER NOT NULL, id TEXT NOT NULL, bytes INTEGER NOT NULL, body TEXT NOT NULL,
    PRIMARY KEY (conversation_id, seq), UNIQUE (conversation_id, id));
"""


_TABLES = {"files": ("id", "owner", "filename", "purpose", "bytes", "created_at", "expires_at"),
           "batches": ("id", "owner", "created_at", "status", "body"),
           "lines": ("batch_id", "line", "ok", "output", "input_tokens", "cached_tokens", "output_tokens"),
           "responses": ("owner", "id", "stored_at", "bytes", "body"),
           "claims": ("owner", "key", "at"),
           "conversations": ("id", "owner", "created_at", "metadata", "items", "bytes"),
           "conversation_items": ("conversation_id", "seq", "id", "bytes", "body")}
_PART_WRITTEN = re.compile(r"\.file-[0-9a-f]{24}\.tmp")  # _write's temporary name: a write cut short by a stop
_DAMAGE = frozenset({sqlite3.SQLITE_CORRUPT, sqlite3.SQLITE_NOTADB})  # (an I/O error or a full disk is not damage)
_UNWRITABLE = frozenset({sqlite3.SQLITE_READONLY, sqlite3.SQLITE_PERM, sqlite3.SQLITE_CANTOPEN})
_FIX = ("Nothing was changed. Restore it from a backup, or stop the server and move it aside ({db} with its -wal "
        "and -shm files) to start with an empty store: the stored files are then kept under orphans/ "
        "(`sqlite3 FILE .recover` may save its rows).")


class StoreDamaged(ServiceUnavailable):
    """The database cannot be used: damaged, not a database, or another program's. str() is the operator's line
    (the file, what was found, what to do); a client gets a 503 `store_damaged` that names no path."""

    def __init__(self, db: Path, found: str) -> None:
        super().__init__("The server's state store is damaged; its operator must repair it (GET /health says so). "
                         "Try again later.", code="store_damaged")
        self.detail = f"the server's state database {db} (files, batches, stored responses, conversations) cannot be used: {found}. {_FIX.format(db=db)}"

    def __str__(self) -> str:
        return self.detail


class StoreUnavailable(ServiceUnavailable):
    """A write the store could not make just now (a disk I/O error, a full disk, a file or folder that cannot be
    written): nothing of it was kept, the client gets a 503 `store_unavailable` that names no path, and /health says
    `failing` until a write succeeds again."""

    def __init__(self) -> None:
        super().__init__("The server could not write its state store just now, and nothing of this request was kept. "
                         "Try again later.", code="store_unavailable")


def _is_damage(exc: BaseException | None) -> bool:
    return isinstance(exc, sqlite3.DatabaseError) and (getattr(exc, "sqlite_errorcode", 0) & 0xFF) in _DAMAGE


def _unwritable(exc: BaseException | None) -> bool:
    """A write refused: the file read-only (chattr +i, a read-only mount) or not to be opened for writing."""
    return isinstance(exc, sqlite3.DatabaseError) and (getattr(exc, "sqlite_errorcode", 0) & 0xFF) in _UNWRITABLE


def _writable(db: sqlite3.Connection, path: Path) -> None:
    """A write tried and rolled back at start (StoreDamaged when refused): SQLite opens a file it may not write
    read-only without a word, and the first stored response would fail."""
    try:
        db.execute("BEGIN IMMEDIATE")
        db.execute("CREATE TABLE servelm_write_probe (x)")
    except sqlite3.Error as exc:
        if db.in_transaction:
            db.execute("ROLLBACK")
        raise StoreDamaged(path, f"it cannot be written ({exc}): make the file and its directory writable") from None
    db.execute("ROLLBACK")


def _folder(path: Path) -> Path:
    """A folder of the state directory, made when missing (NotADirectoryError, naming it, when a file is there)."""
    if path.exists() and not path.is_dir():
        raise NotADirectoryError(f"{path} must be a folder of the state directory (--state-dir), and something else "
                                 "is there: move it away")
    path.mkdir(parents=True, exist_ok=True)
    return path


def _hold(path: Path) -> BinaryIO:
    """The state directory's lock, held while its store is open: a second server starting on the same directory
    would take the first one's files being written for orphans (an OSError naming it)."""
    f = open(path, "a+b")  # noqa: SIM115 (held open: closed by BatchStore.close)
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.close()
        raise OSError(f"another servelm process uses the state directory {path.parent} (it holds {path}): stop it "
                      "first, or give this server a --state-dir of its own") from None
    return f


class _Guard:
    """The store's lock (one thread at a time on its connection); a damaged database met under it comes out as
    StoreDamaged, logged the first time. Once damage is met nothing more is read or written (StoreDamaged): a
    write that happened to miss the damaged pages would be acknowledged, then lost with the database a restart
    refuses."""

    def __init__(self, store: BatchStore) -> None:
        self.raw = threading.Lock()
        self._store = store

    def __enter__(self) -> None:
        self.raw.acquire()
        if self._store.damage is not None:
            self.raw.release()
            raise StoreDamaged(self._store.db_path, "it was found damaged while serving (logged then)")

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.raw.release()
        if _is_damage(exc):
            raise self._store.damaged(str(exc)) from exc
        if _unwritable(exc):  # made read-only while serving: nothing more is stored until the operator mends it
            raise self._store.damaged(f"it cannot be written any more ({exc})") from exc
        if isinstance(exc, sqlite3.OperationalError):  # an I/O error or a full disk: this write failed, not the store
            raise self._store.failing(exc) from exc


class StoreFull(Exception):
    """The files would take more disk than --batch-disk-mib allows."""


class FileDamaged(Exception):
    """A stored file's bytes are gone, or are not as many as its row records (truncated or changed outside the
    server): it is not served or run."""

    def __init__(self, file_id: str, path: Path, recorded: int, found: int | None) -> None:
        held = "is missing, or is not a regular file," if found is None else f"holds {found} bytes"
        super().__init__(f"the stored file {file_id} ({path}) {held} where {recorded} bytes were written")
        self.file_id, self.path, self.recorded, self.found = file_id, path, recorded, found


@dataclass(frozen=True)
class FileRecord:
    id: str
    owner: str
    filename: str
    purpose: str
    bytes: int
    created_at: int
    expires_at: int | None = None

    def file_object(self) -> OpenAIFile:
        """OpenAI's File object."""
        return OpenAIFile(id=self.id, bytes=self.bytes, created_at=self.created_at, filename=self.filename,
                          purpose=self.purpose, expires_at=self.expires_at)


@dataclass(frozen=True)
class LineResult:
    """One answered line: its number in the input file, whether it succeeded (the output file) or not (the error
    file), the output line as JSON text, and its tokens for the batch's usage."""

    line: int
    ok: bool
    output: str
    input_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0


def new_id(prefix: str) -> str:
    return prefix + secrets.token_hex(12)


class BatchStore:
    def __init__(self, directory: Path, max_disk_bytes: int = 0) -> None:
        self.directory = Path(directory)
        if self.directory.exists() and not self.directory.is_dir():
            raise NotADirectoryError(f"the state directory {self.directory} (--state-dir) is not a directory: "
                                     "something else is there; give a directory (it is made when missing)")
        self.directory.mkdir(parents=True, exist_ok=True)
        self.files_dir = self.directory / "files"
        self.max_disk_bytes = max_disk_bytes  # 0: no bound
        self.db_path = self.directory / "servelm.db"
        self._lock = _Guard(self)
        self.damage: str | None = None  # what was found, once damage was met while serving (then nothing is done)
        self.write_error: str | None = None  # the last write's failure, until a write succeeds again
        self._orphans: dict[str, int | str] | None = None  # what start-up moved aside
        lock = self.directory / ".lock"
        made = not lock.exists()
        self._held = _hold(lock)
        try:
            self._db = self._open()  # the database checked before anything in the directory is made or moved
            _folder(self.files_dir)
            self._move_orphans()
        except BaseException:
            self._held.close()
            if made:
                lock.unlink(missing_ok=True)  # refused: the directory as it was (but for an empty database made)
            raise

    def _open(self) -> sqlite3.Connection:
        """The database, checked whole before anything is served from it or done to the files (StoreDamaged)."""
        db: sqlite3.Connection | None = None
        try:
            if self.db_path.exists() and not self.db_path.is_file():
                raise StoreDamaged(self.db_path, "it is not a regular file")
            db = sqlite3.connect(self.db_path, check_same_thread=False, isolation_level=None)
            # read-only checks first: a database refused is left byte for byte as it was
            problems = [str(row[0]) for row in db.execute("PRAGMA quick_check(3)")]
            if problems != ["ok"]:  # its lines (the first three problems), in one of ours
                found = "; ".join(line.strip() for p in problems for line in p.splitlines() if line.strip())
                raise StoreDamaged(self.db_path, "PRAGMA quick_check finds " + found[:400])
            names = [str(row[0]) for row in db.execute("SELECT name FROM sqlite_master WHERE type = 'table' AND "
                                                       "name NOT LIKE 'sqlite%'")]
            foreign = [n for n in names if _TABLES.get(n) != tuple(
                str(row[0]) for row in db.execute("SELECT name FROM pragma_table_info(?)", (n,)))]
            if foreign:
                raise StoreDamaged(self.db_path, f"it is not servelm's (its table(s) {', '.join(foreign)} are not "
                                   "servelm's)")
            _writable(db, self.db_path)
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=FULL")
            db.executescript(_SCHEMA)
        except BaseException as exc:
            if db is not None:
                db.close()
            if isinstance(exc, sqlite3.Error):  # not a database, damaged, or not to be opened at all
                raise StoreDamaged(self.db_path, str(exc)) from None
            raise
        return db

    def damaged(self, found: str) -> StoreDamaged:
        """Damage met while serving: logged the first time, told by /health, a 503 to each request that meets it."""
        error = StoreDamaged(self.db_path, found)
        if self.damage is None:
            log.error("%s", error)
        self.damage = str(error)
        return error

    def failing(self, exc: BaseException) -> StoreUnavailable:
        """A write that failed while serving (not damage): logged, told by /health until a write succeeds."""
        found = f"{type(exc).__name__}: {exc}"
        if self.write_error != found:
            log.error("the server's state store %s could not be written (%s): the request got a 503", self.db_path,
                      found)
        self.write_error = found
        return StoreUnavailable()

    def health(self) -> dict[str, object]:
        """/health's report (no I/O): ok, failing (the last write failed) or damaged, and what start-up moved
        aside."""
        status = "damaged" if self.damage is not None else "failing" if self.write_error is not None else "ok"
        report: dict[str, object] = {"status": status, "database": str(self.db_path)}
        if self.damage is not None or self.write_error is not None:
            report["error"] = self.damage or self.write_error
        if self._orphans is not None:
            report["orphans"] = self._orphans
        return report

    def close(self) -> None:
        with self._lock.raw:  # (a damaged store too)
            self._db.close()
        self._held.close()

    @property
    def kept(self) -> str:
        """Where the stored responses and conversations are kept, for /health."""
        return f"sqlite ({self.db_path})" + (": damaged" if self.damage is not None else "")

    def rows(self, sql: str, args: Sequence[object] = ()) -> list[Any]:
        """A query's rows, read under the store's lock."""
        with self._lock:
            return self._db.execute(sql, args).fetchall()

    @contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        """The connection inside one write transaction, committed at the end (rolled back by an exception)."""
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
                self._db.execute("COMMIT")  # (a COMMIT that fails is rolled back too: the next BEGIN would fail)
            except BaseException:
                if self._db.in_transaction:
                    with suppress(sqlite3.Error):
                        self._db.execute("ROLLBACK")
                raise
            self.write_error = None

    def _move_orphans(self) -> None:
        """Whatever files/ holds that no row names goes to orphans/<UTC time>/, never deleted (a missing or empty
        database makes every stored file such a one); only our own temporary names, writes cut short, are removed."""
        known = {f"{row[0]}.jsonl" for row in self._db.execute("SELECT id FROM files")}
        unknown = []
        for path in self.files_dir.iterdir():
            if path.name in known:
                continue
            if _PART_WRITTEN.fullmatch(path.name) and path.is_file() and not path.is_symlink():
                log.warning("removing %s: a file write cut short by a stop (no row names it)", path)
                path.unlink(missing_ok=True)
            else:
                unknown.append(path)
        if not unknown:
            return
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        aside = Path(tempfile.mkdtemp(prefix=stamp + "-", dir=_folder(self.directory / "orphans")))
        for path in unknown:
            shutil.move(path, aside / path.name)
        self._orphans = {"count": len(unknown), "moved_to": str(aside)}
        log.warning("%d file(s) in %s are unknown to the database %s (a database lost, emptied or replaced, or a "
                    "crash between a write and its row): moved aside to %s, not deleted; delete them, or restore "
                    "the database they belong to and move them back", len(unknown), self.files_dir, self.db_path,
                    aside)

    # -- files ------------------------------------------------------------------------------------
    def path(self, file_id: str) -> Path:
        return self.files_dir / f"{file_id}.jsonl"

    def disk_used(self) -> int:
        with self._lock:
            return int(self._db.execute("SELECT COALESCE(SUM(bytes), 0) FROM files").fetchone()[0])

    def add_file(self, owner: str, filename: str, purpose: str, data: bytes, expires_at: int | None = None,
                 *, bounded: bool = True) -> FileRecord:
        """Write the bytes, then commit the row. StoreFull when it would go over the disk bound (`bounded`: an
        upload; a batch's own output is always written)."""
        return self.add_file_from(owner, filename, purpose, [data], len(data), expires_at, bounded=bounded)

    def add_file_from(self, owner: str, filename: str, purpose: str, chunks: Iterable[bytes], size: int,
                      expires_at: int | None = None, *, bounded: bool = True) -> FileRecord:
        """add_file for bytes that come a chunk at a time (an upload spooled to disk), `size` of them: never whole
        in memory."""
        if bounded and self.max_disk_bytes and self.disk_used() + size > self.max_disk_bytes:
            raise StoreFull()
        file_id = new_id("file-")
        record = FileRecord(file_id, owner, filename, purpose, self._write(file_id, chunks), int(time.time()),
                            expires_at)
        with self.transaction() as db:
            db.execute("INSERT INTO files VALUES (?, ?, ?, ?, ?, ?, ?)", (record.id, owner, filename, purpose,
                                                                       record.bytes, record.created_at, expires_at))
        return record

    def _write(self, file_id: str, chunks: Iterable[bytes]) -> int:
        """A file's bytes, whole on disk before any row names them; how many."""
        tmp = self.files_dir / f".{file_id}.tmp"
        try:
            with open(tmp, "wb") as f:
                for chunk in chunks:
                    f.write(chunk)
                f.flush()
                os.fsync(f.fileno())
                size = f.tell()
            os.replace(tmp, self.path(file_id))
        except OSError as exc:
            with suppress(OSError):
                tmp.unlink(missing_ok=True)
            raise self.failing(exc) from exc
        return size

    def file(self, owner: str, file_id: str) -> FileRecord | None:
        with self._lock:
            row = self._db.execute("SELECT * FROM files WHERE id = ? AND owner = ?", (file_id, owner)).fetchone()
        return FileRecord(*row) if row else None

    def files(self, owner: str, purpose: str | None = None) -> list[FileRecord]:
        """The owner's files, newest first."""
        query = "SELECT * FROM files WHERE owner = ?" + (" AND purpose = ?" if purpose else "")
        with self._lock:
            rows = self._db.execute(query + " ORDER BY created_at DESC, rowid DESC",
                                    (owner, purpose) if purpose else (owner,)).fetchall()
        return [FileRecord(*row) for row in rows]

    def content(self, owner: str, file_id: str) -> bytes | None:
        """A file's bytes, whole (for tests and small files: the server reads them with open())."""
        f = self.open_file(owner, file_id)
        if f is None:
            return None
        with f:
            return f.read()

    def open_file(self, owner: str | None, file_id: str) -> BinaryIO | None:
        """A stored file open for reading, found as large as its row says (FileDamaged, logged, if it is not); None
        when the owner (None: any) has no such file."""
        with self._lock:
            query = "SELECT bytes FROM files WHERE id = ?" + ("" if owner is None else " AND owner = ?")
            row = self._db.execute(query, (file_id,) if owner is None else (file_id, owner)).fetchone()
        return None if row is None else self.open_stored(file_id, row[0])

    def open_stored(self, file_id: str, size: int) -> BinaryIO:
        """A stored file open for reading, found `size` bytes long (its row's; FileDamaged, logged, if not): for a
        reader that looked its row up once (a batch reads its input file a line at a time)."""
        path = self.path(file_id)
        try:
            f = open_regular(path)  # a FIFO put in its place would hold the reading thread, and the exit, for ever
        except OSError:
            found = None
        else:
            found = os.fstat(f.fileno()).st_size
            if found == size:
                return f
            f.close()
        damaged = FileDamaged(file_id, path, size, found)
        log.error("%s: it is not served, and a batch reading it fails; restore it, or delete the file", damaged)
        raise damaged

    def in_use(self, file_id: str) -> bool:
        """Whether an unfinished batch reads this file."""
        return any((batch := self.batch(None, b)) is not None and batch.input_file_id == file_id
                   for b in self.unfinished())

    def delete_file(self, owner: str, file_id: str) -> bool:
        with self.transaction() as db:
            gone = db.execute("DELETE FROM files WHERE id = ? AND owner = ?", (file_id, owner)).rowcount > 0
        if gone:
            self.path(file_id).unlink(missing_ok=True)
        return gone

    # -- batches ----------------------------------------------------------------------------------
    def add_batch(self, owner: str, batch: Batch) -> None:
        with self.transaction() as db:
            db.execute("INSERT INTO batches VALUES (?, ?, ?, ?, ?)",
                       (batch.id, owner, batch.created_at, batch.status, batch.stored()))

    def batch(self, owner: str | None, batch_id: str) -> Batch | None:
        """A batch object (owner None: whoever owns it, for the runner)."""
        query, args = "SELECT body FROM batches WHERE id = ?", [batch_id]
        if owner is not None:
            query, args = query + " AND owner = ?", [batch_id, owner]
        with self._lock:
            row = self._db.execute(query, args).fetchone()
        return Batch.from_stored(row[0]) if row else None

    def owner_of(self, batch_id: str) -> str:
        with self._lock:
            row = self._db.execute("SELECT owner FROM batches WHERE id = ?", (batch_id,)).fetchone()
        return str(row[0]) if row else ""

    def batches(self, owner: str) -> list[Batch]:
        """The owner's batches, newest first."""
        with self._lock:
            rows = self._db.execute("SELECT body FROM batches WHERE owner = ? ORDER BY created_at DESC, rowid DESC",
                                    (owner,)).fetchall()
        return [Batch.from_stored(r[0]) for r in rows]

    def unfinished(self) -> list[str]:
        """Every batch not yet ended, oldest first: what the runner takes up (at start: what a restart resumes)."""
        marks = ", ".join("?" * len(UNFINISHED))
        with self._lock:
            rows = self._db.execute(f"SELECT id FROM batches WHERE status IN ({marks}) ORDER BY created_at, rowid",
                                    UNFINISHED).fetchall()
        return [r[0] for r in rows]

    def update(self, batch_id: str, only_if: tuple[Status, ...] = (), **fields: FieldValue) -> Batch | None:
        """Set fields of a batch's object (the counts are kept from the lines); None when it is not in one of the
        statuses `only_if` names."""
        with self.transaction() as db:
            row = db.execute("SELECT body FROM batches WHERE id = ?", (batch_id,)).fetchone()
            if row is None:
                return None
            batch = Batch.from_stored(row[0])
            if only_if and batch.status not in only_if:
                return None
            batch = batch.with_fields(**fields)
            db.execute("UPDATE batches SET status = ?, body = ? WHERE id = ?", (batch.status, batch.stored(), batch_id))
        return batch

    def record(self, batch_id: str, result: LineResult) -> bool:
        """Commit one answered line with the batch's counts and usage; False when the line was answered already, or
        the batch no longer takes answers (it ended)."""
        with self.transaction() as db:
            row = db.execute("SELECT body FROM batches WHERE id = ?", (batch_id,)).fetchone()
            if row is None:
                return False
            batch = Batch.from_stored(row[0])
            if batch.status not in ("in_progress", "cancelling"):
                return False
            added = db.execute("INSERT OR IGNORE INTO lines VALUES (?, ?, ?, ?, ?, ?, ?)",
                               (batch_id, result.line, int(result.ok), result.output, result.input_tokens,
                                result.cached_tokens, result.output_tokens)).rowcount > 0
            if not added:
                return False
            if result.ok:
                batch.request_counts.completed += 1
            else:
                batch.request_counts.failed += 1
            batch.usage.add(result.input_tokens, result.cached_tokens, result.output_tokens)
            db.execute("UPDATE batches SET body = ? WHERE id = ?", (batch.stored(), batch_id))
        return True

    def finish(self, batch_id: str, status: Status) -> None:
        """End a batch (completed, failed, cancelled or expired): its answered lines become its output file and error
        file (none when empty), committed with the batch's end in one transaction (its `<status>_at` kept if set:
        a failed batch's is the time it failed)."""
        owner = self.owner_of(batch_id)
        now = int(time.time())
        written = []
        for ok, field in ((True, "output_file_id"), (False, "error_file_id")):
            file_id = new_id("file-")
            size = self._write(file_id, (line.encode() + b"\n" for line in self.outputs(batch_id, ok)))
            if size:
                name = f"{batch_id}_{'output' if ok else 'error'}.jsonl"
                written.append((field, FileRecord(file_id, owner, name, "batch_output", size, now)))
            else:
                self.path(file_id).unlink()
        with self.transaction() as db:
            row = db.execute("SELECT body FROM batches WHERE id = ?", (batch_id,)).fetchone()
            for _, record in written:
                db.execute("INSERT INTO files VALUES (?, ?, ?, ?, ?, ?, ?)", (record.id, owner, record.filename,
                                                                           record.purpose, record.bytes, now, None))
            batch = Batch.from_stored(row[0])
            at = {} if batch.wire()[f"{status}_at"] is not None else {f"{status}_at": now}
            batch = batch.with_fields(**{field: record.id for field, record in written}, status=status, **at)
            db.execute("UPDATE batches SET status = ?, body = ? WHERE id = ?", (status, batch.stored(), batch_id))

    def answered(self, batch_id: str) -> set[int]:
        with self._lock:
            return {r[0] for r in self._db.execute("SELECT line FROM lines WHERE batch_id = ?", (batch_id,))}

    def outputs(self, batch_id: str, ok: bool, page: int = 256) -> Iterator[str]:
        """The answered lines' output lines, in input order: the successes or the failures, read a page of rows at
        a time (a batch's output file is written without holding it whole)."""
        after = 0
        while True:
            with self._lock:
                rows = self._db.execute("SELECT line, output FROM lines WHERE batch_id = ? AND ok = ? AND line > ? "
                                        "ORDER BY line LIMIT ?", (batch_id, int(ok), after, page)).fetchall()
            yield from (r[1] for r in rows)
            if len(rows) < page:
                return
            after = rows[-1][0]

    def counts_by_status(self) -> dict[str, int]:
        with self._lock:
            rows = self._db.execute("SELECT status, COUNT(*) FROM batches GROUP BY status").fetchall()
        return {str(status): int(n) for status, n in rows}

    def line_totals(self) -> tuple[int, int]:
        """Lines answered since the store began: succeeded, failed."""
        with self._lock:
            ok, failed = self._db.execute("SELECT COALESCE(SUM(ok), 0), COALESCE(SUM(1 - ok), 0) FROM lines").fetchone()
        return int(ok), int(failed)

    def totals(self) -> tuple[dict[str, int], int, int]:
        """/metrics' counts: batches by status, lines succeeded, lines failed (none while the database is damaged:
        /health says so, and a scrape does not fail)."""
        try:
            return (self.counts_by_status(), *self.line_totals())
        except StoreDamaged:
            return {}, 0, 0
