"""Rerank and score wire shapes: vLLM's and Jina's `/v1/rerank` (also `/rerank`), Cohere's v2 `/v2/rerank`,
OpenVINO Model Server's `/v3/rerank` (Cohere's shape with `return_documents`) and vLLM's `/v1/score`."""

from __future__ import annotations

from pydantic import Field

from servelm.protocol.common import KeepAlive, PositiveCount, ResponseModel, WireModel

TopN = PositiveCount


class RerankDocument(WireModel):
    text: str


class RerankRequest(WireModel):
    """vLLM's and Jina's: documents as strings or `{"text"}` objects; the documents come back unless told not."""

    model: str | None = None  # the server's only reranking deployment when left out
    query: str
    documents: list[str | RerankDocument]
    top_n: TopN | None = None
    return_documents: bool = True
    keep_alive: KeepAlive | None = None  # Ollama's: how long a model loaded on demand stays loaded
    user: str | None = None


class CohereRerankRequest(WireModel):
    """Cohere's v2: documents as strings; `max_tokens_per_doc` bounds each document."""

    model: str | None = None
    query: str
    documents: list[str]
    top_n: TopN | None = None
    max_tokens_per_doc: PositiveCount | None = None


class OvmsRerankRequest(WireModel):
    """OpenVINO Model Server's: Cohere's, documents as strings, and `return_documents` (default false)."""

    model: str | None = None
    query: str
    documents: list[str]
    top_n: TopN | None = None
    return_documents: bool = False


class ScoreRequest(WireModel):
    """vLLM's /v1/score: `text_1` against `text_2`, each a string or a list (1:1, 1:N, or N:N paired in order)."""

    model: str | None = None
    text_1: str | list[str]
    text_2: str | list[str]
    keep_alive: KeepAlive | None = None
    user: str | None = None


class RerankResult(ResponseModel):
    index: int
    relevance_score: float
    document: RerankDocument | None = None


class RerankUsage(ResponseModel):
    prompt_tokens: int
    total_tokens: int


class RerankResponse(ResponseModel):
    id: str
    object: str = "list"
    model: str
    usage: RerankUsage
    results: list[RerankResult]


class CohereApiVersion(ResponseModel):
    version: str = "2"


class CohereBilledUnits(ResponseModel):
    search_units: int = 1


class CohereMeta(ResponseModel):
    api_version: CohereApiVersion = Field(default_factory=CohereApiVersion)
    billed_units: CohereBilledUnits = Field(default_factory=CohereBilledUnits)


class CohereRerankResponse(ResponseModel):
    id: str
    results: list[RerankResult]
    meta: CohereMeta = Field(default_factory=CohereMeta)


class OvmsRerankResponse(ResponseModel):
    results: list[RerankResult]


class ScoreData(ResponseModel):
    index: int
    object: str = "score"
    score: float


class ScoreResponse(ResponseModel):
    id: str
    object: str = "list"
    created: int
    model: str
    data: list[ScoreData]
    usage: RerankUsage
