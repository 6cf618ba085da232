"""The Files and Batches API over the fake runner, through the official openai client: objects in OpenAI's shapes,
lines answered once each, bad lines failing alone, cancel, per-key scoping and the limits."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest

from servelm.http.batches import BatchConfig
from servelm.http.limits import SecurityConfig
from servelm.keys import KeySpec, hash_key
from tests.openai_spec import assert_conforms as check_schema

MSG = [{"role": "user", "content": "hi"}]


def jsonl(lines) -> bytes:
    return "".join(json.dumps(line) + "\n" for line in lines).encode()


def chat_line(i, model="fake-model", **body):
    return {"custom_id": f"req-{i}", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": model, "messages": MSG, "max_tokens": 3, "temperature": 0, **body}}


def wait_for(client, batch_id, statuses=("completed", "failed", "cancelled", "expired"), timeout=20.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        batch = client.batches.retrieve(batch_id)
        if batch.status in statuses:
            return batch
        time.sleep(0.05)
    raise AssertionError(f"batch {batch_id} is still {batch.status}")


def outputs(client, file_id):
    return [json.loads(line) for line in client.files.content(file_id).text.splitlines()]


@pytest.fixture
def server(fake_server_factory, tmp_path):
    return fake_server_factory(batches=BatchConfig(str(tmp_path / "state"), max_file_bytes=64 << 10, max_lines=50))


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0)


def test_a_chat_batch_runs_end_to_end_with_the_official_client(server, client):
    lines = [chat_line(i) for i in range(6)] + [chat_line(6, model="no-such-model"), chat_line(7, stream=True)]
    f = client.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")
    assert f.object == "file" and f.purpose == "batch" and f.bytes == len(jsonl(lines)) and f.filename == "in.jsonl"
    check_schema("OpenAIFile", httpx.get(f"{server.base_url}/v1/files/{f.id}").json())
    batch = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h",
                                  metadata={"job": "t"})
    assert batch.status == "validating" and batch.object == "batch" and batch.metadata == {"job": "t"}
    done = wait_for(client, batch.id)
    # OpenAI's API answers null for a batch's times and files not yet set, which its description does not list as
    # nullable: the check follows the API
    check_schema("Batch", {k: v for k, v in httpx.get(f"{server.base_url}/v1/batches/{batch.id}").json().items()
                           if v is not None})
    assert done.status == "completed" and done.completed_at and done.in_progress_at and done.finalizing_at
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (8, 6, 2), \
        client.files.content(done.error_file_id).text
    ok = outputs(client, done.output_file_id)
    assert sorted(o["custom_id"] for o in ok) == [f"req-{i}" for i in range(6)], "each line once, in the output"
    direct = httpx.post(server.base_url + "/v1/chat/completions",
                        json={"model": "fake-model", "messages": MSG, "max_tokens": 3, "temperature": 0}).json()
    for o in ok:
        assert o["response"]["status_code"] == 200 and o["error"] is None and o["id"].startswith("batch_req_")
        body = o["response"]["body"]
        assert body["object"] == "chat.completion"
        assert body["choices"][0]["message"]["content"] == direct["choices"][0]["message"]["content"]
    assert done.usage.output_tokens == 6 * 3 and done.usage.input_tokens > 0
    failed = {o["custom_id"]: o for o in outputs(client, done.error_file_id)}
    assert failed["req-6"]["response"]["status_code"] == 404
    assert failed["req-6"]["response"]["body"]["error"]["code"] == "model_not_found"
    assert failed["req-7"]["response"]["status_code"] == 400
    assert failed["req-7"]["response"]["body"]["error"]["param"] == "stream"
    listed = client.batches.list()
    assert [b.id for b in listed.data] == [batch.id]
    names = {x.filename for x in client.files.list().data}
    assert names == {"in.jsonl", f"{batch.id}_output.jsonl", f"{batch.id}_error.jsonl"}
    assert client.files.delete(f.id).deleted
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(f.id)


@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/responses"])  # embeddings: tests/e2e/test_batch.py
def test_every_generating_endpoint_runs_as_a_batch(client, endpoint):
    body = {"/v1/completions": {"model": "fake-model", "prompt": "ab", "max_tokens": 2},
            "/v1/responses": {"model": "fake-model", "input": "ab", "max_output_tokens": 2}}[endpoint]
    f = client.files.create(file=("x.jsonl", jsonl([{"custom_id": "a", "method": "POST", "url": endpoint,
                                                     "body": body}])), purpose="batch")
    done = wait_for(client, client.batches.create(input_file_id=f.id, endpoint=endpoint, completion_window="24h").id)
    assert done.status == "completed" and done.request_counts.completed == 1, done


def test_a_malformed_file_fails_the_batch_with_errors_by_line(client):
    bad = jsonl([chat_line(0), {"custom_id": "req-0", "method": "POST", "url": "/v1/chat/completions", "body": {}},
                 {"custom_id": "x", "method": "POST", "url": "/v1/completions", "body": {}}]) + b"{not json\n"
    f = client.files.create(file=("bad.jsonl", bad), purpose="batch")
    done = wait_for(client, client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                                  completion_window="24h").id)
    assert done.status == "failed" and done.failed_at
    codes = {(e.code, e.line) for e in done.errors.data}
    assert {("duplicate_custom_id", 2), ("invalid_url", 3), ("invalid_json_line", 4)} <= codes


def test_bad_requests_to_the_api_are_clear_4xx(server, client):
    url = server.base_url
    with pytest.raises(openai.BadRequestError) as e:
        client.batches.create(input_file_id="file-x", endpoint="/v1/moderations", completion_window="24h")
    assert e.value.body["param"] == "endpoint"
    with pytest.raises(openai.NotFoundError):
        client.batches.create(input_file_id="file-nope", endpoint="/v1/chat/completions", completion_window="24h")
    f = client.files.create(file=("in.jsonl", jsonl([chat_line(0)])), purpose="batch")
    with pytest.raises(openai.BadRequestError) as e:
        client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="soon")
    assert e.value.body["param"] == "completion_window"
    with pytest.raises(openai.BadRequestError) as e:
        client.files.create(file=("in.jsonl", b"{}"), purpose="fine-tune")
    assert e.value.body["param"] == "purpose"
    with pytest.raises(openai.BadRequestError) as e:
        client.files.create(file=("many.jsonl", jsonl([chat_line(i) for i in range(51)])), purpose="batch")
    assert e.value.body["param"] == "file"
    r = httpx.post(url + "/v1/files", files={"file": ("big.jsonl", b"x" * (200 << 10))}, data={"purpose": "batch"})
    assert r.status_code == 413
    assert httpx.get(url + "/v1/batches/batch_nope").status_code == 404
    assert httpx.post(url + "/v1/batches", json={"input_file_id": f.id, "endpoint": "/v1/chat/completions",
                                                 "completion_window": "24h", "colour": 1}).status_code == 400


def slow_batch(factory, tmp_path, lines: int, max_tokens: int, window: str = "24h", step_delay: float = 0.02):
    """A server answering one line at a time, slowly, and a chat batch of `lines` lines created on it."""
    srv = factory(batches=BatchConfig(str(tmp_path / "s"), max_in_flight=1), step_delay=step_delay)
    client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="none", max_retries=0)
    f = client.files.create(file=("in.jsonl", jsonl([chat_line(i, max_tokens=max_tokens) for i in range(lines)])),
                            purpose="batch")
    batch = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window=window)
    return srv, client, batch


def test_cancel_keeps_the_lines_already_answered(fake_server_factory, tmp_path):
    srv, client, batch = slow_batch(fake_server_factory, tmp_path, 40, max_tokens=5)
    while client.batches.retrieve(batch.id).request_counts.completed < 2:
        time.sleep(0.02)
    cancelling = client.batches.cancel(batch.id)
    assert cancelling.status in ("cancelling", "cancelled")
    done = wait_for(client, batch.id)
    assert done.status == "cancelled" and done.cancelled_at
    answered = outputs(client, done.output_file_id)
    assert 2 <= len(answered) < 40 and len(answered) == done.request_counts.completed
    assert len({o["custom_id"] for o in answered}) == len(answered)


def test_cancel_takes_a_bare_post_as_curl_sends_it(fake_server_factory, tmp_path):
    srv, client, batch = slow_batch(fake_server_factory, tmp_path, 40, max_tokens=5)
    r = httpx.post(f"{srv.base_url}/v1/batches/{batch.id}/cancel")  # no body, no content type
    assert r.status_code == 200 and r.json()["status"] in ("cancelling", "cancelled")
    assert wait_for(client, batch.id).status == "cancelled"
    r = httpx.post(f"{srv.base_url}/v1/batches/{batch.id}/cancel", content=b"x")  # a body still needs JSON
    assert r.status_code == 415


def test_a_batch_past_its_window_expires_keeping_what_it_answered(fake_server_factory, tmp_path):
    _, client, batch = slow_batch(fake_server_factory, tmp_path, 30, max_tokens=8, window="2s", step_delay=0.03)
    done = wait_for(client, batch.id, timeout=30)
    assert done.status == "expired" and done.expired_at
    answered = outputs(client, done.output_file_id) if done.output_file_id else []
    expired = outputs(client, done.error_file_id)
    assert len(answered) + len(expired) == 30 and answered
    assert all(o["error"]["code"] == "batch_expired" and o["response"] is None for o in expired)


def test_files_and_batches_are_scoped_per_key(fake_server_factory, tmp_path):
    keys = [KeySpec(hash_key("key-a")), KeySpec(hash_key("key-b"))]
    srv = fake_server_factory(batches=BatchConfig(str(tmp_path / "s")), security=SecurityConfig(keys=keys))
    a = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="key-a", max_retries=0)
    b = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="key-b", max_retries=0)
    f = a.files.create(file=("in.jsonl", jsonl([chat_line(0)])), purpose="batch")
    batch = a.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert wait_for(a, batch.id).request_counts.completed == 1, "the line runs as the key that created the batch"
    for call in (lambda: b.files.retrieve(f.id), lambda: b.files.content(f.id), lambda: b.batches.retrieve(batch.id),
                 lambda: b.batches.cancel(batch.id), lambda: b.files.delete(f.id),
                 lambda: b.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                          completion_window="24h")):
        with pytest.raises(openai.NotFoundError):
            call()
    assert b.files.list().data == [] and b.batches.list().data == []
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=srv.base_url + "/v1", api_key="wrong", max_retries=0).files.list()


def test_without_a_state_dir_the_api_says_what_it_needs(fake_server):
    r = httpx.get(fake_server.base_url + "/v1/batches")
    assert r.status_code == 404 and "--state-dir" in r.json()["error"]["message"]
