"""Logprobs read in place (engine/sampling.py token_logprobs) give, bit for bit, what the row's whole float64
log-softmax gives: the token's logprob, its rank and the k best, over small and large vocabularies."""

from __future__ import annotations

import numpy as np
import pytest

from servelm.engine.sampling import log_softmax, logprob_entry, token_logprobs
from servelm.engine.types import TokenLogprob


def reference(rows: np.ndarray, tokens: list[int], ks: list[int | None]) -> list[TokenLogprob]:
    """The whole rows' log-softmax in float64 (and the float32 normalizer of a row that only ranks samples)."""
    out = []
    for row, token, k in zip(rows, tokens, ks):
        if k is None:
            sub = row[None, :]
            m = sub.max(axis=1)
            lse = m + np.log(np.exp(sub - m[:, None]).sum(axis=1))
            out.append(TokenLogprob(token, float(row[token] - lse[0])))
        else:
            out.append(logprob_entry(log_softmax(row[None, :])[0], token, k))
    return out


@pytest.mark.parametrize("vocab", [50, 1000, 49152, 262144])
def test_in_place_logprobs_equal_the_whole_log_softmax(vocab: int) -> None:
    rng = np.random.default_rng(vocab)
    rows = rng.normal(0, 4, size=(6, vocab)).astype(np.float32)
    rows[1, rng.integers(0, vocab, size=vocab // 3)] = -np.inf  # banned tokens
    rows[2, :5] = 30.0  # a tie at the top
    rows[3] = np.round(rows[3])  # many ties everywhere
    rows[4, 7] += 100.0  # a bias that dominates
    tokens = [int(np.argmax(rows[0])), int(rng.integers(vocab)), 3, int(np.argmax(rows[3])), 7,
              int(np.argsort(rows[5])[vocab // 2])]
    for ks in ([0, 1, 5, 20, 2, None], [20, 20, None, 5, 0, 20]):
        which = list(range(len(tokens)))
        got = token_logprobs(rows, which, tokens, ks)
        want = reference(rows, tokens, ks)
        for g, w in zip(got, want):
            assert (g.token, g.logprob, g.rank, g.top) == (w.token, w.logprob, w.rank, w.top)


def test_a_row_with_every_token_forbidden_takes_the_general_path() -> None:
    rows = np.full((1, 100), -np.inf, dtype=np.float32)
    (got,) = token_logprobs(rows, [0], [4], [3])
    (want,) = reference(rows, [4], [3])
    assert (got.token, got.rank, got.top) == (want.token, want.rank, want.top)
    assert np.isnan(got.logprob) and np.isnan(want.logprob)
