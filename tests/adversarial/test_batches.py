"""The Files and Batches API, attacked: batch files that cost memory by the size of what is stored, parsing and
uploads on the event loop, poison lines and windows that leave a batch unfinished for ever, and stored files served
short. Each attack runs at a small scale that still shows the fault (a few MiB, not 200)."""

from __future__ import annotations

import gc
import json
import logging
import os
import threading
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path

import httpx
import pytest

from servelm.batch.lines import BatchLine
from servelm.batch.store import BatchStore
from servelm.http.batches import BatchConfig, new_batch
from tests.adversarial.loop import loop_responsive

MiB = 1 << 20
ENDED = ("completed", "failed", "cancelled", "expired")


def line(i: int, url: str = "/v1/chat/completions", **body) -> bytes:
    return json.dumps({"custom_id": f"c{i}", "method": "POST", "url": url, "body": body},
                      separators=(",", ":")).encode() + b"\n"


def chat(i: int, **extra) -> bytes:
    return line(i, model="fake-model", messages=[{"role": "user", "content": "hi"}], max_tokens=4, **extra)


def empties(i: int, n: int) -> bytes:
    """A line whose body holds a list of n `{}`: 3 bytes of JSON each, about 64 bytes once parsed. `stream` makes
    the runner answer it at once (a 400 of its own), so what it costs is the reading alone."""
    return line(i, stream=True, messages=[{}] * n)


def upload(base: str, data: bytes, name: str = "in.jsonl") -> httpx.Response:
    return httpx.post(f"{base}/v1/files", files={"file": (name, data)}, data={"purpose": "batch"}, timeout=60)


def create(base: str, file_id: str, window: str = "24h", endpoint: str = "/v1/chat/completions") -> httpx.Response:
    return httpx.post(f"{base}/v1/batches", json={"input_file_id": file_id, "endpoint": endpoint,
                                                   "completion_window": window}, timeout=30)


def wait_ended(base: str, batch_id: str, timeout: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout
    batch: dict = {}
    while time.monotonic() < deadline:
        batch = httpx.get(f"{base}/v1/batches/{batch_id}").json()
        if batch["status"] in ENDED:
            return batch
        time.sleep(0.05)
    raise AssertionError(f"batch {batch_id} is still {batch.get('status')} after {timeout} s")


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@contextmanager
def peak_rss_growth():
    """This process's (the test server's) largest RSS growth over the block, sampled every 5 ms: {"mib": ...}."""
    gc.collect()
    base, peak, done = rss(), [0], threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], rss() - base)
            time.sleep(0.005)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    growth: dict[str, float] = {}
    try:
        yield growth
    finally:
        done.set()
        thread.join()
        growth["mib"] = peak[0] / MiB


@pytest.fixture
def server(fake_server_factory, tmp_path):
    return fake_server_factory(batches=BatchConfig(str(tmp_path / "state"), max_lines=1000))


# -- finding: a batch file takes ~25x its size in RAM, and it is parsed on the event loop ---------------------------

def test_a_batch_file_is_read_a_line_at_a_time_off_the_loop(server):
    """8 MiB of `[{},{},…]` lines: the whole file parsed at once took ~25x its size (200 MiB here) for the batch's
    life, on the event loop. Read a line at a time on a thread, it costs a line."""
    data = b"".join(empties(i, 10_000) for i in range(280))
    assert len(data) > 8 * MiB
    f = upload(server.base_url, data).json()
    with peak_rss_growth() as growth, loop_responsive(server.base_url, bound_s=0.5):
        done = wait_ended(server.base_url, create(server.base_url, f["id"]).json()["id"], timeout=60)
    assert done["status"] == "completed" and done["request_counts"]["failed"] == 280
    assert growth["mib"] < 40, f"the server grew by {growth['mib']:.0f} MiB running an 8 MiB batch"


def test_a_running_batch_holds_only_its_lines_under_way(fake_server_factory, tmp_path):
    srv = fake_server_factory(batches=BatchConfig(str(tmp_path / "s"), max_in_flight=2), step_delay=0.02)
    f = upload(srv.base_url, b"".join(chat(i) for i in range(300))).json()
    batch = create(srv.base_url, f["id"]).json()
    while httpx.get(f"{srv.base_url}/v1/batches/{batch['id']}").json()["request_counts"]["completed"] < 3:
        time.sleep(0.02)
    held = sum(isinstance(o, BatchLine) for o in gc.get_objects())
    httpx.post(f"{srv.base_url}/v1/batches/{batch['id']}/cancel")
    assert held <= 4, f"{held} of the batch's 300 lines are held in memory with 2 under way"
    assert wait_ended(srv.base_url, batch["id"])["status"] == "cancelled"


def test_an_upload_of_too_many_lines_is_refused_without_stalling_the_loop(fake_server_factory, tmp_path):
    """16 MiB of `{}` lines, past --batch-max-lines: it was read whole and split on the event loop (5.6 million
    line objects) before being refused."""
    srv = fake_server_factory(batches=BatchConfig(str(tmp_path / "s"), max_lines=50))
    data = b"{}\n" * (16 * MiB // 3)
    with peak_rss_growth() as growth, loop_responsive(srv.base_url, bound_s=0.5):
        r = upload(srv.base_url, data)
    assert r.status_code == 400 and r.json()["error"]["param"] == "file"
    assert "at most 50" in r.json()["error"]["message"]
    assert growth["mib"] < 48, f"the server grew by {growth['mib']:.0f} MiB refusing a 16 MiB upload"
    assert httpx.get(f"{srv.base_url}/v1/files").json()["data"] == []


def test_slow_downloads_hold_a_chunk_each_not_the_file(server):
    """16 downloads of a 4 MiB file that read nothing: each held the whole file in the server."""
    data = b"".join(line(i, x="y" * (64 << 10)) for i in range(64))
    f = upload(server.base_url, data).json()
    assert f["bytes"] == len(data) > 4 * MiB
    with peak_rss_growth() as growth, ExitStack() as stack, loop_responsive(server.base_url, bound_s=0.5):
        for _ in range(16):
            client = stack.enter_context(httpx.Client(timeout=30))
            r = stack.enter_context(client.stream("GET", f"{server.base_url}/v1/files/{f['id']}/content"))
            assert r.status_code == 200 and r.headers["content-length"] == str(len(data))
        time.sleep(0.5)  # the server writes what it will
    assert growth["mib"] < 24, f"the server grew by {growth['mib']:.0f} MiB for 16 stalled downloads of 4 MiB"
    assert httpx.get(f"{server.base_url}/v1/files/{f['id']}/content", timeout=30).content == data


def test_a_line_longer_than_the_body_bound_fails_its_batch(fake_server_factory, tmp_path):
    srv = fake_server_factory(batches=BatchConfig(str(tmp_path / "s"), max_line_bytes=4096))
    f = upload(srv.base_url, chat(0) + chat(1, user="u" * 8192) + chat(2)).json()
    done = wait_ended(srv.base_url, create(srv.base_url, f["id"]).json()["id"])
    assert done["status"] == "failed"
    assert [(e["code"], e["line"]) for e in done["errors"]["data"]] == [("line_too_long", 2)]


def test_a_malformed_file_s_errors_do_not_repeat_what_the_lines_hold(server):
    """100 lines each naming a 64 KiB url, custom_id or field: the batch's errors quoted each one whole (6 MiB in
    one batch object, read back on every GET)."""
    big = "u" * (64 << 10)
    ok = {"method": "POST", "url": "/v1/chat/completions", "body": {}}
    lines = [{**ok, "custom_id": big}, {**ok, "custom_id": big}, {**ok, "custom_id": "a", "url": big},
             {**ok, "custom_id": "b", big: 1}]
    data = b"".join(json.dumps(x).encode() + b"\n" for x in lines * 30)
    f = upload(server.base_url, data).json()
    done = wait_ended(server.base_url, create(server.base_url, f["id"]).json()["id"])
    assert done["status"] == "failed" and len(done["errors"]["data"]) == 100
    assert {e["code"] for e in done["errors"]["data"]} == {"invalid_url", "duplicate_custom_id", "invalid_request"}
    assert len(json.dumps(done)) < 64 << 10, "a malformed file's errors quote its lines whole"


# -- finding: poison batches never end ---------------------------------------------------------------------------

def test_a_line_nested_too_deeply_fails_its_batch_and_frees_its_file(server):
    deep = b'{"custom_id":"x","method":"POST","url":"/v1/chat/completions","body":' + b"[" * 100_000 + b"]" * 100_000
    f = upload(server.base_url, chat(0) + deep + b"}\n" + chat(2)).json()
    done = wait_ended(server.base_url, create(server.base_url, f["id"]).json()["id"], timeout=15)
    assert done["status"] == "failed" and done["failed_at"]
    assert [(e["code"], e["line"]) for e in done["errors"]["data"]] == [("invalid_json_line", 2)]
    assert httpx.delete(f"{server.base_url}/v1/files/{f['id']}").json()["deleted"] is True


def test_cancel_ends_a_poison_batch_and_frees_its_file(server):
    deep = b"[" * 100_000 + b"]" * 100_000 + b"\n"
    f = upload(server.base_url, deep).json()
    batch = create(server.base_url, f["id"]).json()
    r = httpx.post(f"{server.base_url}/v1/batches/{batch['id']}/cancel")
    assert r.status_code == 200 or r.json()["error"]["code"] == "invalid_state"  # (it may have failed already)
    assert wait_ended(server.base_url, batch["id"], timeout=15)["status"] in ("cancelled", "failed")
    assert httpx.delete(f"{server.base_url}/v1/files/{f['id']}").status_code == 200


@pytest.mark.parametrize("window", ["1" + "0" * 399 + "h", "9" * 5000 + "s", "\u0663s", "24h\n", "0h", "31d", "-1h",
                                    " 24h", "24H", "1.5h", "1e3s", "", "h", "99999999999d"])
def test_a_completion_window_is_ascii_digits_and_a_unit_within_bounds(server, window):
    f = upload(server.base_url, chat(0)).json()
    r = create(server.base_url, f["id"], window)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "completion_window" and len(r.text) < 1000


@pytest.mark.parametrize("window", ["24h", "1s", "30d", "720h"])
def test_a_sound_completion_window_is_taken(server, window):
    f = upload(server.base_url, chat(0)).json()
    r = create(server.base_url, f["id"], window)
    assert r.status_code == 200 and r.json()["completion_window"] == window
    assert wait_ended(server.base_url, r.json()["id"])["status"] == "completed"


def test_a_stored_batch_that_cannot_run_ends_after_a_restart_logging_once(fake_server_factory, tmp_path, caplog):
    """A batch stored before windows were bounded (expires_at of 400 digits): it raised OverflowError once a
    second, for ever, and stayed in_progress."""
    state = tmp_path / "state"
    store = BatchStore(state)
    f = store.add_file("", "in.jsonl", "batch", chat(0) + chat(1))
    batch = new_batch("/v1/chat/completions", f.id, "1" + "0" * 399 + "h", 10 ** 400, None)
    store.add_batch("", batch)
    store.close()
    caplog.set_level(logging.ERROR, logger="servelm.batch")
    srv = fake_server_factory(batches=BatchConfig(str(state)))
    done = wait_ended(srv.base_url, batch.id, timeout=15)
    assert done["status"] == "failed" and done["errors"]["data"][0]["code"] == "server_error"
    time.sleep(2.5)
    stopped = [r for r in caplog.records if r.name == "servelm.batch" and batch.id in r.getMessage()]
    assert len(stopped) == 1, [r.getMessage() for r in stopped]
    assert httpx.delete(f"{srv.base_url}/v1/files/{f.id}").status_code == 200


# -- finding: a truncated stored file is served short ----------------------------------------------------------------

def test_a_truncated_stored_file_is_not_served_short(server, tmp_path, caplog):
    data = b"".join(chat(i) for i in range(20))
    f = upload(server.base_url, data).json()
    path = Path(tmp_path / "state" / "files" / f"{f['id']}.jsonl")
    path.write_bytes(data[: len(data) // 2])
    caplog.set_level(logging.ERROR, logger="servelm.batch")
    r = httpx.get(f"{server.base_url}/v1/files/{f['id']}/content")
    assert r.status_code == 500 and r.json()["error"]["code"] == "file_damaged", r.text
    assert f"{len(data) // 2} of its {len(data)} bytes" in r.json()["error"]["message"]
    assert str(path) not in r.text, "the client is not told the server's paths"
    logged = [r.getMessage() for r in caplog.records if f["id"] in r.getMessage()]
    assert logged and str(path) in logged[0] and f"holds {len(data) // 2} bytes where {len(data)} bytes" in logged[0]
    done = wait_ended(server.base_url, create(server.base_url, f["id"]).json()["id"])
    assert done["status"] == "failed" and done["errors"]["data"][0]["code"] == "file_damaged"
    path.unlink()
    r = httpx.get(f"{server.base_url}/v1/files/{f['id']}/content")
    assert r.status_code == 500 and r.json()["error"]["code"] == "file_damaged"


def test_a_fifo_in_place_of_a_stored_file_is_damaged_not_a_hang(server, tmp_path):
    """A FIFO put where a stored file was: its download never answered, and the reading thread it held kept the
    process from exiting after SIGTERM. Only regular files are opened (non-blocking, checked on the descriptor)."""
    data = b"".join(chat(i) for i in range(3))
    f = upload(server.base_url, data).json()
    path = Path(tmp_path / "state" / "files" / f"{f['id']}.jsonl")
    path.unlink()
    os.mkfifo(path)
    with loop_responsive(server.base_url):
        r = httpx.get(f"{server.base_url}/v1/files/{f['id']}/content", timeout=10)
        assert r.status_code == 500 and r.json()["error"]["code"] == "file_damaged", r.text
        done = wait_ended(server.base_url, create(server.base_url, f["id"]).json()["id"])
    assert done["status"] == "failed" and done["errors"]["data"][0]["code"] == "file_damaged"


def test_cancelling_a_batch_counts_its_lines_under_way_as_499_not_500(fake_server_factory, tmp_path):
    """Cancel stops a batch's lines under way; each was logged and counted as a 500 (CancelledError), so cancelling
    batches fired error alerts though nothing failed. Nobody waits for a cancelled request: 499, as a client that
    went away."""
    srv = fake_server_factory(batches=BatchConfig(str(tmp_path / "state"), max_lines=1000), step_delay=0.05)
    f = upload(srv.base_url, b"".join(line(i, model="fake-model", messages=[{"role": "user", "content": "hi"}],
                                           max_tokens=100, ignore_eos=True) for i in range(6))).json()
    batch = create(srv.base_url, f["id"]).json()
    deadline = time.monotonic() + 20
    while srv.engine.stats().running == 0 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert httpx.post(f"{srv.base_url}/v1/batches/{batch['id']}/cancel").status_code == 200
    assert wait_ended(srv.base_url, batch["id"])["status"] == "cancelled"
    metrics = httpx.get(f"{srv.base_url}/metrics").text
    assert 'status="500"' not in metrics, [m for m in metrics.splitlines() if 'status="500"' in m]
    assert 'route="/v1/chat/completions",status="499"' in metrics
