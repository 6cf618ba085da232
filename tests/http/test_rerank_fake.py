"""Rerank and score over fake models (a real uvicorn server): vLLM's and Jina's /v1/rerank and /rerank, Cohere's
/v2/rerank through Cohere's own client, OpenVINO Model Server's /v3/rerank and vLLM's /v1/score, on a reranker (a
cross-encoder) and on an embedding model (the cosine); usage, limits and each dialect's error shape."""

from __future__ import annotations

import math

import cohere
import httpx
import numpy as np
import pytest

from servelm.compose import build_deployment, build_embedding_deployment
from servelm.engine.embedding import EmbeddingEngine
from servelm.http.app import create_app
from servelm.runners.fake import FakeEmbedder, FakeRunner
from servelm.service.registry.deployments import Deployments
from servelm.service.rerank import MAX_PAIRS
from tests.conftest import serving

RERANK, EMBED, CHAT = "fake-rerank", "fake-embed", "fake-model"
QUERY = "cats sit"
DOCS = ["dogs run far", "a cat dog", "zzz", "cats sit"]


@pytest.fixture(scope="module")
def base_url():
    chat_embedder = EmbeddingEngine(FakeEmbedder(dim=8))
    chat, engine = build_deployment(CHAT, FakeRunner(), embedder=chat_embedder)
    embed, embedder = build_embedding_deployment(EMBED, FakeEmbedder(dim=16, context_window=32, max_batch_tokens=64))
    rerank, reranker = build_embedding_deployment(RERANK, FakeEmbedder(cross_encoder=True, context_window=24,
                                                                       max_batch_tokens=64))
    workers = [engine, chat_embedder, embedder, reranker]
    app = create_app(Deployments([chat, embed, rerank]), on_start=lambda: [w.start() for w in workers],
                     on_stop=lambda: [w.stop() for w in workers])
    with serving(app) as url:
        yield url


def post(base_url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(base_url + path, json=body, timeout=10)


def cross_score(query: str, doc: str) -> float:
    model = FakeEmbedder(cross_encoder=True)
    return 1 / (1 + math.exp(-model.score_of(model.tokenize_pair(query, doc))))


def cosine(a: str, b: str) -> float:
    model = FakeEmbedder(dim=16)
    u, v = (model.vector_of(model.tokenize(t), 16).astype(np.float64) for t in (a, b))
    return float(u @ v / np.linalg.norm(u) / np.linalg.norm(v))


def expected_order(scores: list[float]) -> list[int]:
    return sorted(range(len(scores)), key=lambda i: (-scores[i], i))


@pytest.mark.parametrize("path", ["/v1/rerank", "/rerank"])
def test_a_reranker_scores_each_pair_read_together_highest_first(base_url, path):
    r = post(base_url, path, {"model": RERANK, "query": QUERY, "documents": [DOCS[0], {"text": DOCS[1]}, *DOCS[2:]]})
    assert r.status_code == 200, r.text
    body = r.json()
    scores = [cross_score(QUERY, d) for d in DOCS]
    assert [x["index"] for x in body["results"]] == expected_order(scores)
    assert body["results"][0]["index"] == 3 and body["results"][0]["document"] == {"text": "cats sit"}
    for x in body["results"]:
        assert x["relevance_score"] == pytest.approx(scores[x["index"]], rel=1e-6)
        assert x["document"]["text"] == DOCS[x["index"]]
    model = FakeEmbedder(cross_encoder=True)
    tokens = sum(len(model.tokenize_pair(QUERY, d)) for d in DOCS)
    assert body["model"] == RERANK and body["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}
    assert r.headers["x-servelm-deployment"] == RERANK


def test_top_n_and_return_documents(base_url):
    body = post(base_url, "/v1/rerank", {"model": RERANK, "query": QUERY, "documents": DOCS, "top_n": 2,
                                         "return_documents": False}).json()
    assert [x["index"] for x in body["results"]] == expected_order([cross_score(QUERY, d) for d in DOCS])[:2]
    assert all("document" not in x for x in body["results"])


def test_an_embedding_model_scores_by_cosine(base_url):
    body = post(base_url, "/v1/rerank", {"model": EMBED, "query": QUERY, "documents": DOCS}).json()
    scores = [cosine(QUERY, d) for d in DOCS]
    assert [x["index"] for x in body["results"]] == expected_order(scores)
    for x in body["results"]:
        assert x["relevance_score"] == pytest.approx(scores[x["index"]], rel=1e-5)
    model = FakeEmbedder()
    distinct = {QUERY, *DOCS}  # each text embedded once (the query is also a document here)
    assert body["usage"]["prompt_tokens"] == sum(len(model.tokenize(t)) for t in distinct)


def test_without_a_model_the_reranker_answers(base_url):
    body = post(base_url, "/v1/rerank", {"query": QUERY, "documents": DOCS}).json()
    assert body["model"] == RERANK


def test_cohere_v2_through_cohere_client(base_url):
    with cohere.ClientV2(api_key="none", base_url=base_url) as client:  # its connection closed at the end
        r = client.rerank(model=RERANK, query=QUERY, documents=DOCS, top_n=3)
    scores = [cross_score(QUERY, d) for d in DOCS]
    assert [x.index for x in r.results] == expected_order(scores)[:3]
    assert [x.relevance_score for x in r.results] == pytest.approx([scores[x.index] for x in r.results], rel=1e-6)
    assert r.id and r.meta is not None and r.meta.api_version.version == "2"


def test_ovms_v3_shape(base_url):
    body = post(base_url, "/v3/rerank", {"model": EMBED, "query": QUERY, "documents": DOCS}).json()
    assert set(body) == {"results"} and all(set(x) == {"index", "relevance_score"} for x in body["results"])
    with_docs = post(base_url, "/v3/rerank", {"model": EMBED, "query": QUERY, "documents": DOCS,
                                              "return_documents": True}).json()
    assert with_docs["results"][0]["document"]["text"] == DOCS[with_docs["results"][0]["index"]]


def test_score_pairs_one_to_one_one_to_many_and_many_to_many(base_url):
    one = post(base_url, "/v1/score", {"model": RERANK, "text_1": QUERY, "text_2": DOCS[1]}).json()
    assert one["object"] == "list" and one["data"] == [{"index": 0, "object": "score",
                                                        "score": pytest.approx(cross_score(QUERY, DOCS[1]), rel=1e-6)}]
    many = post(base_url, "/v1/score", {"model": RERANK, "text_1": QUERY, "text_2": DOCS}).json()
    assert [d["score"] for d in many["data"]] == pytest.approx([cross_score(QUERY, d) for d in DOCS], rel=1e-6)
    pairs = post(base_url, "/v1/score", {"model": EMBED, "text_1": DOCS[:2], "text_2": DOCS[2:]}).json()
    assert [d["score"] for d in pairs["data"]] == pytest.approx([cosine(DOCS[0], DOCS[2]), cosine(DOCS[1], DOCS[3])],
                                                               rel=1e-5)
    bad = post(base_url, "/v1/score", {"model": EMBED, "text_1": DOCS[:2], "text_2": DOCS[:3]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "text_1"


def test_limits_are_clear_4xx_in_each_dialects_shape(base_url):
    too_long = "x" * 40  # past the reranker's 24-token window once paired
    r = post(base_url, "/v1/rerank", {"model": RERANK, "query": QUERY, "documents": ["ok", too_long]})
    assert r.status_code == 400 and "'documents[1]'" in r.json()["error"]["message"]
    assert r.json()["error"]["param"] == "documents"
    many = post(base_url, "/v1/rerank", {"model": EMBED, "query": "q", "documents": ["d"] * (MAX_PAIRS + 1)})
    assert many.status_code == 400 and many.json()["error"]["param"] == "documents"
    empty = post(base_url, "/v1/rerank", {"model": EMBED, "query": "q", "documents": []})
    assert empty.status_code == 400
    cut = post(base_url, "/v2/rerank", {"model": EMBED, "query": "q", "documents": ["short", "a longer one"],
                                        "max_tokens_per_doc": 8})
    assert cut.status_code == 400 and "max_tokens_per_doc" in cut.json()["message"] and set(cut.json()) == {"message"}
    fits = post(base_url, "/v2/rerank", {"model": EMBED, "query": "q", "documents": ["short"], "max_tokens_per_doc": 8})
    assert fits.status_code == 200
    unknown = post(base_url, "/v2/rerank", {"model": "nope", "query": "q", "documents": ["d"]})
    assert unknown.status_code == 404 and set(unknown.json()) == {"message"}
    ovms = post(base_url, "/v3/rerank", {"model": "nope", "query": "q", "documents": ["d"]})
    assert ovms.status_code == 404 and isinstance(ovms.json()["error"], str)
    assert post(base_url, "/v3/rerank", {"model": EMBED, "query": "q", "documents": [{"text": "d"}]}).status_code == 400
    v1 = post(base_url, "/v1/rerank", {"model": "nope", "query": "q", "documents": ["d"]})
    assert v1.status_code == 404 and v1.json()["error"]["code"] == "model_not_found"
    no_embedder = post(base_url, "/v1/score", {"model": CHAT, "text_1": "a", "text_2": "b"})
    assert no_embedder.status_code == 200, "a chat model with an embedding window scores by cosine"


def test_a_reranker_makes_no_embeddings(base_url):
    r = post(base_url, "/v1/embeddings", {"model": RERANK, "input": "hello"})
    assert r.status_code == 400 and "reranker" in r.json()["error"]["message"]


def test_pairs_scored_are_counted_by_kind(base_url):
    def counted(kind: str, model: str) -> float:
        text = httpx.get(base_url + "/metrics").text
        line = f'servelm_rerank_pairs_total{{kind="{kind}",model="{model}"}} '
        return next((float(x.split()[-1]) for x in text.splitlines() if x.startswith(line)), 0.0)

    before = counted("cross_encoder", RERANK), counted("cosine", EMBED)
    post(base_url, "/v1/rerank", {"model": RERANK, "query": QUERY, "documents": DOCS})
    post(base_url, "/v1/score", {"model": EMBED, "text_1": QUERY, "text_2": DOCS[:2]})
    assert (counted("cross_encoder", RERANK), counted("cosine", EMBED)) == (before[0] + 4, before[1] + 2)
