"""Temperature-only rows over a large vocabulary, drawn row by row (shared with helper threads, no float64 copy of a
row to search it): the same tokens, bit for bit, as the whole-batch draw they replaced, wherever a row sits."""

from __future__ import annotations

import numpy as np
import pytest

from servelm.engine import sampling
from servelm.engine.sampling import SamplerState, pick_rows
from servelm.engine.types import SamplingParams

V = 262144  # Gemma 3's vocabulary: 16 rows are past SHARE_ELEMENTS, so helper threads take rows


def whole_batch_draw(logits: np.ndarray, states: list[SamplerState]) -> list[int]:
    """The temperature-only draw as it was written first: one softmax and one cumulative sum for the batch."""
    temps = np.array([st.params.temperature for st in states], dtype=np.float32)[:, None]
    weights = logits / temps
    weights -= weights.max(axis=1, keepdims=True)
    np.exp(weights, out=weights)
    cdf = np.cumsum(weights, axis=1, out=weights)
    u = np.array([st.rng.random() for st in states]) * cdf[:, -1]
    picks = [int(np.searchsorted(cdf[i], u[i], side="right")) for i in range(len(states))]
    return np.minimum(np.asarray(picks, dtype=np.int64), logits.shape[1] - 1).tolist()


def states(seed: int, temps: list[float], **kw) -> list[SamplerState]:
    return [SamplerState.create(SamplingParams(max_tokens=8, temperature=t, seed=seed, **kw), i, V, ())
            for i, t in enumerate(temps)]


def test_plain_rows_draw_what_the_whole_batch_drew() -> None:
    rng = np.random.default_rng(3)
    temps = [1.0, 0.7, 0.3, 1.5, 0.05, 2.0, 1.0, 0.9, 0.7, 0.7, 1.0, 0.2, 1.3, 0.6, 1.0, 0.8]
    logits = rng.normal(0, 4, size=(len(temps), V)).astype(np.float32)
    logits[1, :1000] = -np.inf  # banned tokens
    logits[2, 77] = 60.0  # one token holds nearly all the mass
    logits[4] = np.round(logits[4])  # ties
    assert logits.size >= sampling.SHARE_ELEMENTS
    mine, theirs = states(11, temps), states(11, temps)
    for _ in range(6):
        before = logits.copy()
        got = pick_rows(logits, mine).tolist()
        assert np.array_equal(logits, before, equal_nan=True), "the processed rows stay as they were (logprobs read them)"
        assert got == whole_batch_draw(logits, theirs)


def test_a_plain_row_draws_alike_beside_greedy_and_filtered_rows() -> None:
    rng = np.random.default_rng(4)
    logits = rng.normal(0, 3, size=(6, V)).astype(np.float32)
    params = [dict(temperature=0.8), dict(temperature=0.0), dict(temperature=0.8, top_k=40), dict(temperature=0.8),
              dict(temperature=1.0, top_p=0.9), dict(temperature=0.8)]
    mixed = [SamplerState.create(SamplingParams(max_tokens=8, seed=5, **p), i, V, ()) for i, p in enumerate(params)]
    plain = [0, 3, 5]
    alone = [SamplerState.create(SamplingParams(max_tokens=8, seed=5, **params[i]), i, V, ()) for i in plain]
    for _ in range(4):
        got = pick_rows(logits, mixed)
        assert got[1] == int(np.argmax(logits[1]))
        assert [int(got[i]) for i in plain] == whole_batch_draw(logits[plain], alone)


@pytest.mark.parametrize("u", [0.0, 1.0, 1.5, 3.0000001, 1e-30, 2.0**-149, 1e300, np.inf, -1.0, np.nan])
def test_a_float32_search_finds_what_the_float64_search_found(u: float) -> None:
    cdf = np.cumsum(np.array([0.0, 1.0, 0.5, 0.0, 1.5, 1e-8, 2.0, 0.0], dtype=np.float32))
    value = np.float64(u)
    assert sampling._search(cdf, value) == int(np.searchsorted(cdf, value, side="right"))
    for near in (np.nextafter(value, -np.inf), np.nextafter(value, np.inf)):
        assert sampling._search(cdf, near) == int(np.searchsorted(cdf, near, side="right"))


def test_a_float32_search_at_every_boundary_of_a_real_row() -> None:
    rng = np.random.default_rng(8)
    cdf = np.cumsum(np.exp(rng.normal(0, 2, size=50_000).astype(np.float32)))
    points = np.concatenate([cdf[::97].astype(np.float64), rng.random(500) * np.float64(cdf[-1])])
    for p in points:
        for value in (p, np.nextafter(p, -np.inf), np.nextafter(p, np.inf)):
            assert sampling._search(cdf, value) == int(np.searchsorted(cdf, value, side="right"))
