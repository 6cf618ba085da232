"""Attacks on --models-dir, from a careless operator's directory and a hostile client's model names.

A request naming a projector (mmproj-X), a second shard or a folder without one model rescanned the whole
directory on the event loop (about 10 s a request, /health stalled meanwhile). A 113-byte GGUF whose header claims
an array of 2^61 elements took 24 GB at start-up; a FIFO named x.gguf hung start-up and /models/refresh for ever;
a 300-character `model` was a 500, once as plain text. Now a name that cannot be a model's is answered without a
look at the disk, one found not to be a model is remembered with what was on disk under it, looks and scans run
off the loop one at a time (waiters share them), and GGUF metadata is read with every count checked against the
file's size, from regular files only.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import resource
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

import servelm.fleet
from servelm.config import EngineSettings
from servelm.fleet import MAX_NAME_BYTES, Fleet, scan_models_dir
from servelm.gguf_header import NotGGUF, read_metadata
from tests.adversarial.loop import loop_responsive
from tests.http.test_models_fake import FakeBuilder

REPO_ROOT = Path(__file__).resolve().parents[2]
STRING, ARRAY, U8, U32 = 8, 9, 0, 4
HUGE = 1 << 61


def _s(raw: bytes) -> bytes:
    return struct.pack("<Q", len(raw)) + raw


def gguf(*kvs: bytes, count: int | None = None) -> bytes:
    """A GGUF file's bytes: the header (version 3, no tensors) and these key-values."""
    return b"GGUF" + struct.pack("<IQQ", 3, 0, len(kvs) if count is None else count) + b"".join(kvs)


def kv_str(key: str, value: str) -> bytes:
    return _s(key.encode()) + struct.pack("<I", STRING) + _s(value.encode())


def kv_u32(key: str, value: int) -> bytes:
    return _s(key.encode()) + struct.pack("<II", U32, value)


def kv_array(key: str, kind: int, count: int, payload: bytes = b"") -> bytes:
    return _s(key.encode()) + struct.pack("<IIQ", ARRAY, kind, count) + payload


ARCH = kv_str("general.architecture", "llama")
HOSTILE = {  # each header lies about a count or a length
    "huge-strings": gguf(ARCH, kv_array("tokenizer.ggml.tokens", STRING, HUGE, _s(b"a") * 3)),
    "huge-bytes": gguf(ARCH, kv_array("tokenizer.ggml.token_type", U8, HUGE, b"\1" * 16)),
    "long-string": gguf(_s(b"general.architecture") + struct.pack("<IQ", STRING, 1 << 40) + b"llama"),
    "long-key": gguf(struct.pack("<Q", 1 << 62) + b"general.architecture"),
    "many-keys": gguf(ARCH, count=1 << 60),
    "nested": gguf(ARCH, kv_array("x", ARRAY, HUGE, struct.pack("<IQ", U8, HUGE))),
    "bad-type": gguf(ARCH, _s(b"x") + struct.pack("<I", 99) + b"\0" * 8),
    "old-version": b"GGUF" + struct.pack("<IQQ", 1, 0, 1) + ARCH,
    "truncated": b"GGU",
}


def vocabulary(n: int) -> bytes:
    """A plausible model file's metadata: an architecture, a vocabulary of n tokens and a pooling type last."""
    tokens = b"".join(_s(b"tok%06d" % i) for i in range(n))
    return gguf(ARCH, kv_array("tokenizer.ggml.tokens", STRING, n, tokens),
                kv_array("tokenizer.ggml.scores", 6, n, b"\0\0\0\0" * n), kv_u32("llama.pooling_type", 4))


def hostile_dir(directory: Path) -> Path:
    """The hostile files, beside what every vision model's folder holds (a projector, shards, folders)."""
    directory.mkdir(exist_ok=True)
    for name, raw in HOSTILE.items():
        (directory / f"{name}.gguf").write_bytes(raw)
    os.mkfifo(directory / "x.gguf")
    os.mkfifo(directory / "fifo.toml")
    (directory / "fifo.gguf").write_bytes(HOSTILE["truncated"])  # its settings file is the FIFO
    for name in ("vision.gguf", "mmproj-vision.gguf", "split-00001-of-00002.gguf", "split-00002-of-00002.gguf"):
        (directory / name).write_bytes(vocabulary(10))
    (directory / "empty").mkdir()
    (directory / "two").mkdir()
    for name in ("a.gguf", "b.gguf"):
        (directory / "two" / name).write_bytes(vocabulary(10))
    (directory / "piped").mkdir()
    os.mkfifo(directory / "piped" / "model.gguf")
    return directory


def test_hostile_headers_are_refused_before_anything_is_allocated(tmp_path):
    """Each lie is caught where it is read: quickly, and without memory to speak of."""
    for name, raw in HOSTILE.items():
        path = tmp_path / f"{name}.gguf"
        path.write_bytes(raw)
        started = time.monotonic()
        with pytest.raises(NotGGUF):
            read_metadata(path, lambda key: True)
        assert time.monotonic() - started < 0.5, name
    os.mkfifo(tmp_path / "x.gguf")
    with pytest.raises(OSError, match="not a regular file"):
        read_metadata(tmp_path / "x.gguf", lambda key: True)  # returns at once: no writer to wait for
    (tmp_path / "real.gguf").write_bytes(vocabulary(20_000))
    assert read_metadata(tmp_path / "real.gguf", lambda key: not key.startswith("tokenizer")) == {
        "general.architecture": "llama", "llama.pooling_type": 4}
    started = time.monotonic()
    specs, failed = scan_models_dir(tmp_path, EngineSettings())
    assert time.monotonic() - started < 5 and not failed
    assert {s.name: s.kind for s in specs} == {"real": "rerank", **{name: "chat" for name in HOSTILE}}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rss_mib(pid: int, field: str = "VmRSS") -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise AssertionError(field)


def _cap_memory() -> None:  # the server's heap capped, so that a regression fails the test, not the machine
    resource.setrlimit(resource.RLIMIT_DATA, (3 << 30, 3 << 30))


def test_a_hostile_models_dir_neither_hangs_nor_bloats_the_server(tmp_path):
    """A real server over the hostile directory: it starts, /models/refresh ends, and a hostile file dropped in at
    runtime and named is a 400 in the envelope, with the server's memory flat throughout."""
    directory = hostile_dir(tmp_path / "models")
    port, log = _free_port(), tmp_path / "server.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("SERVELM_")}
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "servelm", "serve", "--host", "127.0.0.1", "--port", str(port),
                                 "--models-dir", str(directory)], stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, cwd=REPO_ROOT, env=env, preexec_fn=_cap_memory)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90  # mostly Python's imports on a busy machine; the scan is a fraction
        while True:
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, "no /health after 90 s:\n" + log.read_text()[-3000:]
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        started = _rss_mib(proc.pid, "VmHWM")
        assert started < 1024, f"{started:.0f} MiB at start-up"
        with loop_responsive(base, bound_s=0.5):
            started_at = time.monotonic()
            r = httpx.post(f"{base}/models/refresh", timeout=30)
            assert r.status_code == 200 and time.monotonic() - started_at < 10
            assert {"vision", "huge-strings", "split-00001-of-00002"} <= set(r.json()["models"])
            assert not {"x", "mmproj-vision", "split-00002-of-00002", "empty", "two", "piped"} & set(r.json()["models"])
            (directory / "late.gguf").write_bytes(HOSTILE["huge-strings"])
            for _ in range(3):
                r = httpx.post(f"{base}/v1/chat/completions", timeout=60,
                               json={"model": "late", "messages": [{"role": "user", "content": "hi"}]})
                assert r.status_code == 400 and r.json()["error"]["code"] == "model_load_failed", r.text
        grown = _rss_mib(proc.pid, "VmHWM") - started
        assert grown < 64, f"the server grew by {grown:.0f} MiB"
        assert httpx.get(f"{base}/health", timeout=5).status_code == 200
    finally:
        _stop(proc)


@pytest.fixture
def crowded(tmp_path):
    directory = tmp_path / "models"
    directory.mkdir()
    return crowd(directory)


def crowd(directory: Path) -> Path:
    """Twelve plausible models (30,000-token vocabularies) and a vision model's folder added to `directory`, with a
    projector beside them and a folder without a model (harness/abuse.py's models-dir run uses it too)."""
    raw = vocabulary(30_000)
    for i in range(12):
        (directory / f"model-{i}.gguf").write_bytes(raw)
    (directory / "vision").mkdir()
    for name in ("model-00001-of-00002.gguf", "model-00002-of-00002.gguf", "mmproj-model.gguf"):
        (directory / "vision" / name).write_bytes(raw)
    (directory / "mmproj-model-0.gguf").write_bytes(raw)
    (directory / "not-one").mkdir()
    return directory


NON_MODELS = ["mmproj-model-0", "model-0-00002-of-00002", "not-one", "x" * 300, "../models", "a\0b",
              "model-0.gguf", "nothing-here"]


def _chat(base: str, model: str, timeout: float = 30) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    return httpx.post(f"{base}/v1/chat/completions", timeout=timeout, content=json.dumps(body),  # lone surrogates too
                      headers={"content-type": "application/json"})


def test_names_that_are_not_models_are_answered_without_rescans_or_stalls(fake_server_factory, crowded, monkeypatch):
    fleet = Fleet([], models_dir=crowded, engine=EngineSettings(kv_budget_mib=1), builder=FakeBuilder())
    looks: list[str] = []  # the entries read (a name's file and folder), once the first scan is done
    found_at = servelm.fleet._found_at
    monkeypatch.setattr(servelm.fleet, "_found_at", lambda d, path: looks.append(path.name) or found_at(d, path))
    server = fake_server_factory(catalog=fleet)
    assert {"model-0", "vision"} <= set(fleet.statuses()) and "not-one" not in fleet.statuses()
    with loop_responsive(server.base_url, bound_s=0.5):  # the rescans stalled it ~10 s; clients share its process
        started = time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(lambda name: _chat(server.base_url, name), NON_MODELS * 6))
        elapsed = time.monotonic() - started
    for r in answers:
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found", r.text
    assert elapsed < 10, f"{len(answers)} requests took {elapsed:.1f} s"
    # a folder without a model and a file not under its own name read once each, never the whole directory; the
    # other names not at all (nothing on disk under them, or not a model's name)
    assert sorted(looks) == ["model-0.gguf", "model-0.gguf.gguf", "not-one", "not-one.gguf"]
    (crowded / "not-one" / "it.gguf").write_bytes(vocabulary(10))  # the folder changed: looked at again
    assert _chat(server.base_url, "not-one").status_code == 200
    assert fleet.statuses()["not-one"].value == "loaded"


def test_a_long_or_impossible_model_name_is_a_404_in_the_envelope_everywhere(fake_server_factory, crowded):
    fleet = Fleet([], models_dir=crowded, builder=FakeBuilder())
    server = fake_server_factory(catalog=fleet)
    long = "m" * 300
    for r in (_chat(server.base_url, long),
              httpx.post(f"{server.base_url}/v1/embeddings", json={"model": long, "input": "x"}),
              httpx.post(f"{server.base_url}/models/load", json={"model": long}),
              httpx.post(f"{server.base_url}/models/unload", json={"model": "mmproj-model-0"}),
              httpx.post(f"{server.base_url}/openai/deployments/{long}/chat/completions?api-version=2024-10-21",
                         json={"messages": [{"role": "user", "content": "hi"}]})):
        assert r.status_code == 404 and r.headers["content-type"].startswith("application/json"), r.text
        assert r.json()["error"]["code"] in ("model_not_found", "not_found"), r.text
    name = "n" * MAX_NAME_BYTES  # the bound itself: a file this long is a model
    (crowded / f"{name}.gguf").write_bytes(vocabulary(10))
    assert _chat(server.base_url, name).status_code == 200


async def test_concurrent_refreshes_share_scans(crowded, monkeypatch):
    fleet = Fleet([], models_dir=crowded, builder=FakeBuilder())
    scans: list[float] = []
    scan = servelm.fleet.scan_models_dir

    def counted(*args):
        scans.append(time.monotonic())
        time.sleep(0.2)
        return scan(*args)

    monkeypatch.setattr(servelm.fleet, "scan_models_dir", counted)
    await asyncio.gather(*(fleet.refresh() for _ in range(20)))
    assert len(scans) <= 2  # the one under way, and one for all who asked meanwhile
    (crowded / "later.gguf").write_bytes(b"GGUF")
    await fleet.refresh()
    assert "later" in fleet.statuses()


async def test_a_model_whose_file_is_gone_is_no_longer_listed_after_a_refresh(crowded):
    """Found by the black-box attack: a model file deleted from the directory stayed listed (and in /v1/models) after
    /models/refresh, its requests a 400 `model_load_failed`. A full scan forgets the directory's models it no longer
    finds, unless loaded or in use; a config's on-demand deployment is never forgotten."""
    (crowded / "later.gguf").write_bytes(b"GGUF")
    fleet = Fleet([], models_dir=crowded, builder=FakeBuilder())
    assert "later" in fleet.statuses()
    (crowded / "later.gguf").unlink()
    await fleet.refresh()
    assert "later" not in fleet.statuses()
    assert await fleet.resolve("later") is None


def _stop(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _serve(directory: Path, log: Path, *flags: str) -> tuple[subprocess.Popen[bytes], str]:
    """A real server over `directory`, ready (its /health answered)."""
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("SERVELM_")}
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "servelm", "serve", "--host", "127.0.0.1", "--port", str(port),
                                 "--models-dir", str(directory), *flags], stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, cwd=REPO_ROOT, env=env)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 90
    while True:
        assert proc.poll() is None, log.read_text()[-3000:]
        assert time.monotonic() < deadline, "no /health after 90 s:\n" + log.read_text()[-3000:]
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                return proc, base
        except httpx.TransportError:
            pass
        time.sleep(0.2)


@pytest.mark.e2e
def test_unloading_and_loading_a_real_model_leaves_the_event_loop_free(tmp_path):
    """A real model of the directory (SmolLM2 in a folder of its own) unloaded and loaded again, by route and by a
    request naming it, with the event loop never held 0.25 s. Everything of a load and an unload ran on worker
    threads already, but two native calls there hold the GIL, and so the loop, for as long as they run: llguidance
    building the vocabulary's tokenizer (0.15 s on an idle core, 0.93 s with three busy processes beside it; the
    attack measured 1.24 s on a busy machine) and the unload's full collection of the whole heap (0.12 s). Now a
    reloaded model takes its vocabulary's Grammars from compose.GRAMMARS, and the heap the server started with is
    frozen out of collections (fleet.Fleet.start). The tokenizer's build took 0.9 s of the loop on a busy machine,
    0.15-0.21 s on an idle one: 0.25 s catches the first and leaves room for the scheduler on 2 busy cores."""
    from servelm.config import embedded_model_path

    directory = tmp_path / "models"
    (directory / "sub").mkdir(parents=True)
    (directory / "sub" / "model.gguf").symlink_to(embedded_model_path())
    proc, base = _serve(directory, tmp_path / "server.log", "--max-num-seqs", "2", "--context-window", "512",
                        "--idle-unload-s", "-1", "--prefix-cache-dir", str(tmp_path / "cache"))
    try:
        assert _chat(base, "sub", 300).status_code == 200  # loaded once before the measure: imports are not the point
        with loop_responsive(base, bound_s=0.25):
            for route in ("/models/unload", "/models/load", "/models/unload"):
                r = httpx.post(f"{base}{route}", json={"model": "sub"}, timeout=180)
                assert r.status_code == 200, r.text
            r = _chat(base, "sub", 300)  # loaded on demand
            assert r.status_code == 200, r.text
        assert httpx.get(f"{base}/v1/models", timeout=10).json()["data"][0]["status"] == {"value": "loaded"}
    finally:
        _stop(proc)
