"""The prefix cache's lower tiers: entries a slot gave up, kept in host RAM and, optionally, on disk.

A slot at rest is a prefix-cache entry (engine/slots.py). When a new sequence needs its stream, the entry's cells
are saved first (llama.cpp's per-sequence state: a Save op in the plan, which the runner fills) into host RAM;
entries past the RAM budget go to disk (the least recently used first) when a directory is given, else they go;
files past the disk budget go too. A prompt that a spilled entry begins better than any slot is placed in a slot
with the entry's cells restored (a Restore op) and reads only the rest. Restored cells are the bytes that were
saved, so an answer from them is the answer from computed cells (docs/exactness.md).

On disk an entry is one file: a magic line, a JSON header (the model's fingerprint, the scope, the tokens, the
length of the state and its MAC) and the state. The MAC is an HMAC-SHA256, keyed by the directory's key file (32
random bytes, made 0600 by the first server to use the directory and shared by every server on it), over the
fingerprint, the scope, the tokens and the state together: a state cannot be moved under other tokens, nor a file
re-signed, by anyone who cannot read the key. A server started on a directory indexes the headers; a file made
for another model (or cache type, or llama.cpp build), that cannot be read, or that is not a regular file, is
ignored and logged, never loaded; a state whose MAC does not match when it is about to be loaded is dropped and
logged. At a
graceful stop the engine writes every entry it still holds (slots at rest, RAM) to the directory, so a restarted
server answers a cached prompt from disk.

Entries are scoped as slots are: a request finds only entries of its own scope (its key and cache_salt).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import secrets
import stat
import threading
import time
from collections.abc import Sequence as Seq
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from servelm.engine.slots import common_prefix
from servelm.gguf_header import open_regular

log = logging.getLogger("servelm.engine.spill")

MAGIC = b"servelm prefix cache 2\n"
SUFFIX = ".kvstate"
KEY_FILE = "servelm-prefix-cache.key"  # the MAC key of the directory's files
KEY_BYTES = 32
MIN_SPILL = 64  # shorter entries are cheaper to read again than to keep
TMP_GRACE_S = 60.0  # an unfinished file younger than this may be another server's write in progress


@dataclass(eq=False)
class Spilled:
    tokens: tuple[int, ...]
    scope: str
    data: bytes | None = None  # the saved state while in RAM (the runner fills it); None once only on disk
    path: Path | None = None  # its file, once written
    size: int = 0  # the state's bytes
    used: int = 0  # the store's clock when it was saved or last read
    digest: str = ""  # the file's MAC, once written


class SpillStore:
    def __init__(self, fingerprint: str, ram_bytes: int, directory: str | Path | None = None,
                 disk_bytes: int = 0) -> None:
        self.fingerprint = fingerprint
        self.ram_bytes = ram_bytes
        self.disk_bytes = disk_bytes
        self.directory = Path(directory) if directory else None
        self.entries: list[Spilled] = []
        self._pending: list[Spilled] = []  # Save ops in the plan, filled by the runner during the step
        self._clock = 0
        self._lock = threading.Lock()  # the writer thread and the engine thread both touch entries
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="servelm-spill") if self.directory else None
        self.key = b""
        self.restored = 0  # entries read back into a slot, and the tokens they held
        self.restored_tokens = 0
        self.restore_failures = 0  # entries whose state the model refused (dropped, files and all)
        if self.directory is not None:
            self.directory.mkdir(parents=True, exist_ok=True)
            self.key = directory_key(self.directory)
            self._index()

    # -- what the scheduler asks ------------------------------------------------------------------
    def wants(self, tokens: Seq[int], scope: str) -> bool:
        """Whether an entry of these tokens is worth saving: long enough, and not held already."""
        if len(tokens) < MIN_SPILL:
            return False
        n = len(tokens)
        with self._lock:
            return not any(e.scope == scope and len(e.tokens) >= n and common_prefix(e.tokens, tokens, n) == n
                           for e in self.entries)

    def spill(self, tokens: Seq[int], scope: str) -> Spilled:
        """An entry for a Save op; it joins the store once the runner has filled it (settle)."""
        entry = Spilled(tuple(tokens), scope)
        self._pending.append(entry)
        return entry

    def settle(self) -> None:
        """Take in the states saved in the last step, and keep to the budgets (a step that saved none costs
        nothing here: the budgets change only with new entries, and the writer keeps them as it writes)."""
        if not self._pending:
            return
        pending, self._pending = self._pending, []
        with self._lock:
            for entry in pending:
                if entry.data is None:  # the step failed before its Save ran
                    continue
                entry.size, entry.used = len(entry.data), self._tick()
                n = len(entry.tokens)  # an entry this one extends says nothing more
                self._drop([e for e in self.entries if e.scope == entry.scope and len(e.tokens) <= n
                            and common_prefix(e.tokens, entry.tokens, n) == len(e.tokens)])
                self.entries.append(entry)
            self._keep_budgets()

    def best(self, tokens: Seq[int], scope: str, limit: int) -> tuple[Spilled | None, int]:
        """The entry of `scope` that shares the longest prefix with `tokens` (at most `limit`)."""
        best, best_n = None, 0
        with self._lock:
            for e in self.entries:
                if e.scope == scope:
                    n = common_prefix(e.tokens, tokens, limit)
                    if n > best_n:
                        best, best_n = e, n
        return best, best_n

    def load(self, entry: Spilled) -> bytes | None:
        """The entry's state, from RAM or its file (checked against its MAC); None if it cannot be had (the
        entry is dropped and the reason logged)."""
        data = entry.data
        if data is None and entry.path is not None:
            try:
                data = read_state(entry.path, self.fingerprint, self.key, entry.digest)
            except (OSError, ValueError) as exc:
                log.warning("prefix cache file %s not loaded: %s", entry.path, exc)
                with self._lock:
                    self._drop([entry])
                return None
        if data is None:
            return None
        with self._lock:
            entry.used = self._tick()
        self.restored += 1
        self.restored_tokens += len(entry.tokens)
        return data

    def discard(self, entry: Spilled) -> None:
        """An entry whose state the model refused, though it passed every check here (a forged or foreign state
        under a valid header): it goes, its file too, so that no restart reads it again."""
        log.warning("prefix cache entry of %d tokens refused by the model%s; dropped", len(entry.tokens),
                    f" (file {entry.path.name})" if entry.path is not None else "")
        with self._lock:
            self.restore_failures += 1
            self.restored -= 1
            self.restored_tokens -= len(entry.tokens)
            self._drop([entry])

    # -- bytes ------------------------------------------------------------------------------------
    @property
    def ram_used(self) -> int:
        return sum(e.size for e in self.entries if e.data is not None)

    @property
    def disk_used(self) -> int:
        return sum(e.size for e in self.entries if e.path is not None)

    def _keep_budgets(self) -> None:
        for entry in sorted((e for e in self.entries if e.data is not None), key=lambda e: e.used):
            if self.ram_used <= self.ram_bytes:
                break
            data = entry.data
            if self._writer is not None and entry.path is None and data is not None:
                entry.data = None  # the writer holds the bytes until the file is whole
                self._writer.submit(self._write, entry, data)
            elif entry.path is not None:
                entry.data = None
            else:
                self._drop([entry])
        if self.directory is not None:
            for entry in sorted((e for e in self.entries if e.path is not None), key=lambda e: e.used):
                if self.disk_used <= self.disk_bytes:
                    break
                self._unlink(entry)

    def _drop(self, entries: list[Spilled]) -> None:
        for entry in entries:
            if entry in self.entries:
                self.entries.remove(entry)
            if entry.path is not None:
                self._unlink(entry)

    def _unlink(self, entry: Spilled) -> None:
        path, entry.path = entry.path, None
        if path is not None:
            try:
                path.unlink()
            except OSError:
                pass
        if entry.data is None and entry in self.entries:
            self.entries.remove(entry)

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    # -- disk -------------------------------------------------------------------------------------
    def _write(self, entry: Spilled, data: bytes) -> None:
        assert self.directory is not None
        try:
            path, digest = write_state(self.directory, self.fingerprint, entry.scope, entry.tokens, data, self.key)
        except OSError as exc:
            log.warning("prefix cache entry of %d tokens not written: %s", len(entry.tokens), exc)
            with self._lock:
                self._drop([entry])
            return
        with self._lock:
            if entry in self.entries:
                entry.path, entry.digest = path, digest
                self._keep_budgets()
            else:  # dropped meanwhile
                path.unlink(missing_ok=True)

    def persist(self, tokens: Seq[int], scope: str, data: bytes) -> None:
        """Write an entry straight to disk (a slot's entry at a graceful stop; the caller asked wants() before
        saving the state)."""
        if self._writer is not None:
            entry = Spilled(tuple(tokens), scope, size=len(data))
            with self._lock:
                entry.used = self._tick()
                self.entries.append(entry)
            self._writer.submit(self._write, entry, data)

    def close(self) -> None:
        """Write what is only in RAM to disk (when there is a directory), and wait for the writes."""
        if self._writer is None:
            return
        with self._lock:
            only_ram = [e for e in self.entries if e.path is None and e.data is not None]
        for entry in only_ram:
            if entry.data is not None:
                self._writer.submit(self._write, entry, entry.data)
        self._writer.shutdown(wait=True)

    def _index(self) -> None:
        """The directory's entries for this model; the rest ignored and logged. Temporary files a write left behind
        (a crash while writing) go, unless they are younger than a minute (another server's write in progress)."""
        assert self.directory is not None
        stale = 0
        for tmp in self.directory.glob("*.tmp"):
            try:
                if time.time() - tmp.stat().st_mtime > TMP_GRACE_S:
                    tmp.unlink()
                    stale += 1
            except OSError:
                pass
        if stale:
            log.info("prefix cache: removed %d unfinished file(s) from %s", stale, self.directory)
        found = []
        for path in sorted(self.directory.glob(f"*{SUFFIX}"), key=_mtime):
            try:
                header = read_header(path)
            except (OSError, ValueError) as exc:
                log.warning("prefix cache file %s ignored: %s", path, exc)
                continue
            if header.get("fingerprint") != self.fingerprint:
                log.warning("prefix cache file %s ignored: made for another model or build", path)
                continue
            found.append(Spilled(tuple(header["tokens"]), header["scope"], path=path, size=header["size"],
                                 used=self._tick(), digest=header["mac"]))
        self.entries = found
        self._keep_budgets()
        if found:
            log.info("prefix cache: %d entries (%d MiB) on disk in %s", len(found), self.disk_used >> 20,
                     self.directory)


def _mtime(path: Path) -> float:
    try:
        return path.lstat().st_mtime
    except OSError:  # gone meanwhile (another server's eviction): read_header says so
        return 0.0


def directory_key(directory: Path) -> bytes:
    """The directory's MAC key: read from its key file, or made (0600, exclusively) by the first server there. A key
    file of the wrong size or kind is moved aside, logged, and a new one made: the files signed with the old key no
    longer verify, and each is dropped (logged) when a prompt first reaches it, as a corrupt one is."""
    path = directory / KEY_FILE
    for _ in range(3):
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            key = _read_key(path)
            if key is not None:
                return key
            continue
        key = secrets.token_bytes(KEY_BYTES)
        with os.fdopen(fd, "wb") as f:
            f.write(key)
        log.info("prefix cache: made the MAC key %s", path)
        return key
    raise OSError(f"prefix cache: no usable key file at {path}")


def _read_key(path: Path) -> bytes | None:
    """The key in `path`; None after moving a key file that is not one aside (or if another server just did)."""
    try:
        st = path.lstat()
        if stat.S_ISREG(st.st_mode) and st.st_size == KEY_BYTES:
            with open(path, "rb") as f:
                key = f.read(KEY_BYTES + 1)
            if len(key) == KEY_BYTES:
                return key
        if st.st_size == 0 and time.time() - st.st_mtime < 1:
            time.sleep(0.1)  # another server is writing it
            return None
        aside = path.with_name(f"{path.name}.bad-{int(time.time())}")
        os.replace(path, aside)
        log.warning("prefix cache: key file %s was not a %d-byte file; moved to %s, and a new key made (the files "
                    "signed with the old one are ignored)", path, KEY_BYTES, aside)
    except FileNotFoundError:
        pass
    return None


def _mac(key: bytes, fingerprint: str, scope: str, tokens: Seq[int], data: bytes) -> str:
    mac = hmac.new(key, json.dumps([fingerprint, scope, list(tokens)]).encode() + b"\x00", hashlib.sha256)
    mac.update(data)
    return mac.hexdigest()


def write_state(directory: Path, fingerprint: str, scope: str, tokens: tuple[int, ...], data: bytes,
                key: bytes) -> tuple[Path, str]:
    """One entry's file, written whole or not at all (a temporary file renamed); returns it and its MAC."""
    digest = _mac(key, fingerprint, scope, tokens, data)
    name = hashlib.sha256(f"{fingerprint}\x00{scope}\x00{tokens}".encode()).hexdigest()[:40]
    header = json.dumps({"fingerprint": fingerprint, "scope": scope, "tokens": list(tokens), "size": len(data),
                         "mac": digest}).encode()
    path = directory / f"{name}{SUFFIX}"
    tmp = path.with_name(f"{name}.{os.getpid()}.{threading.get_ident()}.tmp")  # no other writer's
    try:
        with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as f:  # its owner's alone
            f.write(MAGIC + len(header).to_bytes(8, "little") + header)
            f.write(data)
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)  # a full disk leaves no half file behind
        raise
    return path, digest


def read_header(path: Path) -> dict[str, Any]:
    with open_regular(path) as f:
        return _header(f, os.fstat(f.fileno()).st_size)


def _header(f: BinaryIO, file_size: int) -> dict[str, Any]:
    magic = f.read(len(MAGIC))
    if magic != MAGIC:
        raise ValueError("written by an older servelm" if magic.startswith(MAGIC[:-2]) else
                         "not a servelm prefix cache file")
    length = int.from_bytes(f.read(8), "little")
    if not 0 < length <= file_size:
        raise ValueError("its header is cut short")
    try:
        header = json.loads(f.read(length))
        ok = (isinstance(header, dict) and isinstance(header.get("tokens"), list) and isinstance(header.get("size"), int)
              and isinstance(header.get("scope"), str) and isinstance(header.get("mac"), str))
    except ValueError as exc:
        raise ValueError("its header is not JSON") from exc
    if not ok or len(MAGIC) + 8 + length + header["size"] != file_size:
        raise ValueError("its header does not describe the file")
    return dict(header)


def read_state(path: Path, fingerprint: str, key: bytes, digest: str) -> bytes:
    """The state of the file indexed with MAC `digest`, if its MAC over the header's tokens and the state holds."""
    with open_regular(path) as f:
        header = _header(f, os.fstat(f.fileno()).st_size)
        if header["fingerprint"] != fingerprint:
            raise ValueError("made for another model or build")
        data = f.read()
    mac = _mac(key, fingerprint, header["scope"], header["tokens"], data)
    if not (hmac.compare_digest(mac, digest) and hmac.compare_digest(digest, header["mac"])):
        raise ValueError("its MAC does not match its tokens and state (corrupt, or signed with another key)")
    return data
