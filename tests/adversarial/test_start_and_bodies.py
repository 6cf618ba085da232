"""What an operator's slip at start, and an oversized body, did to the server.

- A read-only database file (`chattr +i servelm.db`) passed the start-up check, and `POST /v1/conversations` then
  answered 500 with a traceback. Start-up now tries a write (rolled back) and refuses in one line; a write refused
  while serving is a 503 `store_damaged`.
- A foreign SQLite file, refused at start, was switched to WAL mode before the refusal that said "Nothing was
  changed": its bytes changed. The checks now read only, and nothing of ours is left in the directory.
- `--n-gpu-layers -5`, `--main-gpu -1` and a comma list for `--allowed-mcp-servers` printed pydantic's multi-line
  errors, and a `--state-dir` that is a file a bare `[Errno 20]`. Each is one line naming the flag.
- `SERVELM_CUDA=1` on a machine without a GPU was silently ignored; the log now says the CPU build is served.
- A body of 200,000 empty messages (6.8 MB, within --max-body-bytes) took 160 MiB while pydantic built a model of
  each, before the 2,048-message bound refused it, for a second on the event loop. A body's JSON objects and arrays
  are now counted first (at most 32,768), and a long body is validated off the event loop.
"""

from __future__ import annotations

import hashlib
import json
import os
import resource
import shutil
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from servelm.__main__ import invalid_setting, settings_from_args
from servelm.batch.store import BatchStore, StoreDamaged
from servelm.errors import InvalidParameter, ServiceUnavailable
from servelm.http.limits import MAX_JSON_CONTAINERS, MAX_JSON_DEPTH, check_json_containers
from servelm.protocol.common import MAX_MESSAGES

CHATTR = shutil.which("chattr")


def _immutable(path: Path, on: bool) -> bool:
    """chattr +i / -i: False where the file system or the user may not (then the test is skipped)."""
    if CHATTR is None:
        return False
    return subprocess.run([CHATTR, "+i" if on else "-i", str(path)], capture_output=True).returncode == 0


@pytest.fixture
def read_only_db(tmp_path):
    BatchStore(tmp_path).close()
    db = tmp_path / "servelm.db"
    if not _immutable(db, True):
        pytest.skip("chattr +i is not allowed here")
    yield tmp_path
    _immutable(db, False)


def test_a_read_only_database_is_refused_at_start_in_one_line(read_only_db):
    with pytest.raises(StoreDamaged) as caught:
        BatchStore(read_only_db).close()
    message = str(caught.value)
    assert "cannot be written" in message and str(read_only_db / "servelm.db") in message and "\n" not in message


def test_servelm_serve_refuses_a_read_only_database_in_one_line(read_only_db, tmp_path_factory):
    models = tmp_path_factory.mktemp("models")
    done = subprocess.run([sys.executable, "-m", "servelm", "serve", "--models-dir", str(models),
                           "--state-dir", str(read_only_db), "--port", "0"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr[-2000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("servelm: ") and "cannot be written" in last


def test_a_write_refused_while_serving_is_store_damaged_not_a_500(tmp_path):
    store = BatchStore(tmp_path)
    try:
        store._db.execute("PRAGMA query_only = ON")  # what a read-only file does to every write from here on
        with pytest.raises(StoreDamaged) as caught:
            with store.transaction() as db:
                db.execute("INSERT INTO claims VALUES ('a', 'b', 1)")
        assert caught.value.status == 503 and caught.value.code == "store_damaged"
        assert store.health()["status"] == "damaged"
    finally:
        store.close()


def test_a_foreign_database_refused_at_start_is_left_byte_for_byte_and_nothing_of_ours_is_left(tmp_path):
    db = tmp_path / "servelm.db"
    with sqlite3.connect(db) as other:
        other.execute("CREATE TABLE notes (text TEXT)")
        other.execute("INSERT INTO notes VALUES ('mine')")
    before = hashlib.sha256(db.read_bytes()).hexdigest()
    with pytest.raises(StoreDamaged):
        BatchStore(tmp_path).close()
    assert hashlib.sha256(db.read_bytes()).hexdigest() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["servelm.db"], "no -wal, -shm, lock or files/ of ours"


def test_a_state_dir_that_is_a_file_says_so_and_names_the_flag(tmp_path):
    path = tmp_path / "state"
    path.write_text("not a directory")
    with pytest.raises(NotADirectoryError) as caught:
        BatchStore(path)
    assert "--state-dir" in str(caught.value) and "is not a directory" in str(caught.value)


@pytest.mark.parametrize("argv, flag", [
    (["--n-gpu-layers", "-5"], "--n-gpu-layers"),
    (["--main-gpu", "-1"], "--main-gpu"),
    (["--allowed-mcp-servers", "http://a.example,http://b.example"], "--allowed-mcp-servers"),
    (["--port", "99999"], "--port"),
    (["--max-waiting", "-1"], "--max-waiting"),
    (["--itl-target-ms", "-3"], "--itl-target-ms"),
])
def test_a_bad_flag_value_is_one_line_naming_the_flag(argv, flag):
    done = subprocess.run([sys.executable, "-m", "servelm", "serve", *argv], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and flag in lines[0] and "pydantic" not in lines[0], done.stderr


def test_an_argument_error_is_one_line_naming_the_flag():
    done = subprocess.run([sys.executable, "-m", "servelm", "serve", "--kv-cache-type", "q2"], capture_output=True,
                          text=True, timeout=60)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1 and "--kv-cache-type" in lines[0], done.stderr


def test_a_comma_list_for_a_repeatable_flag_says_to_repeat_it():
    import argparse

    args = argparse.Namespace(allowed_mcp_servers=["http://a.example,http://b.example"])
    with pytest.raises(Exception) as caught:
        settings_from_args(args)
    assert "give it once for each" in invalid_setting(caught.value)


def test_a_secret_is_never_echoed_in_a_bad_setting():
    import argparse

    args = argparse.Namespace(allowed_mcp_servers=["sk-secret-looking-thing"], api_key=["x"])
    with pytest.raises(Exception) as caught:
        settings_from_args(args)
    said = invalid_setting(caught.value)
    assert said.count("sk-secret-looking-thing") <= 1 and "input_value" not in said


def test_servelm_cuda_without_a_gpu_says_that_the_cpu_build_is_served():
    from servelm.compose import cuda_note

    note = cuda_note("smollm2", "CPU", {"SERVELM_CUDA": "1"})
    assert note is not None and "CPU build is served" in note and "smollm2" in note
    assert cuda_note("smollm2", "CUDA0 (31/31 layers)", {"SERVELM_CUDA": "1"}) is None
    assert cuda_note("smollm2", "CPU", {}) is None


# -- the 200,000-message body -------------------------------------------------------------------------------
def _many_messages(n: int) -> bytes:
    return json.dumps({"model": "fake-model", "messages": [{"role": "user", "content": ""}] * n}).encode()


def test_a_body_of_too_many_json_objects_is_refused_before_any_is_built():
    body = _many_messages(200_000)
    assert len(body) < 8 << 20, "within the default body limit"
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(Exception) as caught:
        check_json_containers(body)
    grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert "at most 32768" in str(caught.value) and grown < 32, f"{grown:.0f} MiB"


def test_braces_inside_strings_are_not_counted():
    body = json.dumps({"messages": [{"role": "user", "content": "{[" * (MAX_JSON_CONTAINERS + 10)}]}).encode()
    check_json_containers(body)


def test_over_http_the_body_is_a_400_in_the_envelope_and_the_event_loop_serves_others_meanwhile(fake_server):
    """The oversized body is a 400 that names the bound, and while a worker thread counts it the event loop keeps
    answering a neighbour's /health."""
    body = _many_messages(200_000)
    lags: list[float] = []
    done = threading.Event()

    def neighbour() -> None:
        with httpx.Client(timeout=30) as client:
            while not done.is_set():
                start = time.monotonic()
                client.get(fake_server.base_url + "/health")
                lags.append(time.monotonic() - start)
                time.sleep(0.01)

    thread = threading.Thread(target=neighbour)
    thread.start()
    try:
        r = httpx.post(fake_server.base_url + "/v1/chat/completions", content=body,
                       headers={"content-type": "application/json"}, timeout=60)
    finally:
        done.set()
        thread.join()
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", r.text[:300]
    assert "JSON objects and arrays" in r.json()["error"]["message"]
    assert max(lags) < 0.5, f"a neighbour's /health waited {max(lags):.2f} s"
    ok = httpx.post(fake_server.base_url + "/v1/chat/completions", timeout=30, json={
        "model": "fake-model", "messages": [{"role": "user", "content": "hi"}] * MAX_MESSAGES, "max_tokens": 1})
    assert ok.status_code != 500


def test_a_state_dir_file_over_serve_is_one_line(tmp_path):
    path = tmp_path / "state"
    path.write_text("x")
    models = tmp_path / "models"
    models.mkdir()
    env = {**os.environ}
    done = subprocess.run([sys.executable, "-m", "servelm", "serve", "--models-dir", str(models), "--state-dir",
                           str(path), "--port", "0"], capture_output=True, text=True, timeout=60, env=env)
    last = done.stderr.strip().splitlines()[-1]
    assert done.returncode == 1 and "--state-dir" in last and "Errno" not in last, done.stderr[-1000:]


def test_a_string_never_closed_is_counted_in_one_pass_not_one_a_quote():
    """Past the bound's first count, a body of escaped quotes in a string never closed (`"\\"\\"\\"…`) had each quote
    start a scan to the end: 16,000 of them took 17 s, a 3 MB body hours of a worker's CPU."""
    body = b"[" * (MAX_JSON_CONTAINERS + 10) + b'"' + b'\\"' * 200_000
    start = time.monotonic()
    with pytest.raises(InvalidParameter, match="JSON objects and arrays"):
        check_json_containers(body)
    assert time.monotonic() - start < 5.0


@pytest.mark.parametrize("option", ["weight=1_0", "weight=\uff11", "weight=1 weight=2", "rpm=1_000", "rpm=\u0661",
                                    "name=", "deployments=", "max_share=0.5 max_share=1", "tpm=99999999999999999999",
                                    "weight=1e9999", "max_share=nan", "weight=0x10", "monitor monitor",
                                    "name=other", "name=server", "name=" + "n" * 65, "name=a\x1bb",
                                    "name=cr\rnext-key", "name=a\x1cb", "name=\u2028x"])
def test_a_key_file_line_spelled_oddly_or_twice_is_refused_naming_it(option):
    """A key file's numbers are ASCII decimals (Python's float() and int() also take `1_0` and other scripts' digits),
    and each setting comes once: a second one silently won before."""
    from servelm.keys import parse_key_file

    with pytest.raises(ValueError, match=r"line 1: .*(weight|rpm|tpm|name|deployments|max_share|monitor|control)"):
        parse_key_file(f"sk-odd {option}\n")


def test_the_names_a_key_may_not_take_are_the_metrics_own():
    from servelm.engine.fairness import OTHER, SERVER
    from servelm.keys import RESERVED_NAMES

    assert {OTHER, SERVER} == RESERVED_NAMES


def test_a_key_file_line_spelled_plainly_still_reads():
    from servelm.keys import parse_key_file

    (spec,) = parse_key_file("sk-ok weight=2.5 max_share=.25 rpm=60 min_priority=-3 name=team-a deployments=a,b\n")
    assert (spec.weight, spec.max_share, spec.rpm, spec.min_priority, spec.name) == (2.5, 0.25, 60, -3, "team-a")
    assert spec.deployments == frozenset({"a", "b"})


def test_a_database_whose_writes_fail_while_serving_is_a_503_and_health_says_so(tmp_path):
    """chattr +i on the database and its -wal while serving made each write's COMMIT a `disk I/O error`: a 500 to
    the client (the store's generated answer lost unsaid), and /health went on saying ok."""
    store = BatchStore(tmp_path)
    real = store._db

    class Failing:  # COMMIT as an immutable -wal makes it fail
        def __init__(self) -> None:
            self.fail = True

        def execute(self, sql, *args):
            if self.fail and sql == "COMMIT":
                raise sqlite3.OperationalError("disk I/O error")
            return real.execute(sql, *args)

        def __getattr__(self, name):
            return getattr(real, name)

    failing = Failing()
    store._db = failing
    try:
        for _ in range(2):  # the second too: a failed COMMIT left no transaction open to wedge the next BEGIN
            with pytest.raises(ServiceUnavailable) as caught:
                with store.transaction() as db:
                    db.execute("INSERT INTO claims VALUES ('a', 'b', 1)")
            assert caught.value.status == 503 and caught.value.code == "store_unavailable"
            assert "disk I/O error" not in caught.value.message and str(tmp_path) not in caught.value.message
        report = store.health()
        assert report["status"] == "failing" and "disk I/O error" in str(report["error"])
        failing.fail = False
        with store.transaction() as db:
            db.execute("INSERT INTO claims VALUES ('a', 'b', 1)")
        assert store.health()["status"] == "ok" and "error" not in store.health()
    finally:
        store._db = real
        store.close()


def test_a_file_that_cannot_be_written_while_serving_is_a_503_not_a_500(tmp_path):
    store = BatchStore(tmp_path)
    try:
        shutil.rmtree(store.files_dir)
        store.files_dir.write_text("in the way")  # what an immutable files/ does to a write: an OSError
        with pytest.raises(ServiceUnavailable) as caught:
            store.add_file("owner", "a.jsonl", "batch", b"{}\n")
        assert caught.value.status == 503 and caught.value.code == "store_unavailable"
        assert store.files(owner="owner") == [] and store.health()["status"] == "failing"
    finally:
        store.close()


@pytest.mark.parametrize("depth", [MAX_JSON_DEPTH + 1, 256, 5000])
def test_json_nested_too_deep_is_a_400_naming_the_field_and_the_bound(depth):
    """Valid JSON nested 256 deep or more was answered "could not parse the JSON body" (pydantic's parser gives up),
    naming no field."""
    schema = "[" * depth + "]" * depth
    body = ('{"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": ' + schema + "}").encode()
    with pytest.raises(InvalidParameter, match=f"{depth + 1} deep") as caught:  # the body itself is one
        check_json_containers(body)
    assert caught.value.param == "tools" and str(MAX_JSON_DEPTH) in caught.value.message


def test_json_nested_to_the_bound_and_brackets_in_strings_pass():
    check_json_containers(("{" + '"a": ' * 0 + '"x": ' + "[" * (MAX_JSON_DEPTH - 1) + "]" * (MAX_JSON_DEPTH - 1)
                           + "}").encode())
    check_json_containers(json.dumps({"content": "[" * 10_000}).encode())
