"""Rerank and score end to end (issue 37): all-MiniLM-L6-v2 as a bi-encoder (the server's embedding deployment:
the cosine of the two embeddings) in every dialect, Cohere's through Cohere's own client; and
scripts/make_test_reranker.py's cross-encoder through llama.cpp's rank pooling, given by flag and found in a
models directory."""

from __future__ import annotations

import cohere
import httpx
import numpy as np
import pytest

from tests.fixture_files import reranker_scores, write_fixture

from . import ray_mode
from .conftest import own_server

pytestmark = pytest.mark.e2e

EMBED = "all-minilm-l6-v2"
QUERY = "What is the capital of France?"
DOCS = ["Bananas are a yellow fruit rich in potassium.", "Paris is the capital and largest city of France.",
        "The stock market fell sharply today.", "France is a country in Western Europe."]


def post(base_url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(base_url + path, json=body, timeout=60)


@pytest.mark.parametrize("path", ["/v1/rerank", "/rerank"])
def test_the_obviously_relevant_document_ranks_first(base_url, path):
    r = post(base_url, path, {"model": EMBED, "query": QUERY, "documents": DOCS})
    assert r.status_code == 200, r.text
    body = r.json()
    assert [x["index"] for x in body["results"]][:2] == [1, 3], body
    scores = [x["relevance_score"] for x in body["results"]]
    assert scores == sorted(scores, reverse=True) and all(-1 <= s <= 1 for s in scores)
    assert body["results"][0]["document"] == {"text": DOCS[1]}
    assert body["usage"]["total_tokens"] > 0 and body["model"] == EMBED
    top = post(base_url, path, {"model": EMBED, "query": QUERY, "documents": DOCS, "top_n": 1,
                                "return_documents": False}).json()
    assert top["results"] == [{"index": 1, "relevance_score": pytest.approx(scores[0], abs=1e-5)}]


def test_the_score_is_the_cosine_of_the_embeddings(base_url):
    vectors = post(base_url, "/v1/embeddings", {"model": EMBED, "input": [QUERY, DOCS[1]]}).json()["data"]
    u, v = (np.array(d["embedding"]) for d in vectors)
    score = post(base_url, "/v1/score", {"model": EMBED, "text_1": QUERY, "text_2": DOCS[1]}).json()
    assert score["data"][0]["score"] == pytest.approx(float(u @ v), abs=1e-4)
    many = post(base_url, "/v1/score", {"model": EMBED, "text_1": QUERY, "text_2": DOCS}).json()
    assert [d["index"] for d in many["data"]] == [0, 1, 2, 3]
    assert max(range(4), key=lambda i: many["data"][i]["score"]) == 1


def test_cohere_and_ovms_shapes(base_url):
    with cohere.ClientV2(api_key="none", base_url=base_url) as client:  # its connection closed at the end
        r = client.rerank(model=EMBED, query=QUERY, documents=DOCS, top_n=2)
    assert [x.index for x in r.results] == [1, 3]
    ovms = post(base_url, "/v3/rerank", {"model": EMBED, "query": QUERY, "documents": DOCS}).json()
    assert [x["index"] for x in ovms["results"]][:2] == [1, 3] and "document" not in ovms["results"][0]
    bad = post(base_url, "/v3/rerank", {"model": EMBED, "query": QUERY, "documents": []})
    assert bad.status_code == 400 and isinstance(bad.json()["error"], str)


@pytest.fixture(scope="module")
def reranker(tmp_path_factory):
    return write_fixture("make_test_reranker.py", tmp_path_factory.mktemp("reranker") / "tiny-reranker.gguf")


@pytest.mark.skipif(ray_mode.ENABLED, reason="under --ray: tests/ray/test_runtime_models.py")
def test_a_reranker_through_rank_pooling(reranker, tmp_path_factory):
    expected = reranker_scores(reranker, [(QUERY, d) for d in DOCS])
    assert len(set(expected)) == len(DOCS), "the fixture's scores tell the documents apart"
    with own_server(tmp_path_factory, "--rerank-model-path", str(reranker), "--no-embedding-model") as srv:
        body = post(srv.base_url, "/v1/rerank", {"query": QUERY, "documents": DOCS}).json()
        assert body["model"] == "tiny-reranker"
        order = sorted(range(len(DOCS)), key=lambda i: -expected[i])
        assert [x["index"] for x in body["results"]] == order
        for x in body["results"]:  # read beside the other pairs: the same up to the kernels' batch rounding
            assert x["relevance_score"] == pytest.approx(expected[x["index"]], rel=1e-3)
        score = post(srv.base_url, "/v1/score", {"model": "tiny-reranker", "text_1": [QUERY, QUERY],
                                                  "text_2": DOCS[:2]}).json()
        assert [d["score"] for d in score["data"]] == pytest.approx(expected[:2], rel=1e-3)
        r = post(srv.base_url, "/v1/embeddings", {"model": "tiny-reranker", "input": "x"})
        assert r.status_code == 400
        ids = [m["id"] for m in httpx.get(srv.base_url + "/v1/models").json()["data"]]
        assert "tiny-reranker" in ids


@pytest.mark.skipif(ray_mode.ENABLED, reason="under --ray: tests/ray/test_runtime_models.py")
def test_a_reranker_in_a_models_directory_loads_on_demand(reranker, tmp_path_factory):
    directory = tmp_path_factory.mktemp("models")
    (directory / "ranker.gguf").symlink_to(reranker)
    with own_server(tmp_path_factory, "--models-dir", str(directory), "--no-embedding-model") as srv:
        r = post(srv.base_url, "/v2/rerank", {"model": "ranker", "query": QUERY, "documents": DOCS})
        assert r.status_code == 200, r.text
        expected = reranker_scores(reranker, [(QUERY, d) for d in DOCS])
        assert [x["index"] for x in r.json()["results"]] == sorted(range(len(DOCS)), key=lambda i: -expected[i])
