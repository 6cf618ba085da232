"""The Batch API's state on disk, and its tenants' limits, as a careless operator and a greedy client meet them.

- A missing or empty `servelm.db` made every stored file an orphan, and start-up unlinked them all without a word.
  Files the database does not know are now moved aside into `orphans/<time>/` under the state directory; the log
  and /health say how many and where.
- A damaged database (garbage, a garbage page, another program's database, a folder in its place) stopped start-up
  with a raw traceback, or let the server start and answer 500s. Start-up now checks it (`PRAGMA quick_check`, its
  tables) and refuses in one line that names the file and the fix; damage met while serving is a 503
  `store_damaged` in the envelope, and /health says so.
- A batch's lines skipped its key's rate limits (tpm=200 used 1,717 tokens in 21 s). They now wait for the key's
  budget (paced, never refused), before they take a place among the lines in flight, so a paced batch holds up no
  other key's batch.
"""

from __future__ import annotations

import asyncio
import json
import math
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from servelm.batch.store import BatchStore, StoreDamaged
from servelm.http.batches import BatchConfig
from servelm.http.limits import SecurityConfig
from servelm.keys import key_spec

MSG = [{"role": "user", "content": "hi"}]


def stored(directory: Path, count: int = 3) -> dict[str, bytes]:
    """A store holding `count` files, closed again: each file's id and bytes."""
    store = BatchStore(directory)
    files = {}
    for i in range(count):
        data = f'{{"n": {i}}}\n'.encode()
        files[store.add_file("", f"f{i}.jsonl", "batch", data).id] = data
    store.close()
    return files


def moved_aside(directory: Path) -> dict[str, bytes]:
    """Every file under orphans/, by name."""
    return {p.name: p.read_bytes() for p in (directory / "orphans").rglob("*") if p.is_file()}


# -- finding 8: files the database does not know ---------------------------------------------------------
@pytest.mark.parametrize("how", ["missing", "empty"])
def test_a_missing_or_empty_database_moves_every_file_aside_and_says_where(tmp_path, caplog, how):
    files = stored(tmp_path)
    db = tmp_path / "servelm.db"
    for extra in ("-wal", "-shm"):
        Path(f"{db}{extra}").unlink(missing_ok=True)
    if how == "missing":
        db.unlink()
    else:
        db.write_bytes(b"")
    with caplog.at_level("WARNING", logger="servelm.batch"):
        store = BatchStore(tmp_path)
    try:
        kept = moved_aside(tmp_path)
        assert {f"{i}.jsonl": d for i, d in files.items()} == kept, "every file is kept, byte for byte"
        assert not list((tmp_path / "files").iterdir())
        report = store.health()["orphans"]
        assert report["count"] == 3 and Path(report["moved_to"]).is_dir()
        assert report["moved_to"] in caplog.text and "3" in caplog.text
        assert store.files("") == [], "the store starts empty; nothing it did not know is served"
    finally:
        store.close()


def test_anything_unknown_in_the_files_folder_is_moved_aside_and_known_files_stay(tmp_path):
    files = stored(tmp_path, 1)
    (tmp_path / "files" / "notes.txt").write_text("an operator's")
    (tmp_path / "files" / "a-folder").mkdir()
    (tmp_path / "files" / "a-folder" / "inner").write_text("x")
    (tmp_path / "files" / "file-0123456789abcdef01234567.jsonl").write_text("no row names it")
    store = BatchStore(tmp_path)  # used to raise IsADirectoryError on the folder (after unlinking the others)
    try:
        (file_id, data), = files.items()
        assert store.content("", file_id) == data
        assert set(moved_aside(tmp_path)) == {"notes.txt", "inner", "file-0123456789abcdef01234567.jsonl"}
        assert store.health()["orphans"]["count"] == 3
    finally:
        store.close()
    again = BatchStore(tmp_path)  # a clean start: nothing to move, no report
    try:
        assert again.health().get("orphans") is None and again.content("", file_id) == data
    finally:
        again.close()


def test_something_else_where_a_folder_of_the_state_goes_is_named(tmp_path):
    (tmp_path / "files").write_text("not a folder")
    with pytest.raises(NotADirectoryError, match=str(tmp_path / "files")):
        BatchStore(tmp_path)


def test_a_second_store_on_the_same_directory_is_refused_not_let_sweep_the_first(tmp_path):
    first = BatchStore(tmp_path)
    with pytest.raises(OSError, match="another servelm process uses the state directory"):
        BatchStore(tmp_path)  # it would have taken the first one's file being written for an orphan
    first.close()
    BatchStore(tmp_path).close()


def test_health_says_what_was_moved_aside(fake_server_factory, tmp_path):
    state = tmp_path / "state"
    (state / "files").mkdir(parents=True)
    for i in range(2):
        (state / "files" / f"file-{i:024x}.jsonl").write_text("{}\n")
    server = fake_server_factory(batches=BatchConfig(str(state)))
    report = httpx.get(f"{server.base_url}/health").json()["batch_store"]
    assert report["status"] == "ok" and report["orphans"]["count"] == 2
    assert str(state / "orphans") in report["orphans"]["moved_to"]


# -- finding 10: a damaged database ---------------------------------------------------------------------
def _garbage(db: Path) -> None:
    db.write_bytes(b"not a database, " * 512)


def _garbage_page(db: Path, every: bool = False) -> None:
    """The files table's root page (page 2; `every`: all pages but the first) overwritten: the header is fine, the
    database opens."""
    with open(db, "r+b") as f:
        page = int.from_bytes(_header(db)[16:18], "big")
        f.seek(page)
        f.write(b"\xde\xad\xbe\xef" * (page // 4) * (db.stat().st_size // page - 1 if every else 1))


def _header(db: Path) -> bytes:
    with open(db, "rb") as f:
        return f.read(100)


def _foreign(db: Path) -> None:
    db.unlink()
    with sqlite3.connect(db) as other:
        other.execute("CREATE TABLE files (path TEXT, mtime REAL)")


def _folder(db: Path) -> None:
    db.unlink()
    db.mkdir()


@pytest.mark.parametrize("damage", [_garbage, _garbage_page, _foreign, _folder])
def test_a_damaged_database_stops_start_up_naming_the_file_and_the_fix(tmp_path, damage):
    files = stored(tmp_path, 3)
    db = tmp_path / "servelm.db"
    damage(db)
    with pytest.raises(StoreDamaged) as caught:
        BatchStore(tmp_path).close()
    message = str(caught.value)
    assert str(db) in message and "move it aside" in message and "\n" not in message
    assert sorted(p.name for p in (tmp_path / "files").iterdir()) == sorted(f"{i}.jsonl" for i in files), \
        "nothing was moved or deleted"
    assert not (tmp_path / "orphans").exists()


def test_servelm_serve_refuses_a_damaged_store_in_one_line(tmp_path):
    stored(tmp_path / "state", 1)
    _garbage_page(tmp_path / "state" / "servelm.db")
    (tmp_path / "models").mkdir()
    done = subprocess.run([sys.executable, "-m", "servelm", "serve", "--models-dir", str(tmp_path / "models"),
                           "--state-dir", str(tmp_path / "state"), "--port", "0"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 1, done.stderr[-2000:]
    assert "Traceback" not in done.stderr, done.stderr[-2000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("servelm: ") and str(tmp_path / "state" / "servelm.db") in last and "move it aside" in last


def _damaged_later(directory: Path) -> BatchStore:
    """A store that passed its start-up check, whose disk then fails: a garbage page under its connection."""
    stored(directory, 2)
    store = BatchStore(directory)
    store.close()  # its connection and the state directory's lock
    _garbage_page(store.db_path, every=True)
    store._db = sqlite3.connect(store.db_path, check_same_thread=False, isolation_level=None)
    return store


def test_damage_met_while_serving_is_a_503_in_the_envelope_and_health_says_so(tmp_path, caplog):
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from servelm.http import errors
    from servelm.http.batches import build_batch_router

    store = _damaged_later(tmp_path)
    db = store.db_path
    app = FastAPI()
    errors.install(app)
    app.include_router(build_batch_router(store, None, BatchConfig(str(tmp_path))))  # type: ignore[arg-type]
    with caplog.at_level("ERROR", logger="servelm.batch"), TestClient(app, raise_server_exceptions=False) as client:
        answer = client.get("/v1/files")
        again = client.get("/v1/files")
    assert answer.status_code == 503 and answer.json()["error"]["code"] == "store_damaged", answer.text
    assert again.status_code == 503
    assert str(tmp_path) not in answer.text, "a client is told what broke, not where the server keeps it"
    report = store.health()
    assert report["status"] == "damaged" and str(db) in report["error"]
    logged = [r for r in caplog.records if str(db) in r.getMessage()]
    assert len(logged) == 1, "logged once, with the file, not at every request"
    store.close()  # its connection and the state directory's lock


# -- finding 11: a key's rate limits pace its batch lines ------------------------------------------------
def _jsonl(count: int, max_tokens: int = 3) -> bytes:
    return b"".join(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
                                "body": {"model": "fake-model", "messages": MSG, "max_tokens": max_tokens}}).encode()
                    + b"\n" for i in range(count))


def _start_batch(base: str, key: str, count: int) -> str:
    auth = {"Authorization": f"Bearer {key}"}
    f = httpx.post(f"{base}/v1/files", headers=auth, files={"file": ("in.jsonl", _jsonl(count))},
                   data={"purpose": "batch"})
    assert f.status_code == 200, f.text
    b = httpx.post(f"{base}/v1/batches", headers=auth, json={"input_file_id": f.json()["id"],
                                                             "endpoint": "/v1/chat/completions",
                                                             "completion_window": "24h"})
    assert b.status_code == 200, b.text
    return str(b.json()["id"])


def _lines_answered(base: str) -> float:
    text = httpx.get(f"{base}/metrics", headers={"Authorization": "Bearer sk-monitor"}).text
    return sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples
               if s.name == "servelm_batch_lines_total")


def _batch(base: str, key: str, batch_id: str) -> dict:
    answer = httpx.get(f"{base}/v1/batches/{batch_id}", headers={"Authorization": f"Bearer {key}"})
    assert answer.status_code == 200, answer.text
    return dict(answer.json())


def _keyed_server(fake_server_factory, tmp_path, *keys):
    security = SecurityConfig(keys=[*keys, key_spec("sk-monitor", monitor=True), key_spec("sk-free")])
    return fake_server_factory(security=security, batches=BatchConfig(str(tmp_path / "state"), max_lines=200))


def _line_cost(base: str) -> int:
    """One line's tokens, as its key's bucket is charged: prompt and completion (asked by a key without limits)."""
    usage = httpx.post(f"{base}/v1/chat/completions", headers={"Authorization": "Bearer sk-free"},
                       json={"model": "fake-model", "messages": MSG, "max_tokens": 3}).json()["usage"]
    return int(usage["prompt_tokens"]) + int(usage["completion_tokens"])


def _until_answered(base: str, count: int, timeout: float = 60.0) -> float:
    start = time.monotonic()
    while _lines_answered(base) < count:
        assert time.monotonic() - start < timeout, f"{_lines_answered(base)} of {count} lines answered"
        time.sleep(0.1)
    return time.monotonic() - start


def test_a_keys_tokens_per_minute_pace_its_batch_lines(fake_server_factory, tmp_path):
    tpm = 600  # 10 tokens a second
    server = _keyed_server(fake_server_factory, tmp_path, key_spec("sk-tpm", tpm=tpm))
    base = server.base_url
    cost = _line_cost(base)
    count = math.ceil((tpm + 30 + 2 * cost) / cost)  # past the full bucket by 3 s of refill and two lines
    batch_id = _start_batch(base, "sk-tpm", count)
    elapsed = _until_answered(base, count)
    done = _batch(base, "sk-tpm", batch_id)
    assert done["request_counts"] == {"total": count, "completed": count, "failed": 0}, "paced, never refused"
    used = done["usage"]["total_tokens"]
    assert used == count * cost
    assert used <= tpm + tpm / 60 * elapsed + cost, f"{used} tokens in {elapsed:.1f} s on tpm={tpm}"


def test_a_keys_requests_per_minute_pace_its_batch_lines(fake_server_factory, tmp_path):
    rpm = 60  # one a second
    server = _keyed_server(fake_server_factory, tmp_path, key_spec("sk-rpm", rpm=rpm))
    base = server.base_url
    count = rpm + 3
    batch_id = _start_batch(base, "sk-rpm", count)  # two requests of the key's own
    elapsed = _until_answered(base, count)
    assert count + 2 <= rpm + rpm / 60 * elapsed + 1, f"{count} lines in {elapsed:.1f} s on rpm={rpm}"
    time.sleep(1.1)  # a place in the bucket to read the batch
    assert _batch(base, "sk-rpm", batch_id)["request_counts"]["completed"] == count


def test_a_paced_batch_holds_no_place_another_keys_batch_needs(fake_server_factory, tmp_path):
    server = _keyed_server(fake_server_factory, tmp_path, key_spec("sk-slow", tpm=60))
    base = server.base_url
    slow = _start_batch(base, "sk-slow", 40)  # minutes of its key's budget
    time.sleep(0.5)
    fast = _start_batch(base, "sk-free", 8)
    deadline = time.monotonic() + 15
    while _batch(base, "sk-free", fast)["status"] != "completed":
        assert time.monotonic() < deadline, "another key's batch waited on the paced one"
        time.sleep(0.1)
    assert _batch(base, "sk-slow", slow)["status"] == "in_progress"
    cancel = httpx.post(f"{base}/v1/batches/{slow}/cancel", headers={"Authorization": "Bearer sk-slow"})
    assert cancel.status_code == 200
    deadline = time.monotonic() + 10
    while _batch(base, "sk-slow", slow)["status"] != "cancelled":
        assert time.monotonic() < deadline, "a line waiting for its key's budget held up the cancel"
        time.sleep(0.1)


async def test_the_batch_runner_outlives_a_damaged_store(tmp_path, monkeypatch, caplog):
    from servelm.batch import runner as runner_module
    from servelm.batch.runner import BatchRunner

    monkeypatch.setattr(runner_module, "POLL_S", 0.01)
    store = _damaged_later(tmp_path)

    async def caller(endpoint, body, owner):
        raise AssertionError("no line runs from a damaged store")

    runner = BatchRunner(store, caller, priority=10, max_lines=10, in_flight=lambda: 1)
    with caplog.at_level("ERROR", logger="servelm.batch"):
        runner.start()
        await asyncio.sleep(0.3)  # many polls
        assert runner._loop_task is not None and not runner._loop_task.done(), "the runner's loop died"
        await runner.stop()
    assert len([r for r in caplog.records if r.levelname == "ERROR"]) == 1
    assert store.health()["status"] == "damaged"
    store.close()  # its connection and the state directory's lock
