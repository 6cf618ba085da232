"""Rerank, score and embeddings as an attack on other clients: a queue without a bound, and no fairness.

Eight 1,024-document reranks were all accepted, and another client's 2-document rerank then waited 161 s behind
them: the embedding engine packed inputs first come, first served. Now these routes take places in their
deployment's waiting queue like generation (--max-waiting, and each caller's share: --max-waiting-per-key or a
key's `max_waiting`), a 429 queue_full in the route's own error shape past it; the engine packs its passes from
each caller's requests in turn; and a request holds at most MAX_PAIRS pairs (a 400 naming the field)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time

import httpx
import numpy as np
import pytest

from servelm.compose import build_embedding_deployment
from servelm.engine.embedding import EmbeddingEngine
from servelm.http.app import AppOptions, create_app
from servelm.http.limits import SecurityConfig
from servelm.keys import key_spec
from servelm.runners.fake import FakeEmbedder
from servelm.service.registry.deployments import Deployments
from servelm.service.rerank import MAX_PAIRS
from tests.conftest import serving

RERANK, EMBED = "fake-rerank", "fake-embed"
KEYS = [key_spec("sk-big"), key_spec("sk-small"), key_spec("sk-one", max_waiting=1)]
BIG, SMALL, ONE = ({"Authorization": f"Bearer {k}"} for k in ("sk-big", "sk-small", "sk-one"))


def server(delay: float, security: SecurityConfig):
    """A reranker and an embedding model, each pass taking `delay` seconds (four inputs a pass)."""
    rerank, reranker = build_embedding_deployment(RERANK, FakeEmbedder(cross_encoder=True, delay=delay))
    embed, embedder = build_embedding_deployment(EMBED, FakeEmbedder(dim=8, delay=delay))
    app = create_app(Deployments([rerank, embed]), AppOptions(security=security),
                     on_start=lambda: [w.start() for w in (reranker, embedder)],
                     on_stop=lambda: [w.stop() for w in (reranker, embedder)])
    return serving(app)


def rerank_body(n: int) -> dict:
    return {"model": RERANK, "query": "cats", "documents": [f"doc {i}" for i in range(n)]}


ROUTES = [  # (path, body of 16 pairs, what a queue_full error looks like there)
    ("/v1/rerank", rerank_body(16), lambda j: j["error"]["code"] == "queue_full"),
    ("/v2/rerank", rerank_body(16), lambda j: set(j) == {"message"} and "queue" in j["message"]),
    ("/v3/rerank", rerank_body(16), lambda j: isinstance(j["error"], str) and "queue" in j["error"]),
    ("/v1/score", {"model": RERANK, "text_1": "cats", "text_2": [f"d{i}" for i in range(16)]},
     lambda j: j["error"]["code"] == "queue_full"),
    ("/v1/embeddings", {"model": EMBED, "input": [f"t{i}" for i in range(16)]},
     lambda j: j["error"]["code"] == "queue_full"),
]


@pytest.mark.parametrize(("path", "body", "shaped"), ROUTES, ids=[r[0] for r in ROUTES])
def test_past_max_waiting_a_request_is_429_queue_full_in_the_routes_shape(path, body, shaped):
    with server(0.1, SecurityConfig(max_waiting=2, max_waiting_per_key=0)) as url:  # 4 passes: 0.4 s a request
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            held = [pool.submit(httpx.post, url + path, json=body, timeout=30) for _ in range(2)]
            time.sleep(0.15)
            r = httpx.post(url + path, json=body, timeout=30)
            assert r.status_code == 429, r.text[:300]
            assert shaped(r.json()), r.text
            assert r.headers["retry-after"]
            assert [f.result().status_code for f in held] == [200, 200]
        assert httpx.post(url + path, json=body, timeout=30).status_code == 200, "the places came back"


def test_one_key_cannot_fill_the_queue_for_all():
    with server(0.1, SecurityConfig(keys=KEYS, max_waiting=4)) as url:
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            held = [pool.submit(httpx.post, url + "/v1/rerank", json=rerank_body(16), headers=BIG, timeout=30)
                    for _ in range(2)]  # half of 4: the key's share
            time.sleep(0.15)
            r = httpx.post(url + "/v1/rerank", json=rerank_body(2), headers=BIG, timeout=30)
            assert r.status_code == 429 and "one caller may hold 2" in r.json()["error"]["message"]
            assert httpx.post(url + "/v1/rerank", json=rerank_body(2), headers=SMALL, timeout=30).status_code == 200
            mine = pool.submit(httpx.post, url + "/v1/embeddings", json={"model": EMBED, "input": ["a"] * 16},
                               headers=ONE, timeout=30)
            time.sleep(0.15)
            r = httpx.post(url + "/v1/embeddings", json={"model": EMBED, "input": "b"}, headers=ONE, timeout=30)
            assert r.status_code == 429, "a key's own max_waiting holds on embeddings too"
            assert mine.result().status_code == 200 and all(f.result().status_code == 200 for f in held)


@pytest.mark.parametrize(("path", "small"), [
    ("/v1/rerank", rerank_body(2)),
    ("/v1/embeddings", {"model": EMBED, "input": ["one", "two"]}),
])
def test_a_small_request_is_not_stuck_behind_eight_huge_ones(path, small):
    """The issue's 161 s: eight 1,024-pair requests of one key, then another key's 2-pair request. Here each pass
    takes 2 ms (four inputs): the eight take about 4 s; the small one used to wait for all of them."""
    big = rerank_body(MAX_PAIRS) if path == "/v1/rerank" else {"model": EMBED, "input": [f"t{i}" for i in range(1024)]}
    with server(0.002, SecurityConfig(keys=KEYS, max_waiting=64)) as url:
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            start = time.monotonic()
            huge = [pool.submit(httpx.post, url + path, json=big, headers=BIG, timeout=120) for _ in range(8)]
            time.sleep(1.0)  # all eight read and queued in the engine
            asked = time.monotonic()
            r = httpx.post(url + path, json=small, headers=SMALL, timeout=120)
            waited = time.monotonic() - asked
            assert r.status_code == 200
            assert [f.result().status_code for f in huge] == [200] * 8
            total = time.monotonic() - start
    print(f"{path}: a 2-input request waited {waited:.3f} s beside eight 1,024-input ones (they took {total:.1f} s)")
    assert waited < total / 4, (waited, total)  # it used to wait for all of them (about total - 1 s)


def test_the_engine_takes_inputs_from_each_caller_in_turn():
    model = FakeEmbedder(dim=4, max_batch_seqs=4, max_batch_tokens=256)
    engine = EmbeddingEngine(model)
    gate = threading.Event()
    real = model.embed

    def slow(inputs):
        gate.wait(5)
        return real(inputs)

    model.embed = slow  # type: ignore[method-assign]

    async def main():
        engine.start()
        first = asyncio.ensure_future(engine.embed([[1, 2]], caller="a"))  # the worker takes it, and waits
        await asyncio.sleep(0.05)
        a = asyncio.ensure_future(engine.embed([[1, 10 + i] for i in range(6)], caller="a"))
        b = asyncio.ensure_future(engine.embed([[1, 30], [1, 31]], caller="b"))
        c = asyncio.ensure_future(engine.embed([[1, 40]], caller="c"))
        await asyncio.sleep(0.05)
        gate.set()
        return await asyncio.gather(first, a, b, c)

    try:
        out = asyncio.run(main())
    finally:
        engine.stop()
    assert [len(v) for v in out] == [1, 6, 2, 1]
    second = model.passes[1]
    assert [ids[1] for ids in second] == [10, 30, 40, 11], "a's, b's, c's, then a's again: one each in turn"
    assert [ids[1] for ids in model.passes[2]] == [31, 12, 13, 14]
    np.testing.assert_allclose(out[2][1], FakeEmbedder.vector_of([1, 31], 4))


def test_pairs_past_the_bound_are_a_400_naming_the_field():
    with server(0, SecurityConfig()) as url:
        many = [f"d{i}" for i in range(MAX_PAIRS + 1)]
        r = httpx.post(url + "/v1/score", json={"model": RERANK, "text_1": many, "text_2": many}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == "text_2"
        r = httpx.post(url + "/v2/rerank", json={"model": RERANK, "query": "q", "documents": many}, timeout=30)
        assert r.status_code == 400 and "documents" in r.json()["message"]
        ok = [f"d{i}" for i in range(MAX_PAIRS)]
        assert httpx.post(url + "/v1/score", json={"model": RERANK, "text_1": ok, "text_2": ok},
                          timeout=60).status_code == 200
