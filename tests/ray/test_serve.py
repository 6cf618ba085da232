"""servelm on a two-node Ray cluster, two replicas of the default model, driven by the official openai client:
the contract's basics, prefix-affine routing, and a replica killed mid-run."""

from __future__ import annotations

import asyncio
import re
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import httpx
import openai
import pytest

from .conftest import MODEL, RayServer

pytestmark = [pytest.mark.ray, pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(240)]  # e2e: `make test-unit` leaves it out

REPLICA_HEADER = "x-servelm-replica"
NO_EOS = {"ignore_eos": True}
SYSTEM = ("You are a careful assistant for a small bakery. You answer questions about bread, cakes, opening hours "
          "and prices in short, friendly sentences, and you never invent prices you were not told about. ") * 3


def client(server: RayServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", timeout=90, max_retries=0)


def ask(server: RayServer, messages: list, **kw):
    """One non-streamed chat request; (the parsed completion, the replica that served it)."""
    raw = client(server).chat.completions.with_raw_response.create(model=MODEL, messages=messages, **kw)
    return raw.parse(), raw.headers.get(REPLICA_HEADER)


def test_chat_non_streamed(ray_server: RayServer) -> None:
    reply, replica = ask(ray_server, [{"role": "user", "content": "Name three colours."}], max_tokens=12, temperature=0)
    assert reply.model == MODEL and reply.object == "chat.completion"
    assert reply.choices[0].message.content
    assert reply.choices[0].finish_reason in ("stop", "length")
    assert reply.usage.completion_tokens > 0 and reply.usage.prompt_tokens > 0
    assert replica


def test_chat_streamed(ray_server: RayServer) -> None:
    with client(ray_server).chat.completions.with_streaming_response.create(
        model=MODEL, messages=[{"role": "user", "content": "Count to five."}], max_tokens=10, stream=True,
        stream_options={"include_usage": True}, extra_body=NO_EOS,
    ) as response:
        assert response.headers.get(REPLICA_HEADER)
        assert response.headers["content-type"].startswith("text/event-stream")
        chunks = list(response.parse())
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 10


def test_stream_ends_with_done(ray_server: RayServer) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "stream": True}
    with httpx.stream("POST", f"{ray_server.base_url}/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        frames = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert frames[-1] == "data: [DONE]"


def test_a_batch_of_prompts_runs_its_generations_at_once(ray_server: RayServer) -> None:
    """One HTTP request, two generate calls in flight together (Ray Serve routes them as requests of their own)."""
    reply = client(ray_server).completions.create(model=MODEL, prompt=["Once upon a time", "The best fruit is"],
                                                  max_tokens=4, temperature=0, extra_body=NO_EOS)
    assert [c.index for c in reply.choices] == [0, 1] and all(c.finish_reason == "length" for c in reply.choices)
    assert reply.usage.completion_tokens == 8


def test_the_deployments_priority_bound_holds_under_ray(ray_server: RayServer) -> None:
    """The ingress's deployments carry their spec's min_priority (0 here), as a single process's do."""
    r = httpx.post(f"{ray_server.base_url}/v1/chat/completions", timeout=60, json={
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "priority": -1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "priority"


def test_unknown_model_is_404_in_the_envelope(ray_server: RayServer) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        client(ray_server).chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "x"}])
    assert caught.value.status_code == 404
    assert caught.value.body["code"] == "model_not_found" and caught.value.body["param"] == "model"


def test_models_health_metrics_and_embeddings(ray_server: RayServer) -> None:
    card = next(m for m in client(ray_server).models.list().data if m.id == MODEL)
    assert card.model_extra["exact"] is True  # the replicas' self-check, told to the ingress
    health = ray_server.health()
    assert health["status"] == "ok" and health["deployments"][MODEL]["total_slots"] == 4  # two replicas of two
    assert health["deployments"][MODEL]["exact"] is True
    metrics = httpx.get(f"{ray_server.base_url}/metrics", timeout=10).text
    assert "servelm_http_requests_total" in metrics and "servelm_time_to_first_token_seconds" in metrics
    # the replicas' own garbage collectors: what each built at its start (Ray, the model, its vocabulary tables) is
    # frozen out of their way, so that a full collection there does not hold its engine's GIL for a tenth of a second
    frozen = re.search(rf'^servelm_replica_gc_frozen_objects{{model="{MODEL}"}} (\S+)$', metrics, re.M)
    assert frozen is not None and float(frozen.group(1)) > 50_000, frozen
    pauses = re.findall(rf'^servelm_replica_gc_pause_seconds_total{{generation="(\d)",model="{MODEL}"}} (\S+)$',
                        metrics, re.M)
    assert sorted(g for g, _ in pauses) == ["0", "1", "2"] and all(float(s) >= 0 for _, s in pauses), pauses
    vectors = client(ray_server).embeddings.create(model=MODEL, input=["bread", "cake"]).data
    assert len(vectors) == 2 and len(vectors[0].embedding) > 0


def test_next_turn_lands_on_the_replica_holding_the_conversation(ray_server: RayServer) -> None:
    for topic in ("rye bread", "carrot cake"):  # two conversations: each stays where it began
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"Tell me about {topic}."}]
        first, replica = ask(ray_server, messages, max_tokens=16, temperature=0)
        messages += [{"role": "assistant", "content": first.choices[0].message.content},
                     {"role": "user", "content": "And how long does it keep?"}]
        second, again = ask(ray_server, messages, max_tokens=8, temperature=0)
        assert again == replica, f"turn 2 of {topic!r} went to {again}, turn 1 to {replica}"
        assert second.usage.prompt_tokens_details.cached_tokens > first.usage.prompt_tokens // 2


def test_a_stream_dies_with_its_client(ray_server: RayServer) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me a long story."}], "max_tokens": 1500,
            "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{ray_server.base_url}/v1/chat/completions", json=body, timeout=60) as r:
        for n, _ in enumerate(r.iter_lines()):
            if n >= 6:
                break  # leave after a few tokens: the replica must free the sequence (1500 would take 15 s or more)
    deadline = time.monotonic() + 6
    while time.monotonic() < deadline:
        stats = ray_server.health()["deployments"][MODEL]
        if stats["running"] == 0 and stats["waiting"] == 0:
            return
        time.sleep(0.5)
    pytest.fail(f"the replica still runs the abandoned stream: {stats}")


# -- a replica killed mid-run ---------------------------------------------------------------------------
def _stream_until_first_token(server: RayServer, question: str, started: threading.Event, out: dict) -> None:
    """Stream a long answer; note the replica and signal after the first token; keep reading to the end or
    the error that ends it."""
    try:
        with client(server).chat.completions.with_streaming_response.create(
            model=MODEL, messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
            max_tokens=600, stream=True, extra_body=NO_EOS,
        ) as response:
            out["replica"] = response.headers.get(REPLICA_HEADER)
            tokens = 0
            for chunk in response.parse():
                if chunk.choices and chunk.choices[0].delta.content:
                    tokens += 1
                    started.set()
            out["tokens"] = tokens
    except openai.APIError as exc:
        out["error"] = exc
    finally:
        started.set()


def _replica_actor(replica: str):
    import ray
    from ray.serve._private.common import DeploymentID, ReplicaID

    from servelm.ray.application import APP_NAME

    return ray.get_actor(ReplicaID(replica, DeploymentID(MODEL, APP_NAME)).to_full_id_str(), namespace="serve")


def _start_streams(pool: ThreadPoolExecutor, server: RayServer, n: int) -> list[dict]:
    outs = []
    for i in range(n):
        started, out = threading.Event(), {}
        pool.submit(_stream_until_first_token, server, f"Describe loaf number {i} in detail.", started, out)
        assert started.wait(60), "a stream did not start"
        outs.append(out)
    return outs


def test_killed_replica_retries_waiting_requests_and_fails_started_streams(ray_server: RayServer) -> None:
    import ray

    with ThreadPoolExecutor(max_workers=8) as pool:
        streams = _start_streams(pool, ray_server, 2)  # both slots of one replica (same system prompt: same replica)
        victim = streams[0]["replica"]
        assert streams[1]["replica"] == victim
        waiting: list[Future] = []
        for i in range(2):  # queued behind the streams on the same replica: not started when it dies
            messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"Price of roll {i}?"}]
            waiting.append(pool.submit(ask, ray_server, messages, max_tokens=8, temperature=0))
            time.sleep(0.3)
        time.sleep(1.0)
        ray.kill(_replica_actor(victim), no_restart=True)
        answers = [f.result(timeout=120) for f in waiting]
    for out in streams:
        assert "error" in out, f"a stream on the killed replica ended without an error: {out}"
        assert out["error"].body.get("code") == "replica_unavailable"
        assert "stopped before it finished" in out["error"].message
    for reply, _ in answers:  # none lost: each answered in full, after its retry
        assert reply.choices[0].message.content and reply.choices[0].finish_reason in ("stop", "length")
    retried = [replica for _, replica in answers if replica.split(",")[0] == victim]
    assert retried and all(len(r.split(",")) == 2 for r in retried), [r for _, r in answers]
    _wait_replaced(ray_server, victim)


def _wait_replaced(server: RayServer, victim: str) -> None:
    """Ray Serve starts a new replica in the dead one's place (two replicas again, neither the victim); the
    service answers meanwhile and after."""
    live = server.run(_two_live_replicas(victim, timeout=120), timeout=150)
    assert len(live) == 2 and victim not in live, f"the killed replica was not replaced within 120 s: {live}"
    reply, replica = ask(server, [{"role": "user", "content": "Still there?"}], max_tokens=4)
    assert reply.choices[0].message.content is not None and replica in live


async def _two_live_replicas(victim: str, timeout: float) -> set[str]:
    """The ids of the replicas that answer, once they are two and the victim is not among them."""
    from ray import serve

    from servelm.ray.application import APP_NAME

    handle = serve.get_deployment_handle(MODEL, APP_NAME)
    deadline = time.monotonic() + timeout
    live: set[str] = set()
    while time.monotonic() < deadline:
        answers = await handle.broadcast("stats").results_async(timeout_s=10, return_exceptions=True)
        live = {a.replica for a in answers if not isinstance(a, Exception)}
        if len(live) == 2 and victim not in live:
            break
        await asyncio.sleep(1.0)
    return live


def test_stored_responses_live_in_the_shared_actor(ray_server: RayServer) -> None:
    import ray

    from servelm.ray.store import ACTOR_NAME, ACTOR_NAMESPACE

    base = ray_server.base_url
    r = httpx.post(f"{base}/v1/responses", json={"model": MODEL, "input": "hi", "max_output_tokens": 3},
                   timeout=60).json()
    assert httpx.get(f"{base}/v1/responses/{r['id']}", timeout=10).json()["id"] == r["id"]
    # any replica reaches the store by name: here, this test's own Ray driver
    actor = ray.get_actor(ACTOR_NAME, namespace=ACTOR_NAMESPACE)
    assert ray.get(actor.get.remote("", r["id"])).response["id"] == r["id"]
    follow = httpx.post(f"{base}/v1/responses", json={"model": MODEL, "input": "more", "max_output_tokens": 3,
                                                       "previous_response_id": r["id"]}, timeout=60)
    assert follow.status_code == 200 and follow.json()["usage"]["input_tokens_details"]["cached_tokens"] > 0
