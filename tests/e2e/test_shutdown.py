"""Graceful shutdown: a SIGTERM lets a stream in flight finish (or ends it at the deadline), refuses new
connections, and the process exits 0. Each test starts its own server; the session's shared one is not used."""

from __future__ import annotations

import json
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import pytest

from .conftest import own_server
from .helpers import MODEL, NO_EOS, STORY
from .ray_mode import through_ray_skip

pytestmark = [pytest.mark.e2e, through_ray_skip(
    "shutdown there is Ray Serve's, not uvicorn's: its proxy keeps accepting connections while the application "
    "drains (404 once it is deleted), a stream cut at the deadline ends with a replica_unavailable error event "
    "and [DONE], and the log lines read here (uvicorn's, the access log) are written by the ingress to Ray's log "
    "files; the exit status 0 and a stream that finishes within the timeout do hold")]
FLAGS = ("--no-embedding-model", "--chat-embedding-window", "0", "--max-num-seqs", "2")


@pytest.fixture(autouse=True)
def _server_alive_and_idle() -> Iterator[None]:
    """Overrides the e2e conftest's fixture of the same name, which would start the shared server."""
    yield


@contextmanager
def _stream(base_url: str, max_tokens: int) -> Iterator[httpx.Response]:
    """A streamed chat answer, read as it comes; its client is closed with it at the end of the block (a client left
    open kept its connection's socket until the collector found it inside some later test: a ResourceWarning)."""
    body = {"model": MODEL, "messages": STORY, "max_tokens": max_tokens, "temperature": 0, "logit_bias": NO_EOS,
            "stream": True}
    with httpx.Client(timeout=60) as client, client.stream(
            "POST", f"{base_url}/v1/chat/completions", json=body, headers={"x-request-id": "shutdown-test-1"}) as response:
        yield response


def _first_content(lines: Iterator[str]) -> None:
    for line in lines:
        if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["delta"].get("content"):
            return
    pytest.fail("the stream ended before its first content")


def test_sigterm_lets_a_stream_finish_then_exits_0(tmp_path_factory):
    with own_server(tmp_path_factory, "--shutdown-timeout", "30", *FLAGS) as srv:  # stopped even if the test fails
        with _stream(srv.base_url, max_tokens=200) as response:
            assert response.status_code == 200 and response.headers["x-request-id"] == "shutdown-test-1"
            lines = response.iter_lines()
            _first_content(lines)
            srv.process.send_signal(signal.SIGTERM)
            time.sleep(0.5)
            with pytest.raises(httpx.TransportError):  # no new connections while draining
                httpx.get(f"{srv.base_url}/health", timeout=2)
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]"
        finals = [json.loads(line[6:]) for line in rest[:-1]]
        assert all("choices" in c for c in finals), rest[-3:]  # an error event: the stream did not end within the timeout
        assert [c["choices"][0]["finish_reason"] for c in finals if c["choices"][0]["finish_reason"]] == ["length"]
        assert srv.process.wait(timeout=30) == 0
        log = srv.log_tail(20000)
        assert "loading model SmolLM2-135M-Instruct.Q4_1.gguf: 100%" in log
        assert "POST /v1/chat/completions 200" in log and "request_id=shutdown-test-1" in log


def test_sigterm_ends_a_stream_at_the_deadline_with_an_error_event_and_exits_0(tmp_path_factory):
    """A stream still running when --shutdown-timeout is nearly up ends with a server_shutting_down error event and
    [DONE] (it used to be cut mid-body, with neither); a whole answer still being made is answered 503."""
    deadline = 2.0
    with own_server(tmp_path_factory, "--shutdown-timeout", str(deadline), *FLAGS) as srv:  # stopped even if the test fails
        whole: list[httpx.Response] = []
        body = {"model": MODEL, "messages": STORY, "max_tokens": 1900, "temperature": 0, "logit_bias": NO_EOS}
        waiter = threading.Thread(target=lambda: whole.append(httpx.post(f"{srv.base_url}/v1/chat/completions", json=body,
                                                                         timeout=60)))
        with _stream(srv.base_url, max_tokens=1900) as response:  # far longer than the deadline
            lines = response.iter_lines()
            _first_content(lines)
            waiter.start()
            time.sleep(0.5)
            signalled = time.monotonic()
            srv.process.send_signal(signal.SIGTERM)
            rest = [line for line in lines if line]
        waiter.join(30)
        assert srv.process.wait(timeout=30) == 0
        assert time.monotonic() - signalled < deadline + 15
        assert rest[-1] == "data: [DONE]"
        error = json.loads(rest[-2][6:])["error"]
        assert error["code"] == "server_shutting_down" and error["type"] == "server_error"
        assert whole and whole[0].status_code == 503 and whole[0].json()["error"]["code"] == "server_shutting_down"
        log = srv.log_tail(20000)
        assert "POST /v1/chat/completions 200" in log and "request_id=shutdown-test-1" in log
        assert "CancelledError" not in log, "nothing was left for uvicorn to cancel"
