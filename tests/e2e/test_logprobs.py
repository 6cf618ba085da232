"""Chat logprobs, best_of, beam search and the stopping controls, through the official client, streamed and
not, against the real embedded model."""

from __future__ import annotations

import math
from typing import Any

import openai
import pytest

from .helpers import HELLO, MODEL, NO_EOS, STORY, chat

pytestmark = pytest.mark.e2e


def logprob_content(client: openai.OpenAI, stream: bool, **kw: Any) -> tuple[str, list[Any], str | None]:
    """One choice's text, its logprobs content entries and its finish_reason."""
    kw = {"model": MODEL, "logprobs": True, **kw}
    if not stream:
        r = client.chat.completions.create(**kw)
        c = r.choices[0]
        return c.message.content or "", list(c.logprobs.content), c.finish_reason
    text, entries, finish = "", [], None
    for chunk in client.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            text += c.delta.content or ""
            if c.logprobs is not None:
                entries += c.logprobs.content
            finish = c.finish_reason or finish
    return text, entries, finish


def test_logprobs_cover_the_text_with_sorted_alternatives(client: openai.OpenAI, stream: bool) -> None:
    text, entries, _ = logprob_content(client, stream, messages=STORY, max_tokens=20, temperature=0,
                                       top_logprobs=5, logit_bias=NO_EOS)
    assert len(entries) == 20
    assert b"".join(bytes(e.bytes) for e in entries).decode() == text
    for e in entries:
        assert e.logprob <= 0 and len(e.top_logprobs) == 5
        tops = [t.logprob for t in e.top_logprobs]
        assert tops == sorted(tops, reverse=True) and all(lp <= 0 for lp in tops)
        # greedy: the token taken is the most likely one
        assert e.top_logprobs[0].token == e.token and e.top_logprobs[0].logprob == pytest.approx(e.logprob)
        assert all(bytes(t.bytes) == t.token.encode() for t in e.top_logprobs if "\ufffd" not in t.token)
    assert sum(math.exp(t.logprob) for t in entries[0].top_logprobs) <= 1.0 + 1e-6


def test_streamed_logprobs_equal_the_whole_answers(client: openai.OpenAI) -> None:
    kw = dict(messages=HELLO, max_tokens=16, temperature=0, top_logprobs=3)
    plain = logprob_content(client, False, **kw)
    streamed = logprob_content(client, True, **kw)
    assert plain[0] == streamed[0] and plain[2] == streamed[2]
    assert [e.token for e in plain[1]] == [e.token for e in streamed[1]]
    assert [e.logprob for e in plain[1]] == pytest.approx([e.logprob for e in streamed[1]])


def test_logprobs_without_top_and_the_end_token_is_not_listed(client: openai.OpenAI, stream: bool) -> None:
    text, entries, finish = logprob_content(client, stream, messages=HELLO, max_tokens=200, temperature=0)
    assert finish == "stop" and entries and all(e.top_logprobs == [] for e in entries)
    assert b"".join(bytes(e.bytes) for e in entries).decode() == text, "no entry for <|im_end|>"


def test_bytes_rebuild_characters_split_over_tokens(client: openai.OpenAI, stream: bool) -> None:
    word = "日本語の猫"
    text, entries, _ = logprob_content(client, stream, messages=HELLO, max_tokens=30, temperature=0,
                                       extra_body={"structured_outputs": {"choice": [word]}})
    assert text == word
    assert len(entries) > len(word), "the characters are spread over byte tokens"
    assert any("\ufffd" in e.token for e in entries), "a token holding part of a character"
    assert b"".join(bytes(e.bytes) for e in entries).decode() == word


def test_a_token_outside_the_top_20_reports_minus_9999(client: openai.OpenAI) -> None:
    _, entries, _ = logprob_content(client, False, messages=STORY, max_tokens=64, temperature=2.0, seed=11,
                                    top_logprobs=20, logit_bias=NO_EOS)
    unlikely = [e for e in entries if e.token not in {t.token for t in e.top_logprobs}]
    assert unlikely, "at temperature 2 some of 64 sampled tokens fall outside the 20 most likely"
    assert all(e.logprob == -9999.0 for e in unlikely)
    assert all(-9999.0 < e.logprob <= 0 for e in entries if e not in unlikely)


def test_top_logprobs_needs_logprobs_and_at_most_20(client: openai.OpenAI) -> None:
    for kw in ({"top_logprobs": 2}, {"logprobs": True, "top_logprobs": 21}):
        with pytest.raises(openai.BadRequestError) as exc:
            client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=2, **kw)
        assert exc.value.body["param"] == "top_logprobs"


def _sum_logprobs(choice: Any) -> float:
    return sum(e.logprob for e in choice.logprobs.content)


def test_best_of_returns_the_likeliest_of_its_samples(client: openai.OpenAI, stream: bool) -> None:
    kw = dict(model=MODEL, messages=STORY, max_tokens=12, temperature=0.7, seed=5, logprobs=True,
              logit_bias=NO_EOS)
    samples = client.chat.completions.create(n=3, **kw)
    best = max(samples.choices, key=_sum_logprobs)
    out = chat(client, stream=stream, n=1, extra_body={"best_of": 3}, **{k: v for k, v in kw.items() if k != "model"})
    assert out.texts == [best.message.content], "the same seeds sample the same three texts; the likeliest wins"
    assert out.usage.completion_tokens == 36, "usage counts every sequence sampled"


def test_beam_search_beats_or_equals_greedy(client: openai.OpenAI, stream: bool) -> None:
    kw = dict(model=MODEL, messages=STORY, max_tokens=10, temperature=0, logprobs=True, logit_bias=NO_EOS)
    greedy = client.chat.completions.create(**kw).choices[0]
    beams = client.chat.completions.create(n=2, extra_body={"use_beam_search": True, "best_of": 4}, **kw).choices
    assert len(beams) == 2 and beams[0].message.content != beams[1].message.content
    assert _sum_logprobs(beams[0]) >= _sum_logprobs(greedy) - 1e-4
    assert _sum_logprobs(beams[0]) >= _sum_logprobs(beams[1]) - 1e-4, "best first (equal lengths)"
    out = chat(client, stream=stream, n=2, extra_body={"use_beam_search": True, "best_of": 4},
               **{k: v for k, v in kw.items() if k not in ("model", "logprobs")})
    assert out.texts == [b.message.content for b in beams], "a stream sends the same beams at the end"
    assert out.finish_reasons == ["length", "length"]


def test_best_of_at_temperature_zero_is_beam_search_as_in_ovms(client: openai.OpenAI) -> None:
    kw = dict(model=MODEL, messages=STORY, max_tokens=10, temperature=0, logit_bias=NO_EOS)
    ovms = client.chat.completions.create(n=2, extra_body={"best_of": 3}, **kw)
    explicit = client.chat.completions.create(n=2, extra_body={"use_beam_search": True, "best_of": 3}, **kw)
    assert [c.message.content for c in ovms.choices] == [c.message.content for c in explicit.choices]


def test_beam_search_stops_at_a_stop_string_and_with_length_penalty(client: openai.OpenAI, stream: bool) -> None:
    base = chat(client, stream=False, messages=STORY, max_tokens=24, temperature=0,
                extra_body={"use_beam_search": True, "best_of": 2})
    words = base.text.split()
    assert len(words) > 3
    stop = " " + words[2]
    out = chat(client, stream=stream, messages=STORY, max_tokens=24, temperature=0, stop=[stop],
               extra_body={"use_beam_search": True, "best_of": 2, "length_penalty": 0.0})
    assert stop not in out.text and out.finish_reason == "stop"


def test_diverse_beam_search_returns_different_beams(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model=MODEL, messages=STORY, max_tokens=8, temperature=0, n=2, logit_bias=NO_EOS,
        extra_body={"use_beam_search": True, "best_of": 2, "num_beam_groups": 2, "diversity_penalty": 10.0})
    first_tokens = {c.message.content.split()[0] if c.message.content.split() else "" for c in r.choices}
    assert len(r.choices) == 2 and len(first_tokens) == 2, "a large diversity penalty forces different openings"


def test_beam_only_settings_without_beam_search_are_400(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=2, extra_body={"length_penalty": 2.0})
    assert exc.value.body["param"] == "length_penalty"


# -- stopping controls ---------------------------------------------------------------------------
def test_ignore_eos_runs_past_the_natural_end(client: openai.OpenAI, stream: bool) -> None:
    natural = chat(client, stream=False, messages=HELLO, max_tokens=200, temperature=0)
    assert natural.finish_reason == "stop"
    n = natural.usage.completion_tokens + 10
    out = chat(client, stream=stream, messages=HELLO, max_tokens=n, temperature=0, extra_body={"ignore_eos": True})
    assert out.finish_reason == "length" and out.usage.completion_tokens == n


def test_min_tokens_holds_off_the_end(client: openai.OpenAI, stream: bool) -> None:
    natural = chat(client, stream=False, messages=HELLO, max_tokens=200, temperature=0)
    floor = natural.usage.completion_tokens + 5
    out = chat(client, stream=stream, messages=HELLO, max_tokens=200, temperature=0, extra_body={"min_tokens": floor})
    assert out.usage.completion_tokens >= floor


def test_include_stop_str_in_output(client: openai.OpenAI, stream: bool) -> None:
    base = chat(client, stream=False, messages=STORY, max_tokens=24, temperature=0)
    stop = base.text.split()[3]
    cut = chat(client, stream=stream, messages=STORY, max_tokens=24, temperature=0, stop=[stop])
    kept = chat(client, stream=stream, messages=STORY, max_tokens=24, temperature=0, stop=[stop],
                extra_body={"include_stop_str_in_output": True})
    assert kept.text == cut.text + stop and kept.stop_reason == stop == cut.stop_reason


def test_skip_special_tokens_false_shows_control_tokens(client: openai.OpenAI, stream: bool) -> None:
    force = {"1": 100}  # <|im_start|>, a control token
    hidden = chat(client, stream=stream, messages=HELLO, max_tokens=3, temperature=0, logit_bias=force)
    shown = chat(client, stream=stream, messages=HELLO, max_tokens=3, temperature=0, logit_bias=force,
                 extra_body={"skip_special_tokens": False})
    assert hidden.text == "" and shown.text == "<|im_start|>" * 3
