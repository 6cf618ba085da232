"""Priorities, preemption and the Batch API on the real model: a preempted request's answer is bitwise the one it
has alone (greedy and seeded); the official openai client runs a batch end to end; a server killed mid-batch and
started again answers every line exactly once; `servelm batch` runs a file offline, resumably, and on Ray."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time

import httpx
import openai
import pytest

from . import ray_mode
from .conftest import REPO_ROOT, own_server
from .helpers import MODEL, client_for

FAST = ("--no-embedding-model", "--chat-embedding-window", "0")
LONG_ASK = [{"role": "user", "content": "Write a long story about a lighthouse keeper and the sea."}]


def jsonl(lines) -> bytes:
    return "".join(json.dumps(line) + "\n" for line in lines).encode()


def chat_line(i: int, max_tokens: int = 16) -> dict:
    return {"custom_id": f"line-{i}", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": MODEL, "messages": [{"role": "user", "content": f"Name a colour, then the number {i}."}],
                     "max_tokens": max_tokens, "temperature": 0}}


def wait_batch(client: openai.OpenAI, batch_id: str, timeout: float = 240.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        batch = client.batches.retrieve(batch_id)
        if batch.status in ("completed", "failed", "cancelled", "expired"):
            return batch
        time.sleep(0.2)
    raise AssertionError(f"batch {batch_id} still {batch.status}")


def preemptions(base_url: str) -> float:
    text = httpx.get(base_url + "/metrics").text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith("servelm_preemptions_total"))


async def stream_text(client: openai.AsyncOpenAI, priority: int, started: asyncio.Event | None = None, **kw) -> str:
    text = ""
    stream = await client.chat.completions.create(model=MODEL, messages=LONG_ASK, max_tokens=90, stream=True,
                                                  extra_body={"priority": priority}, **kw)
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            text += chunk.choices[0].delta.content
            if started is not None and len(text) > 40:
                started.set()
    return text


@pytest.mark.skipif(ray_mode.ENABLED, reason="one process's scheduler: the Ray replicas each have their own")
def test_a_preempted_answer_is_bitwise_the_answer_alone(tmp_path_factory) -> None:
    with own_server(tmp_path_factory, "--max-num-seqs", "2", *FAST) as srv:
        client = openai.AsyncOpenAI(base_url=srv.base_url + "/v1", api_key="none", max_retries=0)
        kinds = ({"temperature": 0}, {"temperature": 0.9, "seed": 11})

        async def scenario() -> tuple[list[str], list[str]]:
            async with client:  # its connections closed on this loop (left open: a ResourceWarning once it is gone)
                alone = [await stream_text(client, 5, **kw) for kw in kinds]
                started = [asyncio.Event(), asyncio.Event()]
                low = [asyncio.create_task(stream_text(client, 5, s, **kw)) for s, kw in zip(started, kinds, strict=True)]
                await asyncio.gather(*(s.wait() for s in started))
                urgent = await client.chat.completions.create(model=MODEL, messages=LONG_ASK, max_tokens=20,
                                                              temperature=0, extra_body={"priority": 0})
                assert urgent.choices[0].message.content
                assert not all(t.done() for t in low), "the urgent request ran while the low ones waited"
                return alone, list(await asyncio.gather(*low))

        alone, preempted = asyncio.run(scenario())
        assert preemptions(srv.base_url) >= 1
    assert preempted == alone


@pytest.mark.slow
def test_a_batch_runs_with_the_official_client_and_survives_a_kill(tmp_path_factory) -> None:
    state = str(tmp_path_factory.mktemp("state"))
    flags = ("--state-dir", state, "--max-num-seqs", "4")
    lines = [chat_line(i) for i in range(24)]
    with own_server(tmp_path_factory, *flags) as srv:
        client = client_for(srv.base_url)
        direct = client.chat.completions.create(**lines[3]["body"]).choices[0].message.content
        embed = client.files.create(file=("e.jsonl", jsonl([{"custom_id": "e", "method": "POST", "url": "/v1/embeddings",
                                                            "body": {"model": "all-minilm-l6-v2", "input": "a"}}])),
                                    purpose="batch")
        done = wait_batch(client, client.batches.create(input_file_id=embed.id, endpoint="/v1/embeddings",
                                                        completion_window="24h").id)
        out = [json.loads(x) for x in client.files.content(done.output_file_id).text.splitlines()]
        assert done.status == "completed" and len(out[0]["response"]["body"]["data"][0]["embedding"]) == 384
        f = client.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")
        batch = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
        assert [b.id for b in client.batches.list().data][0] == batch.id
        while client.batches.retrieve(batch.id).request_counts.completed < 4:
            time.sleep(0.05)
        srv.process.kill()  # no graceful stop: what was committed is all there is
        srv.process.wait(timeout=10)
        answered_before = None
    with own_server(tmp_path_factory, *flags) as srv:
        client = client_for(srv.base_url)
        answered_before = client.batches.retrieve(batch.id).request_counts.completed
        done = wait_batch(client, batch.id)
        assert done.status == "completed"
        assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (24, 24, 0)
        out = [json.loads(x) for x in client.files.content(done.output_file_id).text.splitlines()]
        cancel_file = client.files.create(file=("c.jsonl", jsonl([chat_line(i, 64) for i in range(40)])),
                                          purpose="batch")
        doomed = client.batches.create(input_file_id=cancel_file.id, endpoint="/v1/chat/completions",
                                       completion_window="24h")
        while client.batches.retrieve(doomed.id).request_counts.completed < 1:
            time.sleep(0.05)
        client.batches.cancel(doomed.id)
        cancelled = wait_batch(client, doomed.id)
    assert answered_before >= 4
    assert sorted(o["custom_id"] for o in out) == sorted(line["custom_id"] for line in lines), "each line once"
    by_id = {o["custom_id"]: o["response"]["body"]["choices"][0]["message"]["content"] for o in out}
    assert by_id["line-3"] == direct, "a line's answer is the endpoint's answer"
    assert cancelled.status == "cancelled" and 1 <= cancelled.request_counts.completed < 40


def _cli_batch(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SERVELM_")}
    return subprocess.run([sys.executable, "-m", "servelm", "batch", *args, *FAST], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


def test_servelm_batch_runs_a_file_offline_and_goes_on_where_it_stopped(tmp_path) -> None:
    source, output = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_bytes(jsonl([chat_line(i, 8) for i in range(6)]))
    first = _cli_batch("-i", str(source), "-o", str(output))
    assert first.returncode == 0, first.stderr[-3000:]
    answers = {json.loads(x)["custom_id"]: x for x in output.read_text().splitlines()}
    assert set(answers) == {f"line-{i}" for i in range(6)}
    kept = [answers["line-0"], answers["line-1"]]
    output.write_text("\n".join(kept) + "\n" + answers["line-2"][:40])  # killed in the middle of a line
    again = _cli_batch("-i", str(source), "-o", str(output))
    assert again.returncode == 0, again.stderr[-3000:]
    lines = [json.loads(x) for x in output.read_text().splitlines()]
    assert sorted(o["custom_id"] for o in lines) == [f"line-{i}" for i in range(6)]
    assert [json.dumps(o) for o in lines[:2]] == [json.dumps(json.loads(k)) for k in kept], "what it held stays"
    for o in lines:
        old = json.loads(answers[o["custom_id"]])["response"]["body"]["choices"][0]["message"]["content"]
        assert o["response"]["body"]["choices"][0]["message"]["content"] == old


@pytest.mark.slow
def test_servelm_batch_on_ray_maps_the_lines_over_engine_actors(tmp_path) -> None:
    source, output = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_bytes(jsonl([chat_line(i, 8) for i in range(4)]))
    run = _cli_batch("-i", str(source), "-o", str(output), "--ray", "--actors", "2", "--threads", "1")
    assert run.returncode == 0, run.stderr[-3000:]
    lines = [json.loads(x) for x in output.read_text().splitlines()]
    assert sorted(o["custom_id"] for o in lines) == [f"line-{i}" for i in range(4)]
    assert all(o["response"]["status_code"] == 200 for o in lines)
