"""Rerank and score without HTTP: each API's request read into one ScoreQuery, ScoreService's checks of it on a fake
reranker, and each API's answer shaped from the scores (ranked highest first, ties to the earlier document, top_n,
the documents when asked, usage)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from servelm.compose import build_embedding_deployment
from servelm.errors import InvalidParameter
from servelm.protocol.rerank import CohereRerankRequest, OvmsRerankRequest, RerankRequest, ScoreRequest
from servelm.runners.fake import FakeEmbedder
from servelm.service.registry.deployments import Deployments
from servelm.service.rerank import (
    PreparedScores,
    ScoreQuery,
    ScoreService,
    cohere_answer,
    jina_answer,
    ovms_answer,
    rerank_query,
    score_answer,
    score_query,
)

DOCS = ["dogs", "a cat", "zzz", "cats"]
SCORES = [0.25, 0.75, 0.25, 0.5]  # ranked: 1, 3, then the tie 0 before 2


@pytest.fixture
def service() -> Iterator[ScoreService]:
    deployment, engine = build_embedding_deployment("rerank", FakeEmbedder(cross_encoder=True, context_window=24))
    engine.start()
    try:
        yield ScoreService(Deployments([deployment]))
    finally:
        engine.stop()


@pytest.fixture
def prepared(service: ScoreService) -> PreparedScores:
    return service.prepare(None, ScoreQuery(None, ["cats"], DOCS))


def test_each_apis_request_becomes_one_query():
    jina = rerank_query(RerankRequest.model_validate({"query": "q", "documents": ["a", {"text": "b"}]}))
    assert jina == ScoreQuery(None, ["q"], ["a", "b"], "query", "documents", None)
    cohere = rerank_query(CohereRerankRequest(model="m", query="q", documents=["a"], max_tokens_per_doc=5))
    assert cohere == ScoreQuery("m", ["q"], ["a"], max_right_tokens=5)
    assert rerank_query(OvmsRerankRequest(query="q", documents=["a"])).max_right_tokens is None
    assert score_query(ScoreRequest(text_1="q", text_2=["a", "b"])) == ScoreQuery(None, ["q"], ["a", "b"], "text_1",
                                                                                    "text_2")
    assert score_query(ScoreRequest(text_1=["p", "q"], text_2=["a", "b"])).left == ["p", "q"]


def test_the_query_is_checked_with_the_fields_it_names(service: ScoreService):
    prepared = service.prepare(None, ScoreQuery(None, ["cats"], DOCS))
    assert prepared.model == "rerank" and len(prepared.pairs) == len(DOCS)
    with pytest.raises(InvalidParameter) as bound:
        service.prepare(None, ScoreQuery(None, ["q"], ["short", "far too long"], max_right_tokens=6))
    assert bound.value.param == "max_tokens_per_doc" and "'documents[1]' is longer than max_tokens_per_doc (6" \
        in bound.value.message
    with pytest.raises(InvalidParameter) as uneven:
        service.prepare(None, score_query(ScoreRequest(text_1=["p", "q"], text_2=["a", "b", "c"])))
    assert uneven.value.param == "text_1"


def test_jinas_answer_ranks_and_returns_the_documents(prepared: PreparedScores):
    req = RerankRequest.model_validate({"query": "cats", "documents": [DOCS[0], {"text": DOCS[1]}, *DOCS[2:]],
                                        "top_n": 3})
    body = jina_answer(req, prepared, SCORES).model_dump(mode="json", exclude_none=True)
    assert body["id"].startswith("rerank-") and body["object"] == "list" and body["model"] == "rerank"
    assert body["results"] == [{"index": 1, "relevance_score": 0.75, "document": {"text": "a cat"}},
                               {"index": 3, "relevance_score": 0.5, "document": {"text": "cats"}},
                               {"index": 0, "relevance_score": 0.25, "document": {"text": "dogs"}}]
    assert body["usage"] == {"prompt_tokens": prepared.tokens, "total_tokens": prepared.tokens}
    bare = jina_answer(req.model_copy(update={"return_documents": False, "top_n": None}), prepared, SCORES)
    assert [(r.index, r.document) for r in bare.results] == [(1, None), (3, None), (0, None), (2, None)]


def test_cohere_and_ovms_answers(prepared: PreparedScores):
    cohere = cohere_answer(CohereRerankRequest(query="cats", documents=DOCS, top_n=2), prepared, SCORES)
    body = cohere.model_dump(mode="json", exclude_none=True)
    assert body["results"] == [{"index": 1, "relevance_score": 0.75}, {"index": 3, "relevance_score": 0.5}]
    assert body["meta"] == {"api_version": {"version": "2"}, "billed_units": {"search_units": 1}}
    assert body["id"].startswith("rerank-")
    ovms = ovms_answer(OvmsRerankRequest(query="cats", documents=DOCS, top_n=1), prepared, SCORES)
    assert ovms.model_dump(mode="json", exclude_none=True) == {"results": [{"index": 1, "relevance_score": 0.75}]}
    shown = ovms_answer(OvmsRerankRequest(query="cats", documents=DOCS, top_n=1, return_documents=True), prepared,
                        SCORES)
    assert shown.results[0].document is not None and shown.results[0].document.text == "a cat"


def test_scores_answer_in_the_pairs_order(prepared: PreparedScores):
    body = score_answer(ScoreRequest(text_1="cats", text_2=DOCS), prepared, SCORES).model_dump(mode="json")
    assert body["id"].startswith("score-") and body["model"] == "rerank" and body["created"] > 0
    assert body["data"] == [{"index": i, "object": "score", "score": s} for i, s in enumerate(SCORES)]
    assert body["usage"]["prompt_tokens"] == prepared.tokens
