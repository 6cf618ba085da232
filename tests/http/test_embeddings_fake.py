"""POST /v1/embeddings over fake models: a real uvicorn server, the official openai client, and httpx."""

from __future__ import annotations

import base64

import httpx
import numpy as np
import openai
import pytest

from servelm.compose import build_deployment, build_embedding_deployment
from servelm.engine.embedding import EmbeddingEngine
from servelm.errors import InvalidParameter, ModelNotFound
from servelm.http.app import create_app
from servelm.runners.fake import FakeEmbedder, FakeRunner
from servelm.service.registry.deployments import Deployments
from tests.conftest import serving

EMBED = "fake-embed"
CHAT = "fake-model"


class Served:
    def __init__(self, base_url: str, model: FakeEmbedder, chat_model: FakeEmbedder) -> None:
        self.base_url = base_url
        self.model = model
        self.chat_model = chat_model

    def post(self, body: dict) -> httpx.Response:
        return httpx.post(self.base_url + "/v1/embeddings", json=body, timeout=10)

    def vector(self, model: FakeEmbedder, tokens: list[int], dims: int | None = None) -> np.ndarray:
        v = model.vector_of(tokens, model.dim)[:dims]
        return v / np.linalg.norm(v)


@pytest.fixture(scope="module")
def served():
    chat_model = FakeEmbedder(dim=8)
    model = FakeEmbedder(dim=16, context_window=32, max_batch_tokens=64, max_batch_seqs=4)
    chat_embedder = EmbeddingEngine(chat_model)
    chat, engine = build_deployment(CHAT, FakeRunner(), embedder=chat_embedder)
    embed, embedder = build_embedding_deployment(EMBED, model)
    workers = [engine, chat_embedder, embedder]
    app = create_app(Deployments([chat, embed]), on_start=lambda: [w.start() for w in workers],
                     on_stop=lambda: [w.stop() for w in workers])
    with serving(app) as base_url:
        yield Served(base_url, model, chat_model)


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served.base_url + "/v1", api_key="none", max_retries=0)


def tokens(text: str) -> list[int]:
    return FakeEmbedder().tokenize(text)


def test_float_response_has_the_contract_fields(served):
    r = served.post({"model": EMBED, "input": ["hello", "hi"], "encoding_format": "float"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "list" and body["model"] == EMBED
    assert [d["object"] for d in body["data"]] == ["embedding", "embedding"]
    assert [d["index"] for d in body["data"]] == [0, 1]
    for d, text in zip(body["data"], ["hello", "hi"]):
        v = np.array(d["embedding"])
        assert v.shape == (16,) and abs(np.linalg.norm(v) - 1) < 1e-6
        np.testing.assert_allclose(v, served.vector(served.model, tokens(text)), rtol=1e-6)
    n = len(tokens("hello")) + len(tokens("hi"))
    assert body["usage"] == {"prompt_tokens": n, "total_tokens": n}


def test_base64_is_little_endian_float32_of_the_same_vector(served):
    as_float = served.post({"model": EMBED, "input": "hello", "encoding_format": "float"}).json()
    as_b64 = served.post({"model": EMBED, "input": "hello", "encoding_format": "base64"}).json()
    raw = base64.b64decode(as_b64["data"][0]["embedding"])
    np.testing.assert_array_equal(np.frombuffer(raw, dtype="<f4"), np.float32(as_float["data"][0]["embedding"]))


def test_openai_client_decodes_every_input_form(served, client):
    text = client.embeddings.create(model=EMBED, input="hello").data[0].embedding  # the client asks for base64
    texts = client.embeddings.create(model=EMBED, input=["hello", "bye"])
    ids = client.embeddings.create(model=EMBED, input=tokens("hello")).data[0].embedding
    id_lists = client.embeddings.create(model=EMBED, input=[tokens("bye"), tokens("hello")], encoding_format="float")
    np.testing.assert_allclose(text, texts.data[0].embedding)
    np.testing.assert_allclose(text, ids)
    np.testing.assert_allclose(text, id_lists.data[1].embedding, rtol=1e-6)
    np.testing.assert_allclose(texts.data[1].embedding, id_lists.data[0].embedding, rtol=1e-6)
    assert id_lists.usage.prompt_tokens == len(tokens("bye")) + len(tokens("hello"))


def test_dimensions_truncate_and_renormalize(served, client):
    r = client.embeddings.create(model=EMBED, input="hello", dimensions=5)
    v = np.array(r.data[0].embedding)
    assert v.shape == (5,) and abs(np.linalg.norm(v) - 1) < 1e-6
    np.testing.assert_allclose(v, served.vector(served.model, tokens("hello"), 5), rtol=1e-6)
    full = client.embeddings.create(model=EMBED, input="hello", dimensions=16).data[0].embedding
    assert len(full) == 16


def test_instruction_is_prepended_to_texts_only(served):
    plain = served.post({"model": EMBED, "input": "query: hello", "encoding_format": "float"}).json()
    instructed = served.post(
        {"model": EMBED, "input": "hello", "instruction": "query:", "encoding_format": "float"}).json()
    assert instructed["data"][0]["embedding"] == plain["data"][0]["embedding"]
    assert instructed["usage"] == plain["usage"]
    ids = served.post({"model": EMBED, "input": tokens("hello"), "instruction": "query:", "encoding_format": "float"})
    alone = served.post({"model": EMBED, "input": "hello", "encoding_format": "float"})
    assert ids.json()["data"][0]["embedding"] == alone.json()["data"][0]["embedding"]


def test_user_is_accepted(served):
    assert served.post({"model": EMBED, "input": "hello", "user": "someone"}).status_code == 200


def test_the_chat_model_answers_embeddings_too(served):
    r = served.post({"model": CHAT, "input": "hello", "encoding_format": "float"})
    assert r.status_code == 200, r.text
    want = served.vector(served.chat_model, tokens("hello"))
    np.testing.assert_allclose(r.json()["data"][0]["embedding"], want, rtol=1e-6)


def test_models_and_health_list_both(served, client):
    assert sorted(m.id for m in client.models.list()) == [EMBED, CHAT]
    h = httpx.get(served.base_url + "/health").json()
    assert h["status"] == "ok"
    assert h["deployments"][EMBED]["waiting"] == 0 and "inputs" in h["deployments"][EMBED]
    assert h["deployments"][CHAT]["kv_cells_used"] == 0 and h["deployments"][CHAT]["embeddings"]["running"] == 0


BAD = [
    ({"input": []}, "input", "invalid_value"),
    ({"input": ""}, "input", "invalid_value"),
    ({"input": ["hello", ""]}, "input", "invalid_value"),
    ({"input": [[]]}, "input", "invalid_value"),
    ({"input": [1, 64]}, "input", "invalid_value"),
    ({"input": [[1, 2], [-1]]}, "input", "invalid_value"),
    ({"input": "x" * 40}, "input", "context_length_exceeded"),
    ({"input": ["ok", [1, 2]]}, "input", None),
    ({"input": 5}, "input", None),
    ({"input": [1.5]}, "input", None),
    ({"input": "hello", "encoding_format": "hex"}, "encoding_format", "invalid_value"),
    ({"input": "hello", "dimensions": 0}, "dimensions", "invalid_value"),
    ({"input": "hello", "dimensions": 17}, "dimensions", "invalid_value"),
    ({"input": "hello", "normalize": True}, "normalize", "unknown_parameter"),
    ({}, "input", "missing_required_parameter"),
]


@pytest.mark.parametrize("body,param,code", BAD, ids=[f"{p}-{i}" for i, (_, p, _) in enumerate(BAD)])
def test_bad_requests_are_400_naming_the_parameter(served, body, param, code):
    r = served.post({"model": EMBED, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["message"]
    assert err["param"] == param or (err["param"] or "").startswith(param)
    if code is not None:
        assert err["code"] == code


def test_unknown_model_is_404(served):
    r = served.post({"model": "nope", "input": "hello"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_too_long_names_the_input_and_the_limit(served):
    err = served.post({"model": EMBED, "input": ["ok", "x" * 40]}).json()["error"]
    assert "input[1]" in err["message"] and "32" in err["message"] and err["param"] == "input"


def test_deployments_tell_generators_from_embedders():
    chat, _ = build_deployment(CHAT, FakeRunner())
    embed, _ = build_embedding_deployment(EMBED, FakeEmbedder())
    ds = Deployments([chat, embed])
    assert ds.generator(CHAT) is chat
    with pytest.raises(InvalidParameter) as exc:
        ds.generator(EMBED)
    assert exc.value.status == 400 and exc.value.code == "model_not_supported" and exc.value.param == "model"
    assert ds.embedder(EMBED) == (embed, embed.embedder)
    with pytest.raises(InvalidParameter) as exc:
        ds.embedder(CHAT)  # this chat deployment was built without an embedder
    assert exc.value.code == "model_not_supported"
    with pytest.raises(ModelNotFound):
        ds.generator("nope")
