"""The platform dialects on the real model, through the platforms' own clients: Microsoft's
`azure-ai-inference` for Azure ML, the `openai` client on OVMS's `/v3`, and SageMaker's /invocations."""

from __future__ import annotations

import json

import httpx
import pytest
from azure.ai.inference import ChatCompletionsClient
from azure.ai.inference.models import ImageContentItem, ImageUrl, TextContentItem, UserMessage
from azure.core.credentials import AzureKeyCredential
from azure.core.exceptions import HttpResponseError

from .helpers import MODEL, client_for

pytestmark = pytest.mark.e2e

ASK = "Name three colours."


@pytest.fixture(scope="module")
def azure(base_url: str):
    c = ChatCompletionsClient(endpoint=base_url, credential=AzureKeyCredential("none"))
    yield c
    c.close()


def test_azure_complete(azure: ChatCompletionsClient) -> None:
    r = azure.complete(messages=[UserMessage(ASK)], max_tokens=12, temperature=0)
    assert r.model == MODEL and r.choices[0].message.content.strip()
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.completion_tokens <= 12 and r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_azure_stream_matches_complete(azure: ChatCompletionsClient) -> None:
    whole = azure.complete(messages=[UserMessage(ASK)], max_tokens=12, temperature=0)
    pieces = [u.choices[0].delta.content or "" for u in
              azure.complete(messages=[UserMessage(ASK)], max_tokens=12, temperature=0, stream=True) if u.choices]
    assert "".join(pieces) == whole.choices[0].message.content


def test_azure_model_extras_pass_through(azure: ChatCompletionsClient) -> None:
    # top_k 1 reaches the engine only through extra-parameters: pass-through; it makes sampling greedy
    greedy = azure.complete(messages=[UserMessage(ASK)], max_tokens=12, temperature=0)
    for seed in (1, 2):
        r = azure.complete(messages=[UserMessage(ASK)], max_tokens=12, temperature=1.0, seed=seed,
                           model_extras={"top_k": 1})
        assert r.choices[0].message.content == greedy.choices[0].message.content


def test_azure_unknown_extra_is_422(azure: ChatCompletionsClient) -> None:
    with pytest.raises(HttpResponseError) as exc:
        azure.complete(messages=[UserMessage(ASK)], max_tokens=4, model_extras={"no_such_knob": 1})
    assert exc.value.status_code == 422 and "no_such_knob" in str(exc.value)


def test_azure_image_for_a_text_model_is_404_modality_not_supported(azure: ChatCompletionsClient) -> None:
    content = [TextContentItem(text="What is this?"), ImageContentItem(image_url=ImageUrl(url="data:image/png;base64,AA=="))]
    with pytest.raises(HttpResponseError) as exc:
        azure.complete(messages=[UserMessage(content)], max_tokens=4)
    assert exc.value.status_code == 404 and "Modality not supported" in str(exc.value)


def test_azure_embeddings_client(base_url: str, client) -> None:
    """azure-ai-inference's EmbeddingsClient on POST /embeddings?api-version=…: the default embedding model's
    vectors, the same as /v1/embeddings gives."""
    from azure.ai.inference import EmbeddingsClient

    with EmbeddingsClient(endpoint=base_url, credential=AzureKeyCredential("none")) as embeddings:
        r = embeddings.embed(input=["first text", "second text"], input_type="query")
        assert [d.index for d in r.data] == [0, 1] and r.usage.prompt_tokens > 0
        assert r.model == "all-minilm-l6-v2" and len(r.data[0].embedding) == 384
        own = client.embeddings.create(model="all-minilm-l6-v2", input=["first text", "second text"])
        for ours, theirs in zip(r.data, own.data):
            assert ours.embedding == pytest.approx(theirs.embedding, abs=1e-6)
        with pytest.raises(HttpResponseError) as exc:
            embeddings.embed(input=["x"], model_extras={"no_such_knob": 1})  # pass-through: unknown, 422
        assert exc.value.status_code == 422


def test_azure_model_info(azure: ChatCompletionsClient) -> None:
    assert azure.get_model_info().model_name == MODEL


def test_ovms_v3_through_openai(base_url: str) -> None:
    with client_for(base_url, path="/v3") as v3, client_for(base_url) as v1:
        assert [m.id for m in v3.models.list().data] == [m.id for m in v1.models.list().data]
        msgs = [{"role": "user", "content": ASK}]
        # OVMS's default temperature is 0: greedy, the same text as an explicit temperature 0 on /v1
        a = v3.chat.completions.create(model=MODEL, messages=msgs, max_tokens=12)
        b = v1.chat.completions.create(model=MODEL, messages=msgs, max_tokens=12, temperature=0)
        assert a.choices[0].message.content == b.choices[0].message.content
        streamed = "".join(c.choices[0].delta.content or "" for c in
                           v3.chat.completions.create(model=MODEL, messages=msgs, max_tokens=12, stream=True) if c.choices)
        assert streamed == b.choices[0].message.content
        c = v3.completions.create(model=MODEL, prompt="The sky is", max_tokens=5)
        assert c.choices[0].text and c.usage.completion_tokens <= 5


def test_sagemaker_invocations(base_url: str) -> None:
    assert httpx.get(f"{base_url}/ping").status_code == 200
    r = httpx.post(f"{base_url}/invocations", json={"inputs": "The sky is", "parameters": {"max_new_tokens": 6,
                                                                                          "details": True}}, timeout=120)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["details"]["generated_tokens"] <= 6
    assert "".join(t["text"] for t in out["details"]["tokens"]) == out["generated_text"]
    body = {"messages": [{"role": "user", "content": ASK}], "max_tokens": 8, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{base_url}/invocations", json=body, timeout=120) as s:
        assert s.headers["content-type"].startswith("application/jsonlines")
        lines = [json.loads(line) for line in s.iter_lines() if line]
    whole = httpx.post(f"{base_url}/invocations", json={**body, "stream": False}, timeout=120).json()
    text = "".join(c["delta"].get("content") or "" for line in lines for c in line["choices"])
    assert text == whole["choices"][0]["message"]["content"]
