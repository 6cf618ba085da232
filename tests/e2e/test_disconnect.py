"""A client that goes away stops its generation: the sequence leaves the batch and its KV cells are freed."""

from __future__ import annotations

import time

import httpx
import openai
import pytest

from .helpers import HELLO, MODEL, NO_EOS, chat, health, wait_idle

pytestmark = pytest.mark.e2e

# long enough that no machine finishes it during the test: a stopped generation is the only way to idle
LONG = 1900  # under the default context window (2048)


def _body(stream: bool) -> dict:
    return {"model": MODEL, "messages": HELLO, "max_tokens": LONG, "temperature": 1.0, "logit_bias": NO_EOS,
            "stream": stream}


def test_stream_disconnect_frees_the_sequence(base_url: str, client: openai.OpenAI) -> None:
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", f"{base_url}/v1/chat/completions", json=_body(True)) as r:
            assert r.status_code == 200
            # read a few frames, keeping the iterator open (leaving a for loop early would close the stream)
            lines = r.iter_lines()
            frames = 0
            while frames < 5:
                if next(lines).startswith("data: "):
                    frames += 1
            busy = health(base_url)
            assert busy["running"] == 1 and busy["kv_cells_used"] > 0, busy
        # leaving the block closes the connection mid-stream
    closed_at = time.monotonic()
    idle, stats = wait_idle(base_url, timeout=10)
    assert idle, f"the generation kept running after the client left: {stats}"
    assert stats["running"] == 0 and stats["kv_cells_used"] == 0
    assert time.monotonic() - closed_at < 10
    assert chat(client, stream=False, messages=HELLO, max_tokens=8, temperature=0).text


def test_plain_request_timeout_stops_the_generation(base_url: str, client: openai.OpenAI) -> None:
    with httpx.Client(timeout=httpx.Timeout(1.0)) as http:
        with pytest.raises(httpx.ReadTimeout):
            http.post(f"{base_url}/v1/chat/completions", json=_body(False))
    idle, stats = wait_idle(base_url, timeout=10)
    assert idle, f"the generation kept running after the client timed out: {stats}"
    assert chat(client, stream=True, messages=HELLO, max_tokens=8, temperature=0).text


def test_many_disconnects_leave_nothing_behind(base_url: str) -> None:
    for _ in range(4):
        with httpx.Client(timeout=60) as http:
            with http.stream("POST", f"{base_url}/v1/chat/completions", json=_body(True)) as r:
                assert r.status_code == 200
                lines = r.iter_lines()
                assert next(lines).startswith("data: ")
    idle, stats = wait_idle(base_url, timeout=10)
    assert idle, stats
