"""Rerank and score: how relevant each document is to a query (or each `text_2` to its `text_1`).

Two kinds of model answer it:
- a reranker (a cross-encoder, llama.cpp's rank pooling): each query-document pair is one input, read together;
  its score is the classification head's, through a sigmoid when the head has one output (as vLLM and
  sentence-transformers' CrossEncoder give a one-label reranker's score);
- any other embedding model (a bi-encoder): the cosine of the query's and the document's embeddings, as vLLM scores
  with an embedding model. Each distinct text is embedded once.

Both run through the deployment's embedding engine, so their inputs share forward passes with other requests'.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

import numpy as np

from servelm.engine.base import Embedder
from servelm.errors import ContextLengthExceeded, InvalidParameter
from servelm.service.deployments import Deployments, TextDeployment

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

    def prepare(self, model: str | None, left: list[str], right: list[str], *, left_param: str, right_param: str,
                max_right_tokens: int | None = None, max_right_param: str = "") -> PreparedScores:
        """Pairs left[i] with right[i] (one left against every right when left has one text). Tokenizes (call it
        off the event loop); a 400 names the field at fault."""
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
            if max_right_tokens is not None and len(embedder.tokenize(text)) > max_right_tokens:
                raise InvalidParameter(
                    f"'{right_param}[{i}]' is longer than {max_right_param} ({max_right_tokens} tokens); this server "
                    "does not cut documents: shorten it or raise the bound.", max_right_param)
        lefts = left * len(right) if len(left) == 1 else left
        if embedder.cross_encoder:
            inputs = [_fits(embedder.tokenize_pair(q, d), f"{right_param}[{i}]", embedder)
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


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def _fits(ids: list[int], where: str, embedder: Embedder) -> list[int]:
    if not ids:
        raise InvalidParameter(f"'{where}' is empty; every text must have at least one token.", where.split("[")[0])
    if len(ids) > embedder.context_window:
        raise ContextLengthExceeded(
            f"This model's maximum context length is {embedder.context_window} tokens, however '{where}' takes "
            f"{len(ids)} tokens. Please shorten it.", param=where.split("[")[0])
    return ids
