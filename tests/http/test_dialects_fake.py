"""The platform dialects over the fake runner: Azure ML (/chat/completions?api-version), SageMaker / DJL LMI
(/invocations, /ping) and OpenVINO Model Server (/v3)."""

from __future__ import annotations

import json

import httpx
import pytest

from servelm.compose import build_deployment
from servelm.http.app import create_app
from servelm.runners.fake import FakeRunner
from servelm.service.registry.deployments import Deployments
from tests.conftest import serving

MSG = [{"role": "user", "content": "hi"}]
AZURE = "/chat/completions?api-version=2024-05-01-preview"


def letters(tokens):
    return "".join(chr(ord("a") + t % 26) for t in tokens)


def expected(runner: FakeRunner, prompt_text: str, n: int) -> str:
    last = runner.model.tokenize(prompt_text, add_special=True, parse_special=True)[-1]
    out = []
    for _ in range(n):
        last = runner.next_token(last)
        out.append(last)
    return letters(out)


def post(server, path, body, headers=None):
    return httpx.post(server.base_url + path, json=body, headers=headers or {}, timeout=30)


# -- Azure ML -------------------------------------------------------------------------------------


@pytest.mark.parametrize("query", ["", "?api-version=2024-5-1", "?api-version=2024-13-01", "?api-version=latest",
                                   "?api-version=2024-05-01-beta"])
def test_api_version_missing_or_malformed_is_400(fake_server, query):
    r = post(fake_server, "/chat/completions" + query, {"messages": MSG})
    assert r.status_code == 400
    body = r.json()
    assert body["error"]["param"] == "api-version" and body["status"] == 400
    assert body["code"] in ("missing_required_parameter", "invalid_value")
    assert r.headers["x-ms-error-code"] == body["code"]


@pytest.mark.parametrize("version", ["2024-05-01", "2024-04-01-preview"])
def test_azure_chat_answers_with_the_default_deployment(fake_server, version):
    r = post(fake_server, f"/chat/completions?api-version={version}", {"messages": MSG, "max_tokens": 3,
                                                                        "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["model"] == "fake-model" and body["object"] == "chat.completion"
    assert body["choices"][0]["message"]["content"] == expected(fake_server.runner, "<user>hi<assistant>", 3)
    assert "x-servelm-dropped-parameters" not in r.headers


def test_extra_parameters_error_is_a_422_naming_each(fake_server):
    r = post(fake_server, AZURE, {"messages": MSG, "top_k": 3, "ignore_eos": True},
             {"extra-parameters": "error"})
    assert r.status_code == 422
    body = r.json()
    assert body["status"] == 422 and body["code"] == "extra_parameters_not_allowed"
    assert body["detail"] == {"loc": ["body", "top_k"], "value": "3"}
    assert body["details"][1] == {"loc": ["body", "ignore_eos"], "value": "true"}
    assert "top_k" in body["message"] and "ignore_eos" in body["message"]
    assert body["error"]["param"] == "top_k" and body["error"]["status"] == 422


def test_extra_parameters_error_passes_a_request_inside_the_contract(fake_server):
    r = post(fake_server, AZURE, {"messages": MSG, "max_tokens": 2, "seed": 1}, {"extra-parameters": "error"})
    assert r.status_code == 200, r.text


def test_extra_parameters_ignore_drops_them(fake_server):
    r = post(fake_server, AZURE, {"messages": MSG, "max_tokens": 2, "temperature": 0, "min_tokens": 50, "foo": 1},
             {"extra-parameters": "ignore"})
    assert r.status_code == 200, r.text  # min_tokens 50 > max_tokens would be a 400 had it been kept
    assert r.headers["x-servelm-dropped-parameters"] == "min_tokens,foo"


def test_dropped_names_that_are_not_plain_ascii_are_escaped_in_the_header(fake_server):
    """Found by fuzzing the real model: an unknown field named with a character outside Latin-1 made the header
    unencodable and the request a 500."""
    r = post(fake_server, AZURE, {"messages": MSG, "max_tokens": 2, "f\u200boo": 1, "bar\r\nx-evil: 1": 2, "é": 3})
    assert r.status_code == 200, r.text
    assert r.headers["x-servelm-dropped-parameters"] == "f%E2%80%8Boo,bar%0D%0Ax-evil%3A%201,%C3%A9"
    assert "x-evil" not in r.headers


def test_extra_parameters_pass_through_reaches_the_engine(fake_server):
    # ignore_eos with max_tokens beyond the fake model's end: the answer runs past EOS to max_tokens
    body = {"messages": MSG, "max_tokens": 50, "temperature": 0}
    plain = post(fake_server, AZURE, body, {"extra-parameters": "pass-through"}).json()
    r = post(fake_server, AZURE, {**body, "ignore_eos": True, "top_k": 1}, {"extra-parameters": "pass-through"})
    assert r.status_code == 200, r.text
    assert "x-servelm-dropped-parameters" not in r.headers
    assert r.json()["usage"]["completion_tokens"] == 50
    assert plain["choices"][0]["finish_reason"] == "stop" and plain["usage"]["completion_tokens"] < 50


def test_pass_through_of_an_unknown_parameter_is_a_422(fake_server):
    r = post(fake_server, AZURE, {"messages": MSG, "foo": "bar"}, {"extra-parameters": "pass-through"})
    assert r.status_code == 422
    assert r.json()["detail"] == {"loc": ["body", "foo"], "value": "bar"}


def test_no_header_drops_extras_and_lists_them(fake_server):
    r = post(fake_server, AZURE, {"messages": MSG, "max_tokens": 2, "top_k": 1, "repetition_penalty": 1.1})
    assert r.status_code == 200, r.text
    assert r.headers["x-servelm-dropped-parameters"] == "top_k,repetition_penalty"


def test_dropped_list_comes_with_a_stream(fake_server):
    with httpx.stream("POST", fake_server.base_url + AZURE, json={"messages": MSG, "max_tokens": 2, "stream": True,
                                                                  "min_p": 0.1}, timeout=30) as r:
        assert r.status_code == 200
        assert r.headers["x-servelm-dropped-parameters"] == "min_p"
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    assert json.loads(lines[0][len("data: "):])["object"] == "chat.completion.chunk"


def test_bad_extra_parameters_header_is_400(fake_server):
    r = post(fake_server, AZURE, {"messages": MSG}, {"extra-parameters": "maybe"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "extra-parameters"


def test_image_for_a_text_model_is_azures_404_modality_not_supported(fake_server):
    """The Azure seed: 404 "Modality not supported by the model" for content the model cannot read, naming the
    part; elsewhere OpenAI's 400."""
    content = [{"type": "text", "text": "what is this?"},
               {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]
    r = post(fake_server, AZURE, {"messages": [{"role": "user", "content": content}]})
    assert r.status_code == 404 and r.headers["x-ms-error-code"] == "modality_not_supported"
    body = r.json()
    assert body["message"].startswith("Modality not supported by the model") and body["status"] == 404
    assert body["error"]["param"] == "messages[0].content[1]"
    r = post(fake_server, "/v1/chat/completions", {"model": "fake-model", "messages": [{"role": "user", "content": content}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0].content[1]"


def test_unknown_deployment_is_404_with_status(fake_server):
    r = post(fake_server, AZURE, {"messages": MSG}, {"azureml-model-deployment": "nope"})
    assert r.status_code == 404
    body = r.json()
    assert body["status"] == 404 and body["code"] == "model_not_found" and body["error"]["code"] == "model_not_found"


def test_model_disagreeing_with_the_deployment_header_is_400(fake_server):
    r = post(fake_server, AZURE, {"messages": MSG, "model": "other"}, {"azureml-model-deployment": "fake-model"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "model"


def test_malformed_body_is_400_with_status(fake_server):
    r = post(fake_server, AZURE, {"messages": "hi"})
    assert r.status_code == 400 and r.json()["status"] == 400 and r.json()["error"]["param"] == "messages"


def test_info(fake_server):
    r = httpx.get(fake_server.base_url + "/info?api-version=2024-05-01-preview")
    assert r.status_code == 200 and r.json()["model_name"] == "fake-model"


@pytest.fixture
def two_models():
    """A server with two deployments, "fake-a" (the default) and "fake-b" (a different model)."""
    deps, engines = [], []
    for name, vocab in (("fake-a", 64), ("fake-b", 48)):
        d, e = build_deployment(name, FakeRunner(vocab_size=vocab))
        deps.append(d)
        engines.append(e)
    app = create_app(Deployments(deps), on_start=lambda: [e.start() for e in engines],
                     on_stop=lambda: [e.stop() for e in engines])
    with serving(app) as base_url:
        yield base_url


def test_azureml_model_deployment_header_routes(two_models):
    body = {"messages": MSG, "max_tokens": 2}
    r = httpx.post(two_models + AZURE, json=body, headers={"azureml-model-deployment": "fake-b"}, timeout=30)
    assert r.status_code == 200 and r.json()["model"] == "fake-b"
    r = httpx.post(two_models + AZURE, json=body, timeout=30)
    assert r.json()["model"] == "fake-a"
    r = httpx.post(two_models + AZURE, json={**body, "model": "fake-b"}, timeout=30)
    assert r.json()["model"] == "fake-b"


def test_sagemaker_target_model_header_routes(two_models):
    body = {"inputs": "abc", "parameters": {"max_new_tokens": 2}}
    r = httpx.post(two_models + "/invocations", json=body, headers={"X-Amzn-SageMaker-Target-Model": "fake-b.tar.gz"})
    assert r.status_code == 200, r.text
    r = httpx.post(two_models + "/invocations", json={"messages": MSG, "max_tokens": 2},
                   headers={"X-Amzn-SageMaker-Target-Model": "fake-b"})
    assert r.json()["model"] == "fake-b"


# -- SageMaker / DJL LMI --------------------------------------------------------------------------


def test_ping(fake_server):
    r = httpx.get(fake_server.base_url + "/ping")
    assert r.status_code == 200


def test_invocations_chat(fake_server):
    r = post(fake_server, "/invocations", {"messages": MSG, "max_tokens": 3, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion" and body["model"] == "fake-model"
    assert body["choices"][0]["message"]["content"] == expected(fake_server.runner, "<user>hi<assistant>", 3)


def test_invocations_completion(fake_server):
    r = post(fake_server, "/invocations", {"prompt": "xy", "max_tokens": 3, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["object"] == "text_completion"
    assert r.json()["choices"][0]["text"] == expected(fake_server.runner, "xy", 3)


def test_invocations_native(fake_server):
    r = post(fake_server, "/invocations", {"inputs": "xy", "parameters": {"max_new_tokens": 4}})
    assert r.status_code == 200, r.text
    assert r.json() == {"generated_text": expected(fake_server.runner, "xy", 4)}  # no details: null


def test_invocations_native_default_max_new_tokens_is_30(fake_server):
    r = post(fake_server, "/invocations", {"inputs": "\x27", "parameters": {"ignore_eos": True, "details": True}})
    assert r.json()["details"]["generated_tokens"] == 30


def test_invocations_native_details_and_full_text(fake_server):
    r = post(fake_server, "/invocations", {"inputs": "xy", "parameters": {
        "max_new_tokens": 3, "details": True, "return_full_text": True}})
    body = r.json()
    text = expected(fake_server.runner, "xy", 3)
    assert body["generated_text"] == "xy" + text
    d = body["details"]
    assert d["finish_reason"] == "length" and d["generated_tokens"] == 3 and d["inputs"] == "xy"
    assert "".join(t["text"] for t in d["tokens"]) == text
    assert all(isinstance(t["id"], int) and t["log_prob"] <= 0 for t in d["tokens"])


def test_invocations_native_batch_and_stop(fake_server):
    r = post(fake_server, "/invocations", {"inputs": ["xy", "abc"], "parameters": {"max_new_tokens": 5,
                                                                                   "stop": ["k"], "details": True}})
    a, b = r.json()
    assert a["generated_text"] == "ij" and a["details"]["finish_reason"] == "stop_sequence"
    assert b["generated_text"] == expected(fake_server.runner, "abc", 3) and b["details"]["finish_reason"] == "eos_token"


def test_invocations_native_eos_finish(fake_server):
    r = post(fake_server, "/invocations", {"inputs": "\x27", "parameters": {"max_new_tokens": 50, "details": True}})
    assert r.json()["details"]["finish_reason"] == "eos_token"


def test_invocations_native_stream_is_jsonlines(fake_server):
    body = {"inputs": "xy", "parameters": {"max_new_tokens": 4, "details": True}, "stream": True}
    with httpx.stream("POST", fake_server.base_url + "/invocations", json=body, timeout=30) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("application/jsonlines")
        lines = [json.loads(line) for line in r.iter_lines() if line]
    text = expected(fake_server.runner, "xy", 4)
    assert len(lines) == 4
    assert all(line["token"]["id"] >= 0 for line in lines)
    assert "".join(line["token"]["text"] for line in lines) == text
    assert all(line["generated_text"] is None for line in lines[:-1])
    assert lines[-1]["generated_text"] == text and lines[-1]["details"]["finish_reason"] == "length"


def test_invocations_chat_stream_is_jsonlines(fake_server):
    body = {"messages": MSG, "max_tokens": 3, "temperature": 0, "stream": True}
    with httpx.stream("POST", fake_server.base_url + "/invocations", json=body, timeout=30) as r:
        assert r.headers["content-type"].startswith("application/jsonlines")
        lines = [json.loads(line) for line in r.iter_lines() if line]
    assert all(line["object"] == "chat.completion.chunk" for line in lines)
    content = "".join(c["delta"].get("content") or "" for line in lines for c in line["choices"])
    assert content == expected(fake_server.runner, "<user>hi<assistant>", 3)


def test_invocations_completion_stream_is_sse(fake_server):
    body = {"prompt": "abc", "max_tokens": 3, "stream": True}
    with httpx.stream("POST", fake_server.base_url + "/invocations", json=body, timeout=30) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"


def test_invocations_accept_header_picks_sse(fake_server):
    body = {"messages": MSG, "max_tokens": 2, "stream": True}
    with httpx.stream("POST", fake_server.base_url + "/invocations", json=body,
                      headers={"Accept": "text/event-stream"}, timeout=30) as r:
        assert r.headers["content-type"].startswith("text/event-stream")


@pytest.mark.parametrize("body, param", [
    ({"foo": 1}, None),
    ({"inputs": "a", "parameters": {"max_new_tokens": 0}}, "parameters.max_new_tokens"),
    ({"inputs": "a", "parameters": {"bogus": 1}}, "parameters.bogus"),
    ({"inputs": ["a", "b"], "stream": True}, "inputs"),
])
def test_invocations_bad_bodies_are_400(fake_server, body, param):
    r = post(fake_server, "/invocations", body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


# -- OpenVINO Model Server ------------------------------------------------------------------------


def test_v3_models(fake_server):
    assert [m["id"] for m in httpx.get(fake_server.base_url + "/v3/models").json()["data"]] == ["fake-model"]
    assert httpx.get(fake_server.base_url + "/v3/models/fake-model").json()["id"] == "fake-model"


def test_v3_chat_is_greedy_by_default(fake_server):
    r = post(fake_server, "/v3/chat/completions", {"model": "fake-model", "messages": MSG, "max_tokens": 3})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == expected(fake_server.runner, "<user>hi<assistant>", 3)


def test_v3_best_of_is_beam_search(fake_server):
    # OVMS: temperature 0 by default, so best_of > 1 is beam search (top_p with it is a 400 here)
    r = post(fake_server, "/v3/chat/completions", {"model": "fake-model", "messages": MSG, "max_tokens": 3,
                                                   "best_of": 2, "top_p": 0.5})
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_p"
    r = post(fake_server, "/v3/chat/completions", {"model": "fake-model", "messages": MSG, "max_tokens": 3,
                                                   "best_of": 2})
    assert r.status_code == 200, r.text
    r = post(fake_server, "/v1/chat/completions", {"model": "fake-model", "messages": MSG, "max_tokens": 3,
                                                   "best_of": 2, "top_p": 0.5})
    assert r.status_code == 200, r.text  # the same request on /v1 samples (temperature 1): no beam search


def test_v3_completions_max_tokens_defaults_to_the_window(fake_server):
    r = post(fake_server, "/v3/completions", {"model": "fake-model", "prompt": "\x27", "ignore_eos": True})
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    assert usage["prompt_tokens"] + usage["completion_tokens"] == fake_server.runner.context_window
    r = post(fake_server, "/v1/completions", {"model": "fake-model", "prompt": "\x27", "ignore_eos": True})
    assert r.json()["usage"]["completion_tokens"] == 16
