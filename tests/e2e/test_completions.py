"""POST /v1/completions (legacy) through the official client on the real model: prompt forms, batches,
echo, legacy logprobs, suffix, use_raw_prompt, error_behavior, stop, best_of, streaming."""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import openai
import pytest

from .conftest import own_server
from .helpers import MODEL, NO_EOS, client_for

pytestmark = pytest.mark.e2e

PROMPT = "The capital of France is"
# "<|im_start|>user hi" is these three SmolLM2 tokens when its special-token text is parsed
IM_START_USER_HI = "<|im_start|>user hi"
IM_START_USER_HI_IDS = [1, 4093, 15876]


def complete(client: openai.OpenAI, *, stream: bool, **kw: Any) -> dict[str, Any]:
    """One request, streamed or not, folded into {"choices": {index: {...}}, "usage", "id"}; a stream is
    checked chunk by chunk on the way (one id, object text_completion, nothing after a finish_reason)."""
    kw.setdefault("model", MODEL)
    if not stream:
        r = client.completions.create(**kw)
        assert r.id.startswith("cmpl-") and r.object == "text_completion" and r.model == MODEL
        assert r.system_fingerprint
        choices = {c.index: {"text": c.text, "finish_reason": c.finish_reason, "logprobs": c.logprobs,
                             "stop_reason": (c.model_extra or {}).get("stop_reason")} for c in r.choices}
        assert list(choices) == [c.index for c in r.choices]
        return {"choices": choices, "usage": r.usage, "id": r.id}
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    first = chunks[0]
    assert first.id.startswith("cmpl-")
    choices: dict[int, dict[str, Any]] = {}
    for chunk in chunks[:-1]:
        assert chunk.object == "text_completion" and chunk.id == first.id and chunk.usage is None
        for c in chunk.choices:
            d = choices.setdefault(c.index, {"text": "", "finish_reason": None, "stop_reason": None, "logprobs": None})
            assert d["finish_reason"] is None, f"choice {c.index} got a chunk after its finish_reason"
            d["text"] += c.text
            d["finish_reason"] = c.finish_reason
            if c.finish_reason:
                d["stop_reason"] = (c.model_extra or {}).get("stop_reason")
            if c.logprobs is not None:
                lp = d["logprobs"] = d["logprobs"] or {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
                for key in lp:
                    lp[key] += getattr(c.logprobs, key)
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    for d in choices.values():
        assert d["finish_reason"] in ("stop", "length")
        if d["logprobs"] is not None:
            d["logprobs"] = SimpleNamespace(**d["logprobs"])
    return {"choices": dict(sorted(choices.items())), "usage": chunks[-1].usage, "id": first.id}


def only(out: dict[str, Any]) -> dict[str, Any]:
    assert list(out["choices"]) == [0]
    return out["choices"][0]


@pytest.fixture(params=[False, True], ids=["plain", "stream"])
def stream(request: pytest.FixtureRequest) -> bool:
    return request.param


def test_string_prompt(client: openai.OpenAI, stream: bool) -> None:
    out = complete(client, stream=stream, prompt=PROMPT, max_tokens=8, temperature=0)
    c = only(out)
    assert c["text"].strip() and c["finish_reason"] in ("stop", "length")
    u = out["usage"]
    assert u.prompt_tokens > 3 and 0 < u.completion_tokens <= 8 and u.total_tokens == u.prompt_tokens + u.completion_tokens


def test_streamed_text_equals_the_whole_answer(client: openai.OpenAI) -> None:
    kw = dict(prompt=PROMPT, max_tokens=12, temperature=0, logit_bias=NO_EOS)
    assert complete(client, stream=True, **kw)["choices"] == complete(client, stream=False, **kw)["choices"]


def test_max_tokens_defaults_to_16(client: openai.OpenAI) -> None:
    out = complete(client, stream=False, prompt=PROMPT, temperature=0, logit_bias=NO_EOS)
    assert only(out)["finish_reason"] == "length" and out["usage"].completion_tokens == 16


def test_token_id_prompts(client: openai.OpenAI, stream: bool) -> None:
    as_text = complete(client, stream=stream, prompt=IM_START_USER_HI, max_tokens=6, temperature=0)
    as_ids = complete(client, stream=stream, prompt=IM_START_USER_HI_IDS, max_tokens=6, temperature=0, echo=True)
    assert as_text["usage"].prompt_tokens == as_ids["usage"].prompt_tokens == 3
    assert only(as_ids)["text"] == IM_START_USER_HI + only(as_text)["text"]
    batch = complete(client, stream=stream, prompt=[IM_START_USER_HI_IDS, [4093, 15876]], max_tokens=6, temperature=0)
    assert list(batch["choices"]) == [0, 1]
    assert batch["choices"][0]["text"] == only(as_text)["text"]
    assert batch["usage"].prompt_tokens == 5


def test_batch_indices_with_n(client: openai.OpenAI, stream: bool) -> None:
    prompts = ["Once upon a time", "The best fruit is"]
    out = complete(client, stream=stream, prompt=prompts, n=2, max_tokens=6, temperature=0.8, seed=7, echo=True)
    assert list(out["choices"]) == [0, 1, 2, 3]
    for index, c in out["choices"].items():
        assert c["text"].startswith(prompts[index // 2])
    alone = [complete(client, stream=False, prompt=p, max_tokens=1)["usage"].prompt_tokens for p in prompts]
    assert out["usage"].prompt_tokens == sum(alone)  # each prompt once, whatever n
    assert out["usage"].completion_tokens <= 4 * 6


def test_echo(client: openai.OpenAI, stream: bool) -> None:
    plain = only(complete(client, stream=stream, prompt=PROMPT, max_tokens=6, temperature=0))
    echoed = only(complete(client, stream=stream, prompt=PROMPT, max_tokens=6, temperature=0, echo=True))
    assert echoed["text"] == PROMPT + plain["text"]


def check_logprobs(lp: Any, text: str, k: int) -> None:
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset)
    assert "".join(lp.tokens) == text  # ASCII text, no EOS (banned): tokens spell the text exactly
    offset = 0
    for token, at in zip(lp.tokens, lp.text_offset):
        assert at == offset
        offset += len(token)
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        if value is None:
            assert top is None
            continue
        assert value <= 0
        assert token in top and 1 <= len(top) <= k + 1  # the k most likely, and always the token taken
        assert all(v <= 0 for v in top.values())


def test_legacy_logprobs(client: openai.OpenAI, stream: bool) -> None:
    c = only(complete(client, stream=stream, prompt=PROMPT, max_tokens=8, temperature=0, logprobs=3, logit_bias=NO_EOS))
    lp = c["logprobs"]
    assert len(lp.tokens) == 8 and all(v is not None for v in lp.token_logprobs)
    check_logprobs(lp, c["text"], 3)
    # greedy: the token taken is the most likely one
    for value, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert value == pytest.approx(max(top.values()))


def test_streamed_logprobs_equal_the_whole_answers(client: openai.OpenAI) -> None:
    kw = dict(prompt=PROMPT, max_tokens=8, temperature=0, logprobs=2, logit_bias=NO_EOS, echo=True)
    a, b = only(complete(client, stream=True, **kw)), only(complete(client, stream=False, **kw))
    assert a["text"] == b["text"]
    assert a["logprobs"].tokens == b["logprobs"].tokens and a["logprobs"].text_offset == b["logprobs"].text_offset
    assert a["logprobs"].token_logprobs == pytest.approx(b["logprobs"].token_logprobs)


def test_echo_with_logprobs_scores_the_prompt(client: openai.OpenAI, stream: bool) -> None:
    c = only(complete(client, stream=stream, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=1, echo=True,
                      logit_bias=NO_EOS))
    lp = c["logprobs"]
    assert c["text"].startswith(PROMPT)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert "".join(lp.tokens).startswith(PROMPT) and len(lp.tokens) > 4
    check_logprobs(lp, c["text"], 1)


def test_logprobs_zero_gives_the_chosen_token_only(client: openai.OpenAI) -> None:
    c = only(complete(client, stream=False, prompt=PROMPT, max_tokens=3, temperature=0, logprobs=0, logit_bias=NO_EOS))
    assert [list(top) for top in c["logprobs"].top_logprobs] == [[t] for t in c["logprobs"].tokens]


def test_suffix_is_refused_without_fim_tokens(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="def add(a, b):", suffix="    return c", max_tokens=4)
    err = e.value.body
    assert err["param"] == "suffix" and err["code"] == "unsupported_parameter"
    assert "fill-in-the-middle" in err["message"]


def test_use_raw_prompt_reads_special_token_text_as_text(client: openai.OpenAI) -> None:
    parsed = complete(client, stream=False, prompt=IM_START_USER_HI, max_tokens=2, temperature=0)
    raw = complete(client, stream=False, prompt=IM_START_USER_HI, max_tokens=2, temperature=0,
                   extra_body={"use_raw_prompt": True})
    assert parsed["usage"].prompt_tokens == 3
    assert raw["usage"].prompt_tokens > 3  # "<|im_start|>" spelled out in ordinary tokens
    same = complete(client, stream=False, prompt=PROMPT, max_tokens=4, temperature=0, extra_body={"use_raw_prompt": True})
    assert only(same)["text"] == only(complete(client, stream=False, prompt=PROMPT, max_tokens=4, temperature=0))["text"]


def test_stop_string(client: openai.OpenAI, stream: bool) -> None:
    text = only(complete(client, stream=stream, prompt=PROMPT, max_tokens=12, temperature=0, logit_bias=NO_EOS))["text"]
    stop = text.strip().split()[0]
    c = only(complete(client, stream=stream, prompt=PROMPT, max_tokens=12, temperature=0, stop=[stop]))
    assert c["finish_reason"] == "stop" and c["stop_reason"] == stop
    assert stop not in c["text"] and text.startswith(c["text"])


def test_best_of_returns_n_choices(client: openai.OpenAI, stream: bool) -> None:
    out = complete(client, stream=stream, prompt=PROMPT, best_of=3, n=1, max_tokens=6, temperature=0.8, seed=3)
    assert list(out["choices"]) == [0] and only(out)["text"]
    assert out["usage"].completion_tokens <= 3 * 6


# -- error_behavior, on a server with a 128-token window ------------------------------------------
@pytest.fixture(scope="module")
def small_client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    with own_server(tmp_path_factory, "--context-window", "128") as srv:
        yield client_for(srv.base_url)


LONG = "The quick brown fox jumps over the lazy dog. " * 20  # about 200 tokens


def test_error_behavior_error_refuses_an_over_long_prompt(small_client: openai.OpenAI) -> None:
    for extra in ({}, {"error_behavior": "error"}):
        with pytest.raises(openai.BadRequestError) as e:
            small_client.completions.create(model=MODEL, prompt=LONG, max_tokens=8, extra_body=extra)
        assert e.value.body["code"] == "context_length_exceeded" and e.value.body["param"] == "prompt"


def test_error_behavior_truncate_keeps_the_prompts_end(small_client: openai.OpenAI, stream: bool) -> None:
    kw = dict(prompt=LONG, max_tokens=8, temperature=0, logit_bias=NO_EOS, extra_body={"error_behavior": "truncate"})
    out = complete(small_client, stream=stream, **kw)
    c = only(out)
    assert c["finish_reason"] == "length" and c["text"]
    assert out["usage"].prompt_tokens == 128 - 8 and out["usage"].completion_tokens == 8
    echoed = only(complete(small_client, stream=stream, echo=True, **kw))["text"]
    assert echoed.endswith(c["text"])
    kept = echoed[: len(echoed) - len(c["text"])]
    assert LONG.endswith(kept) and 0 < len(kept) < len(LONG)  # the echo is what is left: the prompt's end
