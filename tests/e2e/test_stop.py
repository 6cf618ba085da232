"""Stop strings (a string and a list, across token boundaries, held back in streams) and stop_token_ids."""

from __future__ import annotations

import openai
import pytest

from .helpers import STORY, chat

pytestmark = pytest.mark.e2e

MAX_TOKENS = 40


@pytest.fixture(scope="module")
def reference(client: openai.OpenAI) -> str:
    """The greedy answer without any stop: every stop below is chosen from inside it."""
    out = chat(client, stream=False, messages=STORY, max_tokens=MAX_TOKENS, temperature=0)
    assert out.finish_reason == "length", "the reference answer should run to max_tokens"
    assert len(out.text.split()) >= 12, out.text
    return out.text


def _middle_word(text: str, nth: int = 0) -> str:
    words = [w.strip(".,!?;:'\"") for w in text.split()]
    long_words = [w for w in words[len(words) // 3 :] if len(w) >= 5]
    assert len(long_words) > nth, text
    return long_words[nth]


def _stopped(client: openai.OpenAI, stream: bool, stop) -> object:
    return chat(client, stream=stream, messages=STORY, max_tokens=MAX_TOKENS, temperature=0, stop=stop)


def test_stop_string(client: openai.OpenAI, stream: bool, reference: str) -> None:
    word = _middle_word(reference)
    out = _stopped(client, stream, word)
    assert out.text == reference[: reference.index(word)]
    assert word not in out.text
    assert out.finish_reason == "stop"
    assert out.stop_reason == word


def test_stop_list_first_match_wins(client: openai.OpenAI, stream: bool, reference: str) -> None:
    early, late = _middle_word(reference, 0), _middle_word(reference, 1)
    stops = ["never-in-this-text", late, early]
    first = min((s for s in stops if s in reference), key=reference.index)
    out = _stopped(client, stream, stops)
    assert out.text == reference[: reference.index(first)]
    assert out.finish_reason == "stop"
    assert out.stop_reason == first


def test_stop_inside_words_across_tokens(client: openai.OpenAI, stream: bool, reference: str) -> None:
    # a stop string that starts and ends in the middle of words, so it spans several tokens
    mid = len(reference) // 2
    stop = reference[mid - 3 : mid + 4]
    out = _stopped(client, stream, [stop])
    assert out.text == reference[: reference.index(stop)]
    assert stop not in out.text
    assert out.stop_reason == stop and out.finish_reason == "stop"


def test_partial_stop_is_released_at_length(client: openai.OpenAI, stream: bool, reference: str) -> None:
    # the answer contains the stop's beginning but never the whole stop: nothing is lost or held back
    word = _middle_word(reference)
    out = _stopped(client, stream, word + "\u00a7\u00a7")
    assert out.text == reference
    assert out.finish_reason == "length" and out.stop_reason is None


def test_stream_never_shows_a_stop_string(client: openai.OpenAI, reference: str) -> None:
    word = _middle_word(reference)
    out = _stopped(client, True, word)
    deltas = [c.choices[0].delta.content or "" for c in out.chunks if c.choices]
    assert not any(word in d for d in deltas)
    # the concatenation is exactly the text before the stop: no partial stop string at its end
    assert "".join(deltas) == reference[: reference.index(word)]


def test_stop_token_ids_forced(client: openai.OpenAI, stream: bool) -> None:
    out = chat(client, stream=stream, messages=STORY, max_tokens=8, temperature=0,
               logit_bias={"28": 100}, extra_body={"stop_token_ids": [28]})
    assert out.finish_reason == "stop"
    assert out.stop_reason == 28 and isinstance(out.stop_reason, int)
    assert out.text == ""


def test_stop_token_ids_natural(client: openai.OpenAI, stream: bool, reference: str) -> None:
    # token 28 is "," in SmolLM2's vocabulary; the reference answer has a comma
    assert "," in reference
    out = chat(client, stream=stream, messages=STORY, max_tokens=MAX_TOKENS, temperature=0,
               extra_body={"stop_token_ids": [28, 49000]})
    assert out.finish_reason == "stop" and out.stop_reason == 28
    assert out.text == reference[: reference.index(",")]
