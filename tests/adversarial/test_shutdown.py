"""Shutdown against an OTLP endpoint that never answers: the server exits within --shutdown-timeout.

An endpoint that accepts connections and then says nothing (a black-holed collector) held the exit for about 30 s,
past --shutdown-timeout (10 s) and past a typical orchestrator's grace period: the exporter's flush, and the
OpenTelemetry SDK's own exit hook flushing again, each waited on it. Then the flush was given what was left of the
timeout, and the models' freeing and the exit came on top (6.8 s with --shutdown-timeout 5): now the flush ends 2 s
before the timeout does.
"""

from __future__ import annotations

import signal
import socket
import time

import httpx
import pytest

from tests.e2e.conftest import start_server
from tests.e2e.helpers import MODEL

pytestmark = pytest.mark.e2e
TIMEOUT = 4.0


@pytest.mark.slow
def test_a_silent_otlp_endpoint_never_holds_the_exit_past_the_shutdown_timeout(tmp_path_factory):
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(64)  # the kernel completes every handshake; nothing ever reads or answers
    try:
        srv = start_server(tmp_path_factory, "--otlp-traces-endpoint", f"http://127.0.0.1:{silent.getsockname()[1]}",
                           "--shutdown-timeout", str(TIMEOUT), "--no-embedding-model", "--max-num-seqs", "2")
        for _ in range(3):  # spans waiting in the exporter's batch
            r = httpx.post(f"{srv.base_url}/v1/chat/completions", timeout=60, json={
                "model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4})
            assert r.status_code == 200
        time.sleep(6)  # the batch processor's scheduled export is now stuck on the endpoint too
        began = time.monotonic()
        srv.process.send_signal(signal.SIGTERM)
        code = srv.process.wait(timeout=60)
        took = time.monotonic() - began
    finally:
        silent.close()
    assert code == 0
    assert took < TIMEOUT + 0.5, f"exit took {took:.1f} s with --shutdown-timeout {TIMEOUT}"
    assert "did not take the last spans" in srv.log_tail(20000)
