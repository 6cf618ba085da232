"""Beam search as pure bookkeeping: hand-built logprob rows in, the next beams' moves (or the finished
hypotheses) out; and which sequence holds each new beam."""

from __future__ import annotations

import numpy as np

from servelm.engine.beam import BeamSearch, beam_hosts
from servelm.engine.types import BeamParams, FinishReason, SamplingParams

VOCAB = 8
EOS = 0


def text(token: int) -> bytes:
    return b"" if token == EOS else bytes([ord("a") + token])  # a control token has no text


def search(width: int = 2, **params) -> BeamSearch:
    p = SamplingParams(**{"max_tokens": 6, "n": 1, "best_of": width, "beam": BeamParams(), **params})
    return BeamSearch(p, width, frozenset({EOS}), text)


def rows(*preferences: dict[int, float]) -> np.ndarray:
    """One row per beam: the logits given, everything else far below."""
    out = np.full((len(preferences), VOCAB), -20.0, dtype=np.float32)
    for i, pref in enumerate(preferences):
        for token, value in pref.items():
            out[i, token] = value
    return out


def test_a_parents_first_child_stays_in_its_sequence_and_further_ones_take_the_childless_ones():
    assert beam_hosts([0, 1, 2], 3) == [0, 1, 2], "every beam continues itself: nothing moves"
    assert beam_hosts([1, 1, 0], 3) == [1, 2, 0], "beam 2 left no child: the second child of 1 goes there"
    assert beam_hosts([0, 0, 0, 0], 4) == [0, 3, 2, 1]


def test_the_first_step_extends_only_the_first_beam_of_the_empty_text():
    s = search()
    moves = s.step(rows({3: 2.0, 4: 1.0}, {5: 9.0}))  # beam 1 is the same empty text: its row is not read
    assert [(m.parent, m.token) for m in moves] == [(0, 3), (0, 4)]
    assert [b.tokens for b in s.beams] == [[3], [4]] and not s.done


def test_a_candidate_that_ends_becomes_a_hypothesis_and_the_search_ends_when_no_beam_can_beat_it():
    s = search()
    s.step(rows({3: 2.0, 4: 1.0}, {}))
    moves = s.step(rows({EOS: 5.0, 1: 0.0}, {EOS: -5.0, 2: 0.0}))  # beam 0 ends, almost surely
    assert not s.done and [h.reason for h in s.finished] == ["stop"]
    assert all(m.token != EOS for m in moves), "an ending candidate is no beam"
    for _ in range(4):
        if s.done:
            break
        s.step(rows({1: 0.0, 2: 0.0}, {1: 0.0, 2: 0.0}))
    assert s.done
    (best,) = s.outputs("r", 3, 0, lambda: _detok())
    assert best.finish_reason is FinishReason.STOP and best.token_ids == [3] and best.text == "d"


def test_max_tokens_ends_every_beam_for_length():
    s = search(max_tokens=2)
    s.step(rows({3: 1.0, 4: 1.0}, {}))
    assert s.step(rows({5: 1.0, 6: 0.5}, {5: 1.0, 6: 0.5})) == [] and s.done
    assert {h.reason for h in s.finished} == {"length"} and len(s.finished) == 2


def _detok():
    from servelm.engine.detokenizer import Detokenizer

    return Detokenizer(text, ())
