"""Errors through the client: 400/404 in the OpenAI envelope, and a server that keeps working after them."""

from __future__ import annotations

import httpx
import openai
import pytest

from .helpers import HELLO, RunningServer, chat, health

pytestmark = pytest.mark.e2e

BAD_PARAMS = [
    ("temperature_3", {"temperature": 3}, "temperature"),
    ("temperature_negative", {"temperature": -0.5}, "temperature"),
    ("top_p_1_5", {"top_p": 1.5}, "top_p"),
    ("n_0", {"n": 0}, "n"),
    ("max_tokens_0", {"max_tokens": 0}, "max_tokens"),
    ("max_completion_tokens_0", {"max_completion_tokens": 0}, "max_completion_tokens"),
    ("presence_penalty_5", {"presence_penalty": 5}, "presence_penalty"),
    ("frequency_penalty_-3", {"frequency_penalty": -3}, "frequency_penalty"),
    ("logit_bias_key_not_int", {"logit_bias": {"x": 1}}, "logit_bias"),
    ("logit_bias_out_of_vocab", {"logit_bias": {"999999": 1}}, "logit_bias"),
    ("logit_bias_value_500", {"logit_bias": {"5": 500}}, "logit_bias"),
    ("stop_wrong_type", {"extra_body": {"stop": 5}}, "stop"),
    ("top_k_wrong_type", {"extra_body": {"top_k": "five"}}, "top_k"),
    ("min_p_2", {"extra_body": {"min_p": 2}}, "min_p"),
    ("repetition_penalty_0", {"extra_body": {"repetition_penalty": 0}}, "repetition_penalty"),
    ("stop_token_ids_out_of_vocab", {"extra_body": {"stop_token_ids": [999999]}}, "stop_token_ids"),
    ("unknown_parameter", {"extra_body": {"foo": 1}}, "foo"),
    ("messages_empty", {"messages": []}, "messages"),
    ("role_wizard", {"messages": [{"role": "wizard", "content": "hi"}]}, "messages"),
]


def _error_of(exc: openai.APIStatusError) -> dict:
    err = exc.response.json()["error"]
    assert set(err) >= {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"]
    assert exc.body == err
    return err


@pytest.mark.parametrize(("kwargs", "param"), [c[1:] for c in BAD_PARAMS], ids=[c[0] for c in BAD_PARAMS])
def test_bad_parameter_is_400(client: openai.OpenAI, stream: bool, kwargs: dict, param: str) -> None:
    request = {"messages": HELLO, "max_tokens": 4, **kwargs}
    with pytest.raises(openai.BadRequestError) as info:
        chat(client, stream=stream, **request)
    assert info.value.status_code == 400
    err = _error_of(info.value)
    assert err["type"] == "invalid_request_error"
    assert err["param"] == param or (param == "messages" and str(err["param"]).startswith("messages")), err


def test_malformed_json_is_400(base_url: str) -> None:
    r = httpx.post(f"{base_url}/v1/chat/completions", content=b'{"model": "x", "messages": [',
                   headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 400
    err = r.json()["error"]
    assert set(err) >= {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error" and err["message"]


def test_body_not_an_object_is_400(base_url: str) -> None:
    r = httpx.post(f"{base_url}/v1/chat/completions", json=[1, 2], timeout=30)
    assert r.status_code == 400
    assert r.json()["error"]["type"] == "invalid_request_error"


def test_unknown_model_is_404(client: openai.OpenAI, stream: bool) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        chat(client, stream=stream, model="no-such-model", messages=HELLO, max_tokens=4)
    assert info.value.status_code == 404
    err = _error_of(info.value)
    assert err["code"] == "model_not_found"
    assert err["param"] == "model"


def test_prompt_longer_than_the_window_is_400(client: openai.OpenAI, stream: bool) -> None:
    long_prompt = " ".join(["hello"] * 9000)  # the window is 8192 tokens
    with pytest.raises(openai.BadRequestError) as info:
        chat(client, stream=stream, messages=[{"role": "user", "content": long_prompt}], max_tokens=4)
    assert _error_of(info.value)["code"] == "context_length_exceeded"


def test_prompt_longer_than_the_window_without_max_tokens_is_400(client: openai.OpenAI) -> None:
    long_prompt = " ".join(["hello"] * 9000)
    with pytest.raises(openai.BadRequestError) as info:
        chat(client, stream=False, messages=[{"role": "user", "content": long_prompt}])
    assert _error_of(info.value)["code"] == "context_length_exceeded"


@pytest.mark.parametrize("limit", ["max_tokens", "max_completion_tokens"])
def test_max_tokens_past_the_window_is_400(client: openai.OpenAI, stream: bool, limit: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        chat(client, stream=stream, messages=HELLO, **{limit: 100000})
    assert _error_of(info.value)["code"] == "context_length_exceeded"


def test_server_still_works_after_the_errors(client: openai.OpenAI, base_url: str, server: RunningServer) -> None:
    out = chat(client, stream=False, messages=HELLO, max_tokens=8, temperature=0)
    assert out.text
    streamed = chat(client, stream=True, messages=HELLO, max_tokens=8, temperature=0)
    assert streamed.texts == out.texts
    stats = health(base_url)
    assert stats["running"] == 0 and stats["waiting"] == 0
    log = server.log_path.read_text(errors="replace")
    assert 'HTTP/1.1" 5' not in log, "the server answered a 5xx:\n" + server.log_tail()
    assert "Traceback" not in log, "the server logged a traceback:\n" + server.log_tail()
