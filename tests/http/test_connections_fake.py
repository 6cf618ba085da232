"""Connections: usable after a 5xx, headers that must arrive in time, a cap that drops the slowest header-reader,
and 415 for bodies that are not JSON (with CORS only for the origins an operator lists)."""

from __future__ import annotations

import socket
import threading
import time

import httpx
import pytest

from servelm.compose import build_deployment
from servelm.engine import sampling
from servelm.http.app import AppOptions, create_app
from servelm.http.limits import SecurityConfig
from servelm.runners.fake import FakeRunner
from servelm.service.registry.deployments import Deployments
from tests.conftest import serving

CHAT = b'{"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3%s}'


def raw_request(body: bytes, path: bytes = b"/v1/chat/completions", content_type: bytes = b"application/json") -> bytes:
    return (b"POST " + path + b" HTTP/1.1\r\nhost: x\r\ncontent-type: " + content_type +
            b"\r\ncontent-length: %d\r\n\r\n" % len(body) + body)


def read_response(sock: socket.socket) -> tuple[int, bytes]:
    """One HTTP/1.1 response with a content-length body; (status, body), or (0, b"") if the server closed."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            return 0, b""
        data += chunk
    head, body = data.split(b"\r\n\r\n", 1)
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length"))
    while len(body) < length:
        body += sock.recv(65536)
    return int(head.split(b" ")[1]), body


@pytest.fixture
def guarded():
    """A fake server with short connection bounds: headers in 1 s, at most 8 connections."""
    runner = FakeRunner()
    deployment, engine = build_deployment("fake-model", runner)
    app = create_app(Deployments([deployment]), AppOptions(SecurityConfig(cors_allow_origins=("https://app.example",))),
                     on_start=engine.start, on_stop=engine.stop)
    with serving(app, header_timeout=1.0, max_connections=8) as url:
        yield url


def test_a_connection_stays_usable_after_a_server_error(guarded, monkeypatch):
    """A request that fails inside the engine is a 500 in the envelope, and the client's next request on the same
    connection is answered (uvicorn used to close it, and clients that reuse connections saw resets)."""
    original = sampling.SamplerState.apply_penalties

    def broken(self, row):
        if self.params.frequency_penalty == 1.5:
            raise RuntimeError("injected")
        return original(self, row)

    monkeypatch.setattr(sampling.SamplerState, "apply_penalties", broken)
    port = int(guarded.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(raw_request(CHAT % b', "frequency_penalty": 1.5'))
        status, body = read_response(sock)
        assert status == 500 and b'"error"' in body and b'"server_error"' in body
        sock.sendall(raw_request(CHAT % b""))
        status, body = read_response(sock)
        assert status == 200 and b'"chat.completion"' in body


def test_headers_sent_a_byte_at_a_time_are_cut_off(guarded):
    port = int(guarded.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        start = time.monotonic()
        request = raw_request(CHAT % b"")
        closed = False
        for byte in request[:60]:
            try:
                sock.sendall(bytes([byte]))
            except OSError:
                closed = True
                break
            time.sleep(0.05)
        if not closed:
            sock.settimeout(5)
            closed = sock.recv(100) == b""
        assert closed and time.monotonic() - start < 4, "the connection is closed about a second after it opened"


def test_past_the_cap_the_slowest_header_reader_makes_room(guarded):
    port = int(guarded.rsplit(":", 1)[1])
    slow = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(8)]
    try:
        for s in slow:
            s.sendall(b"POST /v1/chat/comp")  # headers begun, never finished
        time.sleep(0.2)
        r = httpx.post(guarded + "/v1/chat/completions", json={"model": "fake-model", "max_tokens": 2,
                                                               "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 200, "a new client got in: the oldest header-reader was dropped for it"
        dropped = 0
        for s in slow:
            s.settimeout(3)
            try:
                dropped += s.recv(10) == b""
            except OSError:
                dropped += 1
        assert dropped == 8, "all were dropped in the end (one to make room, the rest at the header deadline)"
    finally:
        for s in slow:
            s.close()


def test_when_every_connection_is_busy_a_new_one_gets_503(fake_server_factory):
    runner = FakeRunner(step_delay=0.05, num_slots=2)
    deployment, engine = build_deployment("fake-model", runner)
    app = create_app(Deployments([deployment]), on_start=engine.start, on_stop=engine.stop)
    body = {"model": "fake-model", "max_tokens": 40, "ignore_eos": True, "messages": [{"role": "user", "content": "x"}]}
    with serving(app, max_connections=2) as url:
        results: list[int] = []
        threads = [threading.Thread(target=lambda: results.append(httpx.post(url + "/v1/chat/completions", json=body,
                                                                               timeout=30).status_code)) for _ in range(2)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 10
        while engine.stats().running < 2 and time.monotonic() < deadline:  # both connections are inside a request
            time.sleep(0.01)
        r = httpx.post(url + "/v1/chat/completions", json=body, timeout=30)
        assert r.status_code == 503 and r.json()["error"]["code"] == "too_many_connections"
        for t in threads:
            t.join(30)
        assert results == [200, 200]


@pytest.mark.parametrize("content_type", [None, "text/plain", "application/x-www-form-urlencoded", "multipart/form-data"])
def test_a_body_that_is_not_json_is_415(guarded, content_type):
    headers = {"content-type": content_type} if content_type else {}
    r = httpx.post(guarded + "/v1/chat/completions", content=CHAT % b"", headers=headers)
    err = r.json()["error"]
    assert r.status_code == 415 and err["code"] == "unsupported_media_type" and err["type"] == "invalid_request_error"
    assert httpx.post(guarded + "/v1/chat/completions", content=CHAT % b"",
                      headers={"content-type": "application/json; charset=utf-8"}).status_code == 200


def test_415_on_azures_path_has_azures_shape(guarded):
    r = httpx.post(guarded + "/chat/completions?api-version=2024-05-01-preview", content=CHAT % b"",
                   headers={"content-type": "text/plain"})
    assert r.status_code == 415 and r.json()["status"] == 415 and r.headers["x-ms-error-code"]


def test_cors_only_for_listed_origins(guarded):
    pre = {"access-control-request-method": "POST", "access-control-request-headers": "content-type,authorization"}
    ok = httpx.options(guarded + "/v1/chat/completions", headers={"origin": "https://app.example", **pre})
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == "https://app.example"
    bad = httpx.options(guarded + "/v1/chat/completions", headers={"origin": "https://evil.example", **pre})
    assert "access-control-allow-origin" not in bad.headers
    r = httpx.post(guarded + "/v1/chat/completions", content=CHAT % b"",
                   headers={"origin": "https://evil.example", "content-type": "application/json"})
    assert "access-control-allow-origin" not in r.headers


def test_no_cors_headers_without_an_allow_list(fake_server):
    r = httpx.post(fake_server.base_url + "/v1/chat/completions", content=CHAT % b"",
                   headers={"origin": "https://app.example", "content-type": "application/json"})
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


def test_a_client_that_leaves_while_sending_its_body_is_no_server_error(guarded, caplog):
    """Issue 31: a disconnect mid-upload was logged as an ERROR traceback with a 500 (starlette's ClientDisconnect
    raised from reading the body). It ends the request quietly: INFO, status 499, no traceback."""
    host, port = guarded.removeprefix("http://").split(":")
    caplog.set_level("INFO")
    for _ in range(3):
        with socket.create_connection((host, int(port))) as sock:
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                         b"content-length: 100000\r\n\r\n" + CHAT % b"")
            time.sleep(0.2)  # the route is reading the body when the client goes
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and sum(" 499 " in r.getMessage() for r in caplog.records) < 3:
        time.sleep(0.05)
    messages = [r.getMessage() for r in caplog.records]
    assert sum(" 499 " in m for m in messages) == 3, messages
    assert not [r for r in caplog.records if r.levelno >= 40 or r.exc_info], messages
    assert not any(" 500 " in m for m in messages)
    assert httpx.post(guarded + "/v1/chat/completions", content=CHAT % b"",
                      headers={"content-type": "application/json"}).status_code == 200


@pytest.fixture
def body_guarded():
    """A fake server whose request bodies must arrive within 1 s of their headers (plus 1 s per 16 KiB)."""
    runner = FakeRunner()
    deployment, engine = build_deployment("fake-model", runner)
    app = create_app(Deployments([deployment]), AppOptions(SecurityConfig()), on_start=engine.start, on_stop=engine.stop)
    with serving(app, header_timeout=1.0, body_timeout=1.0, max_connections=4) as url:
        yield url


def test_a_body_trickled_a_byte_at_a_time_is_answered_408_and_cut_off(body_guarded):
    """Whole headers with `content-length: 5000000`, then a byte of body every few seconds, on every connection the
    cap allows: nothing cut them off (the header deadline ends with the headers), and every other caller, /health
    too, got 503 too_many_connections for as long as they went on."""
    port = int(body_guarded.rsplit(":", 1)[1])
    head = (b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"content-length: 5000000\r\n\r\n{")
    socks = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(4)]
    try:
        for s in socks:
            s.sendall(head)
        start = time.monotonic()
        for s in socks:
            s.sendall(b" ")
        for s in socks:
            status, body = read_response(s)
            assert status == 408 and b"request_timeout" in body, (status, body)
        assert time.monotonic() - start < 5
        assert httpx.get(f"{body_guarded}/health", timeout=5).status_code == 200
    finally:
        for s in socks:
            s.close()


def test_a_body_that_keeps_coming_is_not_cut_off(body_guarded):
    """Past the first second, each 16 KiB received buys another: a large body sent steadily is read whole."""
    port = int(body_guarded.rsplit(":", 1)[1])
    body = CHAT % (b', "metadata": {"note": "' + b"x" * 500 + b'"}, "stop": ["' + b"y" * 10 + b'"], "seed": 1' +
                   b" " * (96 << 10))
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        request = raw_request(body)
        head, rest = request[: len(request) - len(body)], body
        sock.sendall(head)
        for i in range(0, len(rest), 16 << 10):  # 16 KiB every 0.4 s: 2.4 s in all, past the first second
            sock.sendall(rest[i : i + (16 << 10)])
            time.sleep(0.4)
        status, answer = read_response(sock)
        assert status != 408 and b"request_timeout" not in answer, answer[:500]
