"""The real model's answers against OpenAI's published schemas (tests/openai_spec.py), every stream chunk
included, and scoring with echo: each prompt token's true logprob, equal to the model's own when it generates
the same tokens."""

from __future__ import annotations

import base64
import struct

import httpx
import pytest

from servelm.config import embedded_model_path
from servelm.runners.llamacpp import LlamaModel
from tests.openai_spec import assert_conforms, sse_chunks

from .helpers import MODEL

pytestmark = pytest.mark.e2e

ASK = [{"role": "user", "content": "What is the capital of France?"}]
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"]}}}
CHAT = {
    "plain": {},
    "logprobs": {"logprobs": True, "top_logprobs": 2},
    "n=2": {"n": 2, "temperature": 0.8, "seed": 4},
    "named tool": {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
    "required tools": {"tools": [WEATHER], "tool_choice": "required"},
}


def post(base_url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(base_url + path, json=body, timeout=120)


@pytest.mark.parametrize("extra", CHAT.values(), ids=CHAT.keys())
def test_chat_and_its_stream_follow_the_spec(base_url, extra):
    body = {"model": MODEL, "messages": ASK, "max_tokens": 24, "temperature": 0, **extra}
    answer = post(base_url, "/v1/chat/completions", body).json()
    assert_conforms("CreateChatCompletionResponse", answer)
    message = answer["choices"][0]["message"]
    assert message["refusal"] is None
    if "tools" in extra:
        assert message["tool_calls"][0]["function"]["name"] == "get_weather"
    else:
        assert "tool_calls" not in message
    chunks = sse_chunks(post(base_url, "/v1/chat/completions", {**body, "stream": True,
                                                                "stream_options": {"include_usage": True}}).text)
    for chunk in chunks:
        assert_conforms("CreateChatCompletionStreamResponse", chunk)
    assert chunks[0]["choices"][0]["delta"]["content"] == (None if "tools" in extra else "")


def test_deprecated_functions_answer_in_their_own_shape(base_url):
    body = {"model": MODEL, "messages": ASK, "max_tokens": 60, "temperature": 0,
            "functions": [WEATHER["function"]], "function_call": {"name": "get_weather"}}
    answer = post(base_url, "/v1/chat/completions", body).json()
    assert_conforms("CreateChatCompletionResponse", answer)
    choice = answer["choices"][0]
    assert choice["message"]["content"] is None and "tool_calls" not in choice["message"]
    assert choice["message"]["function_call"]["name"] == "get_weather" and choice["finish_reason"] == "function_call"
    chunks = sse_chunks(post(base_url, "/v1/chat/completions", {**body, "stream": True}).text)
    for chunk in chunks:
        assert_conforms("CreateChatCompletionStreamResponse", chunk)
    calls = [c["choices"][0]["delta"]["function_call"] for c in chunks
             if c["choices"] and c["choices"][0]["delta"].get("function_call")]
    assert calls[0]["name"] == "get_weather"
    assert "".join(c["arguments"] for c in calls) == choice["message"]["function_call"]["arguments"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "function_call"
    # the call and its result go back as the deprecated history does
    history = [*ASK, {"role": "assistant", "content": None, "function_call": choice["message"]["function_call"]},
               {"role": "function", "name": "get_weather", "content": "sunny, 21 C"}]
    follow = post(base_url, "/v1/chat/completions", {**body, "messages": history, "function_call": "none"})
    assert follow.status_code == 200 and follow.json()["choices"][0]["message"]["content"]


def test_required_tools_end_the_turn_instead_of_repeating_a_call(base_url):
    """Allowed parallel calls, the small model would repeat one call until max_tokens; the turn ends at the
    first repeat, and each call comes once."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Weather in Paris, Rome and Oslo?"}],
            "tools": [WEATHER], "tool_choice": "required", "max_tokens": 400, "temperature": 0}
    answer = post(base_url, "/v1/chat/completions", body).json()
    calls = [(c["function"]["name"], c["function"]["arguments"]) for c in answer["choices"][0]["message"]["tool_calls"]]
    assert calls and len(calls) == len(set(calls))
    assert answer["choices"][0]["finish_reason"] == "tool_calls"
    assert answer["usage"]["completion_tokens"] < 400


@pytest.mark.parametrize("extra", [{}, {"echo": True, "logprobs": 3}], ids=["plain", "echo"])
def test_completions_and_embeddings_and_models_follow_the_spec(base_url, extra):
    body = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0, **extra}
    answer = post(base_url, "/v1/completions", body).json()
    if extra:  # OpenAI's API gives the first prompt token null (the spec types them as numbers)
        lp = answer["choices"][0]["logprobs"]
        assert lp["token_logprobs"][0] is None
        lp["token_logprobs"], lp["top_logprobs"] = lp["token_logprobs"][1:], lp["top_logprobs"][1:]
    assert_conforms("CreateCompletionResponse", answer)
    floats = post(base_url, "/v1/embeddings", {"model": "all-minilm-l6-v2", "input": ["a", "b"]}).json()
    assert_conforms("CreateEmbeddingResponse", floats)
    # base64: a string, as OpenAI's API sends it (the spec lists only the float array)
    packed = post(base_url, "/v1/embeddings", {"model": "all-minilm-l6-v2", "input": "a",
                                               "encoding_format": "base64"}).json()
    raw = base64.b64decode(packed["data"][0]["embedding"])
    packed["data"][0]["embedding"] = list(struct.unpack(f"<{len(raw) // 4}f", raw))
    assert_conforms("CreateEmbeddingResponse", packed)
    assert_conforms("ListModelsResponse", httpx.get(base_url + "/v1/models").json())


def test_echo_scores_each_prompt_token_with_its_true_logprob(base_url):
    """lm-evaluation-harness's loglikelihood: echo, logprobs N, max_tokens 1. A token outside the top N (or the
    top 20) still has its true value; the model's own greedy tokens score what it gave them when generating."""
    vocab = LlamaModel(embedded_model_path(), vocab_only=True)  # the server's tokenizer, without weights
    tokens = vocab.tokenize("Paris is the capital of France. The capital of Italy is, as everyone knows,",
                            add_special=True, parse_special=False)
    gen = post(base_url, "/v1/completions", {"model": MODEL, "prompt": tokens, "max_tokens": 12, "temperature": 0,
                                             "logprobs": 1}).json()
    generated = gen["choices"][0]["logprobs"]["token_logprobs"]
    ids = vocab.tokenize(gen["choices"][0]["text"], add_special=False, parse_special=False)
    assert "".join(gen["choices"][0]["logprobs"]["tokens"]) == gen["choices"][0]["text"]
    assert [vocab.token_bytes(t).decode() for t in ids] == gen["choices"][0]["logprobs"]["tokens"], \
        "the setting: the answer's text tokenizes back to the tokens generated"
    scores = {}
    for n in (1, 5):
        scored = post(base_url, "/v1/completions", {"model": MODEL, "prompt": tokens + ids, "max_tokens": 1,
                                                    "echo": True, "logprobs": n, "temperature": 0}).json()
        scores[n] = scored["choices"][0]["logprobs"]["token_logprobs"][: len(tokens) + len(ids)]
    assert scores[1] == scores[5], "the values do not depend on N"
    prompt_part = scores[1][1 : len(tokens)]
    assert all(-60 < v <= 0 for v in prompt_part), "true values, no -9999 placeholder"
    assert sum(scores[1][len(tokens):]) == pytest.approx(sum(generated), abs=1e-3)
    vllm = post(base_url, "/v1/completions", {"model": MODEL, "prompt": tokens, "max_tokens": 1,
                                              "prompt_logprobs": 0, "temperature": 0}).json()
    per_token = vllm["choices"][0]["prompt_logprobs"]
    assert per_token[0] is None
    entries = [e[str(t)] for e, t in zip(per_token[1:], tokens[1:])]
    assert max(e["rank"] for e in entries) > 20, "the text has tokens outside the 20 most likely"
    assert [e["logprob"] for e in entries] == pytest.approx(prompt_part, abs=1e-6)
