"""Operations over the fake runner: GET /metrics, x-request-id, and the access log."""

from __future__ import annotations

import logging
import re
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from servelm.http.middleware import MAX_REQUEST_ID, request_id_from

MSG = [{"role": "user", "content": "hi"}]
PROMPT_TOKENS = len("<user>hi<assistant>")  # the fake runner reads one token per character


def scrape(base_url: str) -> dict[str, list]:
    r = httpx.get(base_url + "/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain; version=0.0.4")
    return {f.name: f.samples for f in text_string_to_metric_families(r.text)}


def value(families: dict, sample_name: str, **labels: str) -> float:
    name = re.sub(r"_(total|count|sum|bucket)$", "", sample_name)
    found = [s.value for s in families.get(name, []) if s.name == sample_name and all(s.labels.get(k) == v for k, v in labels.items())]
    assert len(found) <= 1, found
    return found[0] if found else 0.0


def chat(base_url: str, **body) -> httpx.Response:
    return httpx.post(base_url + "/v1/chat/completions", json={"model": "fake-model", "messages": MSG, **body}, timeout=30)


def test_requests_tokens_and_latencies_are_counted(fake_server):
    url = fake_server.base_url
    assert chat(url, max_tokens=5).status_code == 200
    with httpx.stream("POST", url + "/v1/chat/completions",
                      json={"model": "fake-model", "messages": MSG, "max_tokens": 4, "stream": True}) as r:
        assert [line for line in r.iter_lines() if line][-1] == "data: [DONE]"
    assert chat(url, max_tokens=3, n=2).status_code == 200
    assert chat(url, temperature=7).status_code == 400
    assert httpx.get(url + "/v1/models/fake-model").status_code == 200
    assert httpx.get(url + "/v1/models/nope").status_code == 404
    assert httpx.get(url + "/no/such/path/12345").status_code == 404
    time.sleep(0.2)  # a stream's last body message is recorded just after the client has read it
    m = scrape(url)

    route = "/v1/chat/completions"
    assert value(m, "servelm_http_requests_total", route=route, method="POST", status="200") == 3
    assert value(m, "servelm_http_requests_total", route=route, method="POST", status="400") == 1
    assert value(m, "servelm_http_requests_total", route="/v1/models/{model_id:path}", method="GET", status="200") == 1
    assert value(m, "servelm_http_requests_total", route="/v1/models/{model_id:path}", method="GET", status="404") == 1
    assert value(m, "servelm_http_requests_total", route="other", method="GET", status="404") == 1
    assert not [s for s in m["servelm_http_requests"] if "12345" in s.labels.get("route", "")]  # no raw paths
    assert value(m, "servelm_http_request_duration_seconds_count", route=route, method="POST") == 4

    assert value(m, "servelm_prompt_tokens_total", model="fake-model") == 3 * PROMPT_TOKENS
    assert value(m, "servelm_generation_tokens_total", model="fake-model") == 5 + 4 + 2 * 3
    assert value(m, "servelm_generation_requests_total", model="fake-model", outcome="completed") == 3
    assert value(m, "servelm_time_to_first_token_seconds_count", model="fake-model") == 3
    assert value(m, "servelm_e2e_request_latency_seconds_count", model="fake-model") == 3
    assert value(m, "servelm_time_to_first_token_seconds_bucket", model="fake-model", le="+Inf") == 3
    # every output after a choice's first: 4 + 3 + 2 * 2 (the fake runner sends one token per output)
    assert value(m, "servelm_inter_token_latency_seconds_count", model="fake-model") == 4 + 3 + 2 * 2
    buckets = [s for s in m["servelm_inter_token_latency_seconds"] if s.name.endswith("_bucket")]
    assert len(buckets) > 5 and all(s.labels["model"] == "fake-model" for s in buckets)

    assert value(m, "servelm_kv_cells_capacity", model="fake-model") == fake_server.runner.kv_cells
    assert value(m, "servelm_kv_cells_used", model="fake-model") == 0
    assert value(m, "servelm_requests_waiting", model="fake-model") == 0
    assert value(m, "servelm_sequences_running", model="fake-model") == 0


def test_engine_step_and_forward_time_are_counted(fake_server_factory):
    """The loop's own overhead is 1 - forward/step: both counters move with work, forward never above step."""
    url = fake_server_factory(step_delay=0.01).base_url
    before = scrape(url)
    assert chat(url, max_tokens=5).status_code == 200
    after = scrape(url)
    step = value(after, "servelm_engine_step_seconds_total", model="fake-model")
    forward = value(after, "servelm_engine_forward_seconds_total", model="fake-model")
    assert value(before, "servelm_engine_step_seconds_total", model="fake-model") < step
    assert 5 * 0.01 <= forward <= step, "five steps of 10 ms each in the fake runner's forward pass"
    phases = {p: value(after, "servelm_engine_phase_seconds_total", model="fake-model", phase=p)
              for p in ("decode", "runner", "sample", "grammar", "detokenize", "loop", "idle")}
    assert phases["runner"] >= 5 * 0.01 and phases["sample"] > 0 and phases["loop"] > 0
    assert sum(phases.values()) - phases["idle"] <= step + 0.05, "the phases split the steps' time"


def test_a_stream_the_client_leaves_counts_as_aborted(fake_server_factory):
    url = fake_server_factory(step_delay=0.05).base_url  # 100 tokens would take 5 s
    with httpx.stream("POST", url + "/v1/chat/completions",
                      json={"model": "fake-model", "messages": MSG, "max_tokens": 100, "stream": True}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {") and '"content":"' in line and '"content":""' not in line:
                break
    deadline = time.monotonic() + 10
    while value(scrape(url), "servelm_generation_requests_total", model="fake-model", outcome="aborted") != 1:
        assert time.monotonic() < deadline, "the aborted stream was never counted"
        time.sleep(0.05)
    m = scrape(url)
    assert value(m, "servelm_e2e_request_latency_seconds_count", model="fake-model") == 1
    assert value(m, "servelm_generation_tokens_total", model="fake-model") >= 1


def test_two_apps_in_one_process_have_their_own_registries(fake_server_factory):
    a, b = fake_server_factory(), fake_server_factory()
    assert chat(a.base_url, max_tokens=2).status_code == 200
    assert value(scrape(a.base_url), "servelm_generation_requests_total", model="fake-model", outcome="completed") == 1
    assert value(scrape(b.base_url), "servelm_generation_requests_total", model="fake-model", outcome="completed") == 0


def test_request_id_is_echoed_or_generated(fake_server):
    url = fake_server.base_url
    given = httpx.get(url + "/v1/models", headers={"x-request-id": "abc-123.req:7"})
    assert given.headers["x-request-id"] == "abc-123.req:7"
    fresh = httpx.get(url + "/v1/models")
    other = httpx.get(url + "/v1/models")
    assert re.fullmatch(r"[0-9a-f]{32}", fresh.headers["x-request-id"])
    assert fresh.headers["x-request-id"] != other.headers["x-request-id"]
    # on errors and streams too
    assert chat(url, temperature=7, ).headers["x-request-id"]
    with httpx.stream("POST", url + "/v1/chat/completions", headers={"x-request-id": "s-1"},
                      json={"model": "fake-model", "messages": MSG, "max_tokens": 2, "stream": True}) as r:
        assert r.headers["x-request-id"] == "s-1"
        r.read()
    # one header, never the caller's unsafe text
    bad = httpx.get(url + "/v1/models", headers={"x-request-id": "a b\"<script>"})
    assert re.fullmatch(r"[0-9a-f]{32}", bad.headers["x-request-id"])
    assert len(bad.headers.get_list("x-request-id")) == 1


@pytest.mark.parametrize("raw, kept", [
    ("req-1", True), ("x" * MAX_REQUEST_ID, True), ("x" * (MAX_REQUEST_ID + 1), False), ("", False),
    ("a b", False), ("a\tb", False), ("é", False), ("a,b", False),
])
def test_request_id_sanitizing(raw, kept):
    rid = request_id_from([(b"x-request-id", raw.encode("utf-8"))])
    assert (rid == raw) is kept
    assert 1 <= len(rid) <= MAX_REQUEST_ID


def test_access_log_has_one_line_per_request_with_its_id(fake_server, caplog):
    caplog.set_level(logging.INFO, logger="servelm.access")
    url = fake_server.base_url
    httpx.get(url + "/v1/models", headers={"x-request-id": "log-me-1"})
    chat(url, max_tokens=2, stream=False)
    time.sleep(0.1)
    lines = [r for r in caplog.records if r.name == "servelm.access"]
    first = [r for r in lines if getattr(r, "request_id", None) == "log-me-1"]
    assert len(first) == 1 and first[0].levelno == logging.INFO
    assert re.fullmatch(r"GET /v1/models 200 \d+\.\dms request_id=log-me-1", first[0].getMessage())
    assert any(r.getMessage().startswith("POST /v1/chat/completions 200 ") for r in lines)
