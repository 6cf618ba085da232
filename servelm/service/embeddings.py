"""POST /v1/embeddings: protocol request in → token ids per input → vectors → protocol response out."""

from __future__ import annotations

import base64
import uuid
from dataclasses import dataclass
from typing import cast

import numpy as np

from servelm.engine.base import Embedder
from servelm.errors import ContextLengthExceeded, InvalidParameter
from servelm.protocol.embeddings import Embedding, EmbeddingRequest, EmbeddingResponse, EmbeddingUsage
from servelm.service.registry.deployments import Deployments

MAX_INPUTS = 2048  # OpenAI's limit on inputs in one request


@dataclass(frozen=True)
class PreparedEmbedding:
    """A validated request, ready to run: everything that can be a 4xx has been checked."""

    embedder: Embedder
    inputs: list[list[int]]
    model: str
    dimensions: int
    base64: bool


class EmbeddingService:
    def __init__(self, deployments: Deployments) -> None:
        self.deployments = deployments

    def prepare(self, req: EmbeddingRequest, deployment: str | None = None) -> PreparedEmbedding:
        """Validate and tokenize (may take milliseconds: call it off the event loop). `deployment`: the one
        `req.model` was found to name (an endpoint's draw), else req.model's."""
        dep, embedder = self.deployments.embedder(deployment or req.model)
        if embedder.cross_encoder:
            raise InvalidParameter(f"The model `{req.model}` is a reranker: it scores a query against documents "
                                   "(/v1/rerank, /v1/score) and makes no embeddings.", "model",
                                   code="model_not_supported")
        dimensions = embedder.dim if req.dimensions is None else req.dimensions
        if not 1 <= dimensions <= embedder.dim:
            raise InvalidParameter(
                f"Invalid value for 'dimensions': this model's embeddings have {embedder.dim} dimensions; "
                f"ask for 1 to {embedder.dim}.", "dimensions",
            )
        tokenized = _tokenize(req, embedder)
        one = isinstance(req.input, str) or isinstance(req.input[0], int)  # errors name `input`, else `input[i]`
        inputs = [_check_tokens(ids, "input" if one else f"input[{i}]", embedder) for i, ids in enumerate(tokenized)]
        return PreparedEmbedding(embedder, inputs, dep.name, dimensions, req.encoding_format == "base64")

    async def run(self, p: PreparedEmbedding, caller: str = "") -> EmbeddingResponse:
        vectors = await p.embedder.embed(p.inputs, caller)
        return respond(p, vectors)


def _tokenize(req: EmbeddingRequest, embedder: Embedder) -> list[list[int]]:
    """Every input as token ids. Texts get the instruction in front and the model's special tokens;
    token ids are used as given."""
    raw: list[str] | list[int] | list[list[int]] = [req.input] if isinstance(req.input, str) else req.input
    if not raw:
        raise InvalidParameter("'input' must not be empty.", "input", code="invalid_value")
    if len(raw) > MAX_INPUTS:
        raise InvalidParameter(f"'input' may hold at most {MAX_INPUTS} inputs, not {len(raw)}.", "input")
    if isinstance(raw[0], int):  # one input as token ids (the wire type allows no mixing)
        return [[t for t in raw if isinstance(t, int)]]
    out: list[list[int]] = []
    for i, item in enumerate(cast(list[str | list[int]], raw)):  # not one list of ids: texts, or lists of ids
        if isinstance(item, list):
            out.append(item)
            continue
        if item == "":
            where = "input" if isinstance(req.input, str) else f"input[{i}]"
            raise InvalidParameter(f"'{where}' is an empty string; every input must have text.", "input")
        out.append(embedder.tokenize(_instructed(req.instruction, item)))
    return out


def _instructed(instruction: str | None, text: str) -> str:
    if not instruction:
        return text
    return instruction + text if instruction[-1].isspace() else f"{instruction} {text}"


def _check_tokens(ids: list[int], where: str, embedder: Embedder) -> list[int]:
    if not ids:
        raise InvalidParameter(f"'{where}' is empty; every input must have at least one token.", "input")
    if len(ids) > embedder.context_window:
        raise ContextLengthExceeded(
            f"This model's maximum context length is {embedder.context_window} tokens, however you requested "
            f"{len(ids)} tokens in '{where}'. Please reduce the length of the input.", param="input",
        )
    low, high = min(ids), max(ids)
    if low < 0 or high >= embedder.vocab_size:
        bad = low if low < 0 else high
        raise InvalidParameter(
            f"Invalid token id {bad} in '{where}': token ids must be between 0 and {embedder.vocab_size - 1}.", "input",
        )
    return ids


def normalized(vectors: np.ndarray, dimensions: int) -> np.ndarray:
    """The first `dimensions` values of every row, scaled to unit length (a zero row stays zero)."""
    v = np.asarray(vectors[:, :dimensions], dtype=np.float32)
    norms = np.linalg.norm(v, axis=1, keepdims=True)
    return v / np.where(norms > 0, norms, 1.0)


def respond(p: PreparedEmbedding, vectors: np.ndarray) -> EmbeddingResponse:
    v = normalized(vectors, p.dimensions)
    if p.base64:
        items = [base64.b64encode(row.astype("<f4").tobytes()).decode("ascii") for row in v]
    else:
        items = v.tolist()
    tokens = sum(len(ids) for ids in p.inputs)
    return EmbeddingResponse(
        id=f"embd-{uuid.uuid4().hex}",
        data=[Embedding(index=i, embedding=item) for i, item in enumerate(items)],
        model=p.model,
        usage=EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens),
    )
