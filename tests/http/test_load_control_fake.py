"""Load control: per-key requests/tokens per minute (429 + Retry-After), the bounded queue (429 queue_full),
and the request deadline (504, or an error event that ends a stream)."""

from __future__ import annotations

import json
import threading
import time

import httpx
import openai
import pytest

from servelm.http.limits import SecurityConfig
from servelm.http.ratelimit import Charge, TokenBucket
from servelm.keys import key_spec
from tests.conftest import wait_engine_idle

MSG = [{"role": "user", "content": "hi"}]
CHAT = {"model": "fake-model", "messages": MSG, "max_tokens": 3}
SLOW = {"model": "fake-model", "messages": MSG, "max_tokens": 200, "ignore_eos": True}


def post(server, body=CHAT, **headers):
    return httpx.post(server.base_url + "/v1/chat/completions", json=body, headers=headers, timeout=20)


def wait_idle(server, seconds=10.0):
    return wait_engine_idle(server.engine, seconds)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_token_bucket_refills_per_minute_and_lends_to_a_large_request():
    clock = Clock()
    b = TokenBucket(60, clock)  # one a second
    assert all(b.take(1) == 0 for _ in range(60))
    assert b.take(1) == pytest.approx(1.0)
    clock.now = 2.0
    assert b.take(1) == 0 and b.take(1) == 0 and b.take(1) > 0
    b = TokenBucket(60, clock)
    assert b.take_on_credit(100) == 0  # admitted into debt
    assert b.take_on_credit(1) == pytest.approx(40.0)  # until the debt is paid
    Charge(b, reserved=30).settle(10)  # 20 unused reserved tokens come back
    assert b.take_on_credit(1) == pytest.approx(20.0)


def test_requests_per_minute_answer_429_with_retry_after(fake_server_factory):
    server = fake_server_factory(security=SecurityConfig(rate_limit_rpm=2))
    assert post(server).status_code == 200 and post(server).status_code == 200
    r = post(server)
    assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
    err = r.json()["error"]
    assert err["code"] == "rate_limit_exceeded" and err["type"] == "requests" and "RPM" in err["message"]
    assert httpx.get(server.base_url + "/health").status_code == 200  # probes are not counted
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.RateLimitError):
        client.chat.completions.create(model="fake-model", messages=MSG, max_tokens=2)


def test_each_key_has_its_own_buckets_and_may_override_the_limit(fake_server_factory):
    keys = [key_spec("sk-a"), key_spec("sk-b", rpm=0), key_spec("sk-c", rpm=1)]
    server = fake_server_factory(security=SecurityConfig(keys=keys, rate_limit_rpm=1))
    a, b, c = ({"Authorization": f"Bearer {k}"} for k in ("sk-a", "sk-b", "sk-c"))
    assert post(server, **a).status_code == 200 and post(server, **a).status_code == 429
    assert all(post(server, **b).status_code == 200 for _ in range(3))  # rpm=0: no limit for this key
    assert post(server, **c).status_code == 200 and post(server, **c).status_code == 429


def test_tokens_per_minute_charge_prompt_and_max_tokens(fake_server_factory):
    server = fake_server_factory(security=SecurityConfig(rate_limit_tpm=30))
    body = {**CHAT, "max_tokens": 20, "ignore_eos": True}
    first = post(server, body)  # ~19 prompt + 20 reserved: admitted, into debt
    assert first.status_code == 200
    r = post(server, body)
    assert r.status_code == 429 and r.json()["error"]["type"] == "tokens" and "TPM" in r.json()["error"]["message"]
    assert int(r.headers["retry-after"]) >= 1


def test_a_full_queue_answers_429_queue_full(fake_server_factory):
    server = fake_server_factory(num_slots=1, step_delay=0.02, context_window=400, security=SecurityConfig(max_waiting=1))
    results: list[int] = []
    body = {**SLOW, "max_tokens": 50}  # a second each
    threads = [threading.Thread(target=lambda: results.append(post(server, body).status_code)) for _ in range(2)]
    for t in threads:
        t.start()
        time.sleep(0.3)  # the first runs, the second waits
    assert server.engine.stats().waiting == 1
    r = post(server)
    assert r.status_code == 429 and r.json()["error"]["code"] == "queue_full"
    assert "queue is full (1 requests waiting)" in r.json()["error"]["message"] and r.headers["retry-after"]
    streamed = post(server, {**CHAT, "stream": True})  # refused before the stream starts: a status, not an event
    assert streamed.status_code == 429
    for t in threads:
        t.join(20)
    assert results == [200, 200] and wait_idle(server)


def test_a_request_past_its_deadline_is_stopped_with_504(fake_server_factory):
    server = fake_server_factory(step_delay=0.02, context_window=400, security=SecurityConfig(request_timeout=0.5))
    start = time.monotonic()
    r = post(server, SLOW)
    assert r.status_code == 504 and time.monotonic() - start < 3
    assert r.json()["error"]["code"] == "request_timeout"
    assert wait_idle(server) and server.runner.cells_in_use() == 0
    assert post(server).status_code == 200  # quick requests still pass


def test_a_stream_past_its_deadline_ends_with_an_error_event(fake_server_factory):
    server = fake_server_factory(step_delay=0.02, context_window=400, security=SecurityConfig(request_timeout=0.5))
    with httpx.stream("POST", server.base_url + "/v1/chat/completions", json={**SLOW, "stream": True},
                      timeout=10) as r:
        assert r.status_code == 200
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["code"] == "request_timeout"
    assert len(events) > 3  # some tokens came first
    assert wait_idle(server) and server.runner.cells_in_use() == 0


def test_the_shutdown_cutoff_ends_a_waiting_stream_with_an_error_event_and_a_whole_answer_with_503(
        fake_server_factory):
    server = fake_server_factory(step_delay=0.05, context_window=400)
    drain = server.drain
    whole: list[httpx.Response] = []
    waiter = threading.Thread(target=lambda: whole.append(post(server, SLOW)))
    with httpx.stream("POST", server.base_url + "/v1/chat/completions", json={**SLOW, "stream": True},
                      timeout=10) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        events = [next(line for line in lines if line.startswith("data: "))[6:]]
        waiter.start()
        deadline = time.monotonic() + 5
        tasks: list = []
        while len(tasks) < 2 and time.monotonic() < deadline:  # both requests wait on steps
            time.sleep(0.01)
            tasks = [watch.task for watch in list(drain.watches) if watch.task is not None]
        task = tasks[0]
        task.get_loop().call_soon_threadsafe(drain.cut_now)
        events += [line[6:] for line in lines if line.startswith("data: ")]
    waiter.join(10)
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["code"] == "server_shutting_down"
    assert whole[0].status_code == 503 and whole[0].json()["error"]["code"] == "server_shutting_down"
    assert wait_idle(server) and server.runner.cells_in_use() == 0
    assert not drain.watches


def test_a_batch_counts_as_its_size_and_is_refused_whole(fake_server_factory):
    """A batch of legacy-completion prompts takes one place per prompt: one that does not fit is refused as a
    whole (before, a 10,000-prompt batch counted as one request and locked everyone else out)."""
    server = fake_server_factory(num_slots=1, step_delay=0.01,
                                 security=SecurityConfig(max_waiting=4, max_waiting_per_key=0))
    url = server.base_url + "/v1/completions"
    body = {"model": "fake-model", "max_tokens": 2, "temperature": 0}
    r = httpx.post(url, json={**body, "prompt": ["ab"] * 5}, timeout=20)
    assert r.status_code == 429 and r.json()["error"]["code"] == "queue_full"
    assert wait_idle(server) and server.runner.steps == [], "nothing of the refused batch ran"
    r = httpx.post(url, json={**body, "prompt": ["ab"] * 4}, timeout=20)
    assert r.status_code == 200 and len(r.json()["choices"]) == 4


def test_a_batch_larger_than_the_cap_is_a_400(fake_server_factory):
    server = fake_server_factory(security=SecurityConfig(max_batch_prompts=3))
    r = httpx.post(server.base_url + "/v1/completions",
                   json={"model": "fake-model", "prompt": ["a"] * 4, "max_tokens": 1}, timeout=20)
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "prompt" and err["code"] == "too_many_prompts"
    assert "at most 3" in err["message"]


def test_simultaneous_streams_reserve_their_places_at_admission(fake_server_factory):
    """300 simultaneous streams with --max-waiting 16 were all admitted, since a stream was counted only once it
    started. Now the place is taken in the same step as the check."""
    server = fake_server_factory(num_slots=1, step_delay=0.01,
                                 security=SecurityConfig(max_waiting=3, max_waiting_per_key=0))
    body = {**SLOW, "max_tokens": 20, "stream": True}
    statuses: list[int] = []
    lock = threading.Lock()

    def one() -> None:
        with httpx.stream("POST", server.base_url + "/v1/chat/completions", json=body, timeout=60) as r:
            r.read()
            with lock:
                statuses.append(r.status_code)

    threads = [threading.Thread(target=one) for _ in range(24)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(statuses) == 24 and set(statuses) <= {200, 429}
    admitted = statuses.count(200)
    # at most 3 waiting at any moment, plus the one running and those that finished meanwhile (each ~0.2 s)
    assert 4 <= admitted < 24 and statuses.count(429) > 0, statuses
    assert wait_idle(server)


def test_one_key_cannot_fill_the_queue_for_all(fake_server_factory):
    keys = [key_spec("sk-busy"), key_spec("sk-other"), key_spec("sk-small", max_waiting=1)]
    server = fake_server_factory(num_slots=1, step_delay=0.02, context_window=400, security=SecurityConfig(keys=keys, max_waiting=6))
    busy = {"Authorization": "Bearer sk-busy"}
    results: list[int] = []
    threads = [threading.Thread(target=lambda: results.append(post(server, {**SLOW, "max_tokens": 120}, **busy).status_code))
               for _ in range(4)]
    for t in threads:
        t.start()
        time.sleep(0.15)  # one runs, three wait: the key's share (half of 6) is used
    r = post(server, **busy)
    assert r.status_code == 429 and "one caller may hold 3" in r.json()["error"]["message"]
    assert post(server, Authorization="Bearer sk-other").status_code == 200, "another key still gets in"
    for t in threads:
        t.join(30)
    assert results == [200] * 4 and wait_idle(server)


@pytest.mark.parametrize("outputs", [[(0, 4), (0, 10)],  # one choice's outputs: its count so far, each time
                                     [(0, 6), (1, 4)]])  # two choices' (n = 2)
def test_every_api_settles_the_charge_from_its_usage(outputs):
    # the admission counts what the engine made, whatever the API's answer calls it (completion_tokens, a Messages
    # event's output_tokens, a Responses event's): it settles alike for every API
    from servelm.engine.types import GenerationOutput
    from servelm.engine.wrappers.admission import WaitingQueue

    clock = Clock()
    b = TokenBucket(60, clock)
    b.take_on_credit(100)
    queue = WaitingQueue()
    admission = queue.reserve("caller", ["gen-1"], 0, 0, Charge(b, reserved=30))
    for index, made in outputs:
        queue.output(GenerationOutput("gen-1", index, "", [], completion_tokens=made))
    admission.close()
    assert b.take_on_credit(1) == pytest.approx(20.0)  # 20 of the 30 reserved came back, not 30
