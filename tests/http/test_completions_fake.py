"""POST /v1/completions over the fake runner: prompt forms, choice indexing, echo, suffix, truncation,
legacy logprobs, streaming and errors, through a real uvicorn server, httpx and the official client.

The fake model: text character c is token 1 + ord(c) % 63, token t is followed by t + 1 (40 by EOS), and
token t spells the letter chr(ord('a') + t % 26)."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from servelm.runners.fake import FakeRunner
from tests.conftest import wait_engine_idle

FIM = (61, 62, 63)


def letters(tokens: list[int]) -> str:
    return "".join(chr(ord("a") + t % 26) for t in tokens)


def after(runner: FakeRunner, last: int, n: int) -> list[int]:
    out = []
    for _ in range(n):
        last = runner.next_token(last)
        out.append(last)
    return out


def tok(runner: FakeRunner, text: str) -> list[int]:
    return runner.model.tokenize(text, add_special=True, parse_special=True)


def completion_text(runner: FakeRunner, prompt_ids: list[int], n: int) -> str:
    return letters(after(runner, prompt_ids[-1], n))


def post(server, **body) -> httpx.Response:
    return httpx.post(server.base_url + "/v1/completions", json={"model": "fake-model", **body}, timeout=30)


def sse(server, **body) -> list[dict]:
    """The stream's data frames as JSON, checked to end with [DONE]."""
    with httpx.stream("POST", server.base_url + "/v1/completions", json={"model": "fake-model", "stream": True, **body},
                      timeout=30) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]" and all(line.startswith("data: ") for line in lines)
    return [json.loads(line[6:]) for line in lines[:-1]]


def fold(chunks: list[dict]) -> dict[int, dict]:
    """Each choice's streamed text, finish_reason and logprobs lists, by index."""
    out: dict[int, dict] = {}
    for c in chunks:
        for ch in c["choices"]:
            d = out.setdefault(ch["index"], {"text": "", "finish_reason": None, "tokens": [], "offsets": [], "lps": []})
            assert d["finish_reason"] is None, "a chunk after the choice's finish_reason"
            d["text"] += ch["text"]
            d["finish_reason"] = ch["finish_reason"]
            if ch["logprobs"]:
                d["tokens"] += ch["logprobs"]["tokens"]
                d["offsets"] += ch["logprobs"]["text_offset"]
                d["lps"] += ch["logprobs"]["token_logprobs"]
    return out


def error_of(r: httpx.Response, status: int = 400) -> dict:
    assert r.status_code == status, r.text
    return r.json()["error"]


@pytest.fixture
def client(fake_server):
    return openai.OpenAI(base_url=fake_server.base_url + "/v1", api_key="none", max_retries=0)


# -- shape and prompt forms -----------------------------------------------------------------------
def test_string_prompt_has_the_contract_fields(fake_server, client):
    r = client.completions.create(model="fake-model", prompt="hello", max_tokens=3, temperature=0)
    assert r.id.startswith("cmpl-") and r.object == "text_completion" and r.model == "fake-model"
    assert r.created > 0 and r.system_fingerprint
    ids = tok(fake_server.runner, "hello")
    assert len(r.choices) == 1 and r.choices[0].index == 0
    assert r.choices[0].text == completion_text(fake_server.runner, ids, 3)
    assert r.choices[0].finish_reason == "length" and r.choices[0].logprobs is None
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (5, 3, 8)


def test_max_tokens_defaults_to_16(fake_server):
    body = post(fake_server, prompt=[1], temperature=0).json()  # 1, 2, ... never reaches EOS within 16
    assert body["usage"]["completion_tokens"] == 16 and body["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("form", ["strings", "token_ids", "token_id_lists"])
def test_prompt_forms_and_choice_indices(fake_server, form):
    runner = fake_server.runner
    texts = ["ab", "xyz"]
    id_lists = [tok(runner, t) for t in texts]
    prompt = {"strings": texts, "token_ids": id_lists[0], "token_id_lists": id_lists}[form]
    expected_prompts = id_lists[:1] if form == "token_ids" else id_lists
    # n > 1 at temperature 0 would be beam search; the fake model is all but certain at temperature 1
    body = post(fake_server, prompt=prompt, n=2, max_tokens=2, seed=1).json()
    assert [c["index"] for c in body["choices"]] == list(range(2 * len(expected_prompts)))
    for c in body["choices"]:
        assert c["text"] == completion_text(runner, expected_prompts[c["index"] // 2], 2)
    usage = body["usage"]
    assert usage["prompt_tokens"] == sum(len(p) for p in expected_prompts)
    assert usage["completion_tokens"] == 2 * 2 * len(expected_prompts)


def test_batch_through_the_client(fake_server, client):
    r = client.completions.create(model="fake-model", prompt=["a", "bb", "ccc"], max_tokens=1, temperature=0)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [c.text for c in r.choices] == [completion_text(fake_server.runner, tok(fake_server.runner, p), 1)
                                           for p in ("a", "bb", "ccc")]
    assert r.usage.prompt_tokens == 6 and r.usage.completion_tokens == 3


# -- echo -----------------------------------------------------------------------------------------
def test_echo_puts_the_prompt_first(fake_server):
    runner = fake_server.runner
    body = post(fake_server, prompt="hi", echo=True, max_tokens=2, temperature=0).json()
    assert body["choices"][0]["text"] == "hi" + completion_text(runner, tok(runner, "hi"), 2)
    assert body["usage"]["completion_tokens"] == 2


def test_echo_of_token_ids_is_their_text(fake_server):
    body = post(fake_server, prompt=[[3, 4], [7]], echo=True, max_tokens=1, temperature=0).json()
    assert [c["text"] for c in body["choices"]] == ["de" + letters([5]), "h" + letters([8])]


def test_echo_with_logprobs_lists_the_prompt_tokens_first(fake_server):
    body = post(fake_server, prompt=[3, 4, 5], echo=True, logprobs=1, max_tokens=2, temperature=0).json()
    c = body["choices"][0]
    lp = c["logprobs"]
    assert c["text"] == "def" + letters([6, 7])
    assert lp["tokens"] == list("defgh")
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert all(v is not None and v <= 0 for v in lp["token_logprobs"][1:])
    assert lp["text_offset"] == [0, 1, 2, 3, 4]
    assert "".join(lp["tokens"]) == c["text"]


def test_streamed_echo_comes_in_each_choices_first_chunk(fake_server):
    chunks = sse(fake_server, prompt=["ab", "cd"], n=2, echo=True, max_tokens=2, seed=1)
    firsts: dict[int, str] = {}
    for c in chunks:
        for ch in c["choices"]:
            firsts.setdefault(ch["index"], ch["text"])
    assert sorted(firsts) == [0, 1, 2, 3]
    assert firsts[0].startswith("ab") and firsts[1].startswith("ab")
    assert firsts[2].startswith("cd") and firsts[3].startswith("cd")
    full = post(fake_server, prompt=["ab", "cd"], n=2, echo=True, max_tokens=2, seed=1).json()
    assert {i: d["text"] for i, d in fold(chunks).items()} == {c["index"]: c["text"] for c in full["choices"]}


# -- legacy logprobs ------------------------------------------------------------------------------
def test_legacy_logprobs(fake_server, client):
    r = client.completions.create(model="fake-model", prompt=[3], logprobs=2, max_tokens=3, temperature=0)
    lp = r.choices[0].logprobs
    assert lp.tokens == list("efg") and r.choices[0].text == "efg"
    assert lp.text_offset == [0, 1, 2]
    assert all(v <= 0 for v in lp.token_logprobs)
    for token, top in zip(lp.tokens, lp.top_logprobs):
        assert token in top and 1 <= len(top) <= 3 and all(v <= 0 for v in top.values())


def test_logprobs_zero_gives_only_the_chosen_token(fake_server):
    lp = post(fake_server, prompt=[3], logprobs=0, max_tokens=2, temperature=0).json()["choices"][0]["logprobs"]
    assert lp["tokens"] == ["e", "f"] and [list(t) for t in lp["top_logprobs"]] == [["e"], ["f"]]


def test_streamed_logprobs_continue_their_offsets(fake_server):
    chunks = sse(fake_server, prompt=[3], logprobs=1, echo=True, max_tokens=4, temperature=0)
    (d,) = fold(chunks).values()
    assert d["text"] == "d" + letters([4, 5, 6, 7])
    assert d["tokens"] == list(d["text"]) and d["offsets"] == [0, 1, 2, 3, 4]
    assert d["lps"][0] is None and all(v <= 0 for v in d["lps"][1:])


# -- suffix (fill in the middle) ------------------------------------------------------------------
def test_suffix_needs_fim_tokens(fake_server):
    err = error_of(post(fake_server, prompt="ab", suffix="cd"))
    assert err["param"] == "suffix" and err["code"] == "unsupported_parameter"
    assert "fill-in-the-middle" in err["message"]
    assert post(fake_server, prompt="ab", suffix="", max_tokens=1).status_code == 200


def test_suffix_lays_out_a_fim_prompt(fake_server_factory):
    server = fake_server_factory(fim_tokens=FIM)
    runner = server.runner
    body = post(server, prompt="ab", suffix="cd", max_tokens=2, temperature=0).json()
    expected = [FIM[0], *tok(runner, "ab"), FIM[1], *tok(runner, "cd"), FIM[2]]
    assert body["usage"]["prompt_tokens"] == len(expected)
    first_chunks = [list(c.tokens) for plan in runner.steps for c in plan.chunks if c.start == 0]
    assert first_chunks[-1] == expected
    assert body["choices"][0]["text"] == completion_text(runner, expected, 2)


def test_echo_with_suffix_is_rejected(fake_server_factory):
    server = fake_server_factory(fim_tokens=FIM)
    err = error_of(post(server, prompt="ab", suffix="cd", echo=True))
    assert err["param"] == "echo"


# -- use_raw_prompt and error_behavior ------------------------------------------------------------
def test_use_raw_prompt_tokenizes_without_additions(fake_server, monkeypatch):
    runner = fake_server.runner
    calls = []
    real = runner.model.tokenize

    def spy(text, *, add_special, parse_special):
        calls.append((text, add_special, parse_special))
        return real(text, add_special=add_special, parse_special=parse_special)

    monkeypatch.setattr(runner.model, "tokenize", spy)
    raw = post(fake_server, prompt="hey", use_raw_prompt=True, max_tokens=1, temperature=0).json()
    assert ("hey", False, False) in calls and not any(c[1] for c in calls if c[0] == "hey")
    calls.clear()
    plain = post(fake_server, prompt="hey", max_tokens=1, temperature=0).json()
    assert ("hey", True, True) in calls
    assert raw["usage"]["prompt_tokens"] == plain["usage"]["prompt_tokens"] == 3


def test_token_id_prompts_are_taken_as_given(fake_server):
    body = post(fake_server, prompt=[5, 5, 5], use_raw_prompt=False, max_tokens=1, temperature=0).json()
    assert body["usage"]["prompt_tokens"] == 3 and body["choices"][0]["text"] == letters([6])


def test_error_behavior_error_rejects_an_over_long_prompt(fake_server):
    for extra in ({}, {"error_behavior": "error"}):
        err = error_of(post(fake_server, prompt="a" * 120, max_tokens=16, **extra))
        assert err["code"] == "context_length_exceeded" and err["param"] == "prompt"


def test_error_behavior_truncate_cuts_the_prompt_from_the_left(fake_server):
    window = fake_server.runner.context_window  # 128
    prompt = [1 + i % 30 for i in range(200)]
    body = post(fake_server, prompt=prompt, max_tokens=8, error_behavior="truncate", echo=True, temperature=0).json()
    kept = prompt[-(window - 8):]
    c = body["choices"][0]
    assert body["usage"]["prompt_tokens"] == window - 8
    assert c["text"] == letters(kept) + completion_text(fake_server.runner, kept, 8)
    assert c["finish_reason"] == "length"


def test_truncate_leaves_a_prompt_that_fits_alone(fake_server):
    body = post(fake_server, prompt="abc", max_tokens=4, error_behavior="truncate", temperature=0).json()
    assert body["usage"]["prompt_tokens"] == 3


def test_truncate_lowers_a_max_tokens_that_fills_the_window(fake_server):
    body = post(fake_server, prompt=[1] * 10, max_tokens=500, error_behavior="truncate", ignore_eos=True,
                temperature=0).json()
    assert body["usage"]["prompt_tokens"] == 1
    assert body["usage"]["completion_tokens"] == fake_server.runner.context_window - 1


# -- streaming ------------------------------------------------------------------------------------
def test_stream_chunks_usage_and_done(fake_server, client):
    chunks = list(client.completions.create(model="fake-model", prompt=["ab", "cd"], max_tokens=3, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert all(c.object == "text_completion" and c.id == chunks[0].id for c in chunks)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6
    assert chunks[-1].usage.prompt_tokens == 4
    assert all(c.usage is None for c in chunks[:-1])
    texts = {0: "", 1: ""}
    finish = {}
    for c in chunks[:-1]:
        for ch in c.choices:
            assert ch.index not in finish
            texts[ch.index] += ch.text
            if ch.finish_reason:
                finish[ch.index] = ch.finish_reason
    full = client.completions.create(model="fake-model", prompt=["ab", "cd"], max_tokens=3, temperature=0)
    assert texts == {c.index: c.text for c in full.choices}
    assert finish == {c.index: c.finish_reason for c in full.choices} == {0: "length", 1: "stop"}  # "cd" reaches EOS


def test_stream_without_usage_has_no_usage_field(fake_server):
    chunks = sse(fake_server, prompt="ab", max_tokens=2)
    assert chunks and all("usage" not in c for c in chunks)
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] in ("stop", "length")


def test_stop_string(fake_server):
    runner = fake_server.runner
    text = completion_text(runner, [3], 6)
    body = post(fake_server, prompt=[3], max_tokens=6, stop=[text[2:4]], temperature=0).json()
    c = body["choices"][0]
    assert c["text"] == text[:2] and c["finish_reason"] == "stop" and c["stop_reason"] == text[2:4]


def test_best_of_returns_n_choices(fake_server):
    body = post(fake_server, prompt="ab", best_of=3, n=1, max_tokens=2, temperature=1.0, seed=1).json()
    assert len(body["choices"]) == 1 and body["choices"][0]["index"] == 0
    chunks = sse(fake_server, prompt=["ab", "cd"], best_of=3, n=1, max_tokens=2, temperature=1.0, seed=1)
    by_index = fold(chunks)
    assert sorted(by_index) == [0, 1] and all(d["finish_reason"] for d in by_index.values())


# -- bad requests ---------------------------------------------------------------------------------
@pytest.mark.parametrize("body, param", [
    ({"prompt": []}, "prompt"),
    ({"prompt": [[]]}, "prompt"),
    ({"prompt": [[1], []]}, "prompt"),
    ({"prompt": [64]}, "prompt"),
    ({"prompt": [[1], [1000]]}, "prompt"),
    ({"prompt": [-1]}, "prompt"),
    ({"prompt": ["a", 1]}, "prompt"),
    ({"prompt": 5}, "prompt"),
    ({"prompt": [True]}, "prompt"),
    ({}, "prompt"),
    ({"prompt": "a", "logprobs": 21}, "logprobs"),
    ({"prompt": "a", "logprobs": -1}, "logprobs"),
    ({"prompt": "a", "logprobs": True}, "logprobs"),
    ({"prompt": "a", "echo": "yes"}, "echo"),
    ({"prompt": "a", "error_behavior": "ignore"}, "error_behavior"),
    ({"prompt": "a", "stream_options": {"include_usage": True}}, "stream_options"),
    ({"prompt": "a", "n": 2, "best_of": 1}, "best_of"),
    ({"prompt": "a", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "a", "messages": []}, "messages"),
])
def test_bad_requests_name_the_parameter(fake_server, body, param):
    assert error_of(post(fake_server, **body))["param"] == param


def test_unknown_model_is_404(fake_server):
    r = httpx.post(fake_server.base_url + "/v1/completions", json={"model": "nope", "prompt": "a"})
    assert error_of(r, 404)["code"] == "model_not_found"


# -- disconnects ----------------------------------------------------------------------------------
def _wait_engine_idle(server, timeout: float = 3.0) -> bool:
    return wait_engine_idle(server.engine, timeout)


def test_a_client_leaving_a_batch_stream_aborts_every_prompt(fake_server_factory):
    server = fake_server_factory(step_delay=0.05)  # 120 tokens would take 6 s
    body = {"model": "fake-model", "prompt": [[1], [2], [3]], "max_tokens": 120, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.base_url + "/v1/completions", json=body, timeout=30) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                break
        assert server.engine.stats().running == 3
    assert _wait_engine_idle(server), server.engine.stats()


def test_a_client_leaving_a_batch_request_aborts_every_prompt(fake_server_factory):
    server = fake_server_factory(step_delay=0.05)  # 120 tokens would take 6 s
    body = {"model": "fake-model", "prompt": [[1], [2]], "max_tokens": 120, "ignore_eos": True}
    with pytest.raises(httpx.TimeoutException):
        httpx.post(server.base_url + "/v1/completions", json=body, timeout=0.3)
    assert _wait_engine_idle(server), server.engine.stats()
