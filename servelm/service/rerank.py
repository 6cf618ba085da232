"""Rerank and score: how relevant each document is to a query (or each `text_2` to its `text_1`).

Two kinds of model answer it:
- a reranker (a cross-encoder, llama.cpp's rank pooling): each query-document pair is one input, read together;
  its score is the classification head's, through a sigmoid when the head has one output (as vLLM and
  sentence-transformers' CrossEncoder give a one-label reranker's score);
- any other embedding model (a bi-encoder): the cosine of the query's and the document's embeddings, as vLLM scores
  with an embedding model. Each distinct text is embedded once.

Both run through the deployment's embedding engine, so their inputs share forward passes with other requests'.

Each API's request is read into one ScoreQuery (what is paired with what, and the fields a 400 names), and its
answer is shaped from the scores by its own function: vLLM's and Jina's rerank, Cohere's, OpenVINO Model Server's,
and vLLM's score.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

import numpy as np

from servelm.engine.base import Embedder
from servelm.errors import ContextLengthExceeded, InvalidParameter
from servelm.protocol.rerank import (
    CohereRerankRequest,
    CohereRerankResponse,
    OvmsRerankRequest,
    OvmsRerankResponse,
    RerankDocument,
    RerankRequest,
    RerankResponse,
    RerankResult,
    RerankUsage,
    ScoreData,
    ScoreRequest,
    ScoreResponse,
)
from servelm.service.registry.deployments import Deployments, TextDeployment

MAX_PAIRS = 1024  # query-document pairs in one request (Cohere's recommended most documents is 1,000): docs/api.md


@dataclass(frozen=True)
class PreparedScores:
    """A validated request: the texts as the model's inputs, and which inputs each pair's score reads."""

    model: str
    embedder: Embedder
    inputs: list[list[int]]
    pairs: list[tuple[int, int]]  # cross-encoder: (input, input); bi-encoder: (query input, document input)

    @property
    def tokens(self) -> int:
        return sum(len(ids) for ids in self.inputs)


@dataclass(frozen=True)
class ScoreQuery:
    """What a rerank or score request pairs: left[i] with right[i], or its one left text with every right one;
    the request fields a 400 names, and the most tokens a right text may take (None: no bound)."""

    model: str | None
    left: list[str]
    right: list[str]
    left_param: str = "query"
    right_param: str = "documents"
    max_right_tokens: int | None = None  # Cohere's max_tokens_per_doc


class ScoreService:
    def __init__(self, deployments: Deployments) -> None:
        self.deployments = deployments

    def default_model(self) -> str:
        """The deployment a request without `model` scores with: the first reranker, else the first embedding-only
        model."""
        rerankers = [d.name for d in self.deployments.all() if d.embedder is not None and d.embedder.cross_encoder]
        plain = [d.name for d in self.deployments.all() if d.embedder is not None and not isinstance(d, TextDeployment)]
        if not rerankers and not plain:
            raise InvalidParameter("Name the model to score with (`model`): this server has no reranker or "
                                   "embedding model of its own.", "model")
        return (rerankers or plain)[0]

    def prepare(self, model: str | None, q: ScoreQuery) -> PreparedScores:
        """The query's pairs, scored by `model` (None: the default). Tokenizes (call it off the event loop); a 400
        names the field at fault."""
        left, right, left_param, right_param = q.left, q.right, q.left_param, q.right_param
        name = model or self.default_model()
        dep, embedder = self.deployments.embedder(name)
        if not right:
            raise InvalidParameter(f"'{right_param}' must hold at least one text.", right_param)
        if len(left) not in (1, len(right)):
            raise InvalidParameter(f"'{left_param}' has {len(left)} texts and '{right_param}' {len(right)}: give one "
                                   f"'{left_param}' or as many as '{right_param}'.", left_param)
        if len(right) > MAX_PAIRS:
            raise InvalidParameter(f"'{right_param}' may hold at most {MAX_PAIRS} texts, not {len(right)}.", right_param)
        for i, text in enumerate(right):
            if q.max_right_tokens is not None and len(embedder.tokenize(text)) > q.max_right_tokens:
                raise InvalidParameter(
                    f"'{right_param}[{i}]' is longer than max_tokens_per_doc ({q.max_right_tokens} tokens); this "
                    "server does not cut documents: shorten it or raise the bound.", "max_tokens_per_doc")
        lefts = left * len(right) if len(left) == 1 else left
        if embedder.cross_encoder:
            wheres = [left_param if len(left) == 1 else f"{left_param}[{i}]" for i in range(len(lefts))]
            inputs = [_fits_pair(embedder, q, d, wheres[i], f"{right_param}[{i}]")
                      for i, (q, d) in enumerate(zip(lefts, right, strict=True))]
            return PreparedScores(dep.name, embedder, inputs, [(i, i) for i in range(len(inputs))])
        texts: dict[str, int] = {}
        inputs = []
        for where, text in [(left_param if len(left) == 1 else f"{left_param}[{i}]", t) for i, t in enumerate(left)] + \
                [(f"{right_param}[{i}]", t) for i, t in enumerate(right)]:
            if text not in texts:
                texts[text] = len(inputs)
                inputs.append(_fits(embedder.tokenize(text), where, embedder))
        return PreparedScores(dep.name, embedder, inputs, [(texts[q], texts[d]) for q, d in zip(lefts, right, strict=True)])

    async def run(self, p: PreparedScores, caller: str = "") -> list[float]:
        """One score per pair, in order; its inputs take `caller`'s turns in the embedding engine's passes."""
        rows = await p.embedder.embed(p.inputs, caller)
        if p.embedder.cross_encoder:
            logits = np.asarray(rows[:, 0], dtype=np.float64)
            scores = 1.0 / (1.0 + np.exp(-logits)) if p.embedder.dim == 1 else logits
            return [float(scores[i]) for i, _ in p.pairs]
        v = np.asarray(rows, dtype=np.float64)
        norms = np.linalg.norm(v, axis=1)
        v = v / np.where(norms > 0, norms, 1.0)[:, None]
        return [float(v[q] @ v[d]) for q, d in p.pairs]


def ranked(scores: list[float], top_n: int | None) -> list[tuple[int, float]]:
    """(index, score), the highest score first (ties: the earlier document first), the first `top_n`."""
    order = sorted(range(len(scores)), key=lambda i: (-scores[i], i))
    return [(i, scores[i]) for i in order[:top_n]]


# -- each API's request and answer ---------------------------------------------------------------------------------


def rerank_query(req: RerankRequest | CohereRerankRequest | OvmsRerankRequest) -> ScoreQuery:
    """A rerank request (any API's): its query against each document; Cohere's bounds each document's tokens."""
    documents = [d if isinstance(d, str) else d.text for d in req.documents]
    bound = req.max_tokens_per_doc if isinstance(req, CohereRerankRequest) else None
    return ScoreQuery(req.model, [req.query], documents, max_right_tokens=bound)


def score_query(req: ScoreRequest) -> ScoreQuery:
    """vLLM's score: text_1 against text_2, each a text or a list."""
    left = [req.text_1] if isinstance(req.text_1, str) else req.text_1
    right = [req.text_2] if isinstance(req.text_2, str) else req.text_2
    return ScoreQuery(req.model, left, right, "text_1", "text_2")


def rerank_results(texts: list[str], scores: list[float], top_n: int | None, documents: bool) -> list[RerankResult]:
    """The documents ranked (ranked()), each with its text when `documents`."""
    return [RerankResult(index=i, relevance_score=s, document=RerankDocument(text=texts[i]) if documents else None)
            for i, s in ranked(scores, top_n)]


def usage(p: PreparedScores) -> RerankUsage:
    return RerankUsage(prompt_tokens=p.tokens, total_tokens=p.tokens)


def jina_answer(req: RerankRequest, p: PreparedScores, scores: list[float]) -> RerankResponse:
    """vLLM's and Jina's answer: the documents come back unless `return_documents` is false."""
    results = rerank_results(rerank_query(req).right, scores, req.top_n, req.return_documents)
    return RerankResponse(id=new_id("rerank"), model=p.model, results=results, usage=usage(p))


def cohere_answer(req: CohereRerankRequest, _: PreparedScores, scores: list[float]) -> CohereRerankResponse:
    """Cohere's v2 answer: indices and scores only."""
    return CohereRerankResponse(id=new_id("rerank"), results=rerank_results(req.documents, scores, req.top_n, False))


def ovms_answer(req: OvmsRerankRequest, _: PreparedScores, scores: list[float]) -> OvmsRerankResponse:
    """OpenVINO Model Server's answer: Cohere's results, the documents when `return_documents`."""
    return OvmsRerankResponse(results=rerank_results(req.documents, scores, req.top_n, req.return_documents))


def score_answer(_: ScoreRequest, p: PreparedScores, scores: list[float]) -> ScoreResponse:
    """vLLM's score answer: one score per pair, in order."""
    return ScoreResponse(id=new_id("score"), created=int(time.time()), model=p.model,
                         data=[ScoreData(index=i, score=s) for i, s in enumerate(scores)], usage=usage(p))


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def _fits_pair(embedder: Embedder, left: str, right: str, left_where: str, right_where: str) -> list[int]:
    """A cross-encoder's pair, within the context; too long, it is the left text's fault when that alone is (only
    then is it tokenized alone)."""
    ids = embedder.tokenize_pair(left, right)
    if len(ids) > embedder.context_window:
        _fits(embedder.tokenize(left), left_where, embedder)
    return _fits(ids, right_where, embedder)


def _fits(ids: list[int], where: str, embedder: Embedder) -> list[int]:
    if not ids:
        raise InvalidParameter(f"'{where}' is empty; every text must have at least one token.", where.split("[")[0])
    if len(ids) > embedder.context_window:
        raise ContextLengthExceeded(
            f"This model's maximum context length is {embedder.context_window} tokens, however '{where}' takes "
            f"{len(ids)} tokens. Please shorten it.", param=where.split("[")[0])
    return ids
