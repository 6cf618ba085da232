"""Draws over a large vocabulary, by the shortcuts that make them cheap: the same tokens, bit for bit, as the draws
they replaced, wherever a row sits.

- Temperature-only rows drawn row by row (shared with helper threads, no float64 copy of a row to search it).
- top_k found among the row's best values, without a float64 copy of the whole row and its partition, where that
  decides the same ids in the same order.
- The temperature draw's running sum without the weights too small to move it.
- top_p past its first candidates: the values sorted, not the ids."""

from __future__ import annotations

import numpy as np
import pytest

from servelm.engine import sampling
from servelm.engine.sampling import SamplerState, _softmax, _softmax_partial, pick_rows
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


def one_row_draw(row: np.ndarray, st: SamplerState) -> int:
    """A filtered row's draw as it was written first: the whole row in float64, partitioned for top_k."""
    p = st.params
    scaled = row.astype(np.float64) / p.temperature
    vocab = scaled.shape[0]
    ids: np.ndarray | None = None
    if 0 < p.top_k < vocab:
        ids = np.argpartition(-scaled, p.top_k - 1)[: p.top_k]
        ids = ids[np.argsort(-scaled[ids], kind="stable")]
        probs = _softmax(scaled[ids])
    elif p.top_p < 1.0:
        ids = np.argpartition(-scaled, 1023)[:1024] if vocab > 1024 else np.arange(vocab)
        ids = ids[np.argsort(-scaled[ids], kind="stable")]
        probs = _softmax_partial(scaled, ids)
        if probs.sum() < p.top_p:
            ids = np.argsort(-scaled, kind="stable")
            probs = _softmax(scaled[ids])
    else:
        probs = _softmax(scaled)
    if p.top_p < 1.0 and ids is not None:
        keep = int(np.searchsorted(np.cumsum(probs), p.top_p)) + 1
        ids, probs = ids[:keep], probs[:keep]
    if p.min_p > 0.0:
        keep_mask = probs >= p.min_p * probs.max()
        probs = probs[keep_mask]
        ids = np.flatnonzero(keep_mask) if ids is None else ids[keep_mask]
    cdf = np.cumsum(probs)
    u = st.rng.random() * cdf[-1]
    k = min(int(np.searchsorted(cdf, u, side="right")), cdf.shape[0] - 1)
    return int(k if ids is None else ids[k])


ROWS = {
    "spread": lambda rng: rng.normal(0, 3, size=V).astype(np.float32),
    "peaked": lambda rng: np.where(np.arange(V) < 50, 20.0, 0.0).astype(np.float32) + rng.normal(0, 1, V).astype(np.float32),
    "ties": lambda rng: np.round(rng.normal(0, 3, size=V)).astype(np.float32),  # ties at the k-th value and above it
    "few finite": lambda rng: np.where(np.arange(V) % 9000 == 0, 1.0, -np.inf).astype(np.float32),  # 30 tokens allowed
    "near": lambda rng: (np.float32(10.0) + rng.integers(0, 4, V).astype(np.float32) * np.float32(2.0**-20)),
}


@pytest.mark.parametrize("shape", list(ROWS))
@pytest.mark.parametrize("params", [dict(top_k=40, temperature=0.8), dict(top_k=1, temperature=1.0),
                                    dict(top_k=40, top_p=0.9, temperature=1.7), dict(top_k=64, min_p=0.05, temperature=2.0),
                                    dict(top_k=5, temperature=0.3), dict(top_k=1000, temperature=1.0)],
                         ids=lambda p: ",".join(f"{k}={v}" for k, v in p.items()))
def test_top_k_draws_what_the_whole_row_drew(shape: str, params: dict) -> None:
    rng = np.random.default_rng(len(shape))
    row = ROWS[shape](rng)
    mine = SamplerState.create(SamplingParams(max_tokens=8, seed=21, **params), 0, V, ())
    theirs = SamplerState.create(SamplingParams(max_tokens=8, seed=21, **params), 0, V, ())
    for _ in range(12):
        assert int(pick_rows(row[None, :], [mine])[0]) == one_row_draw(row, theirs)


def test_top_k_takes_no_partition_of_the_row_where_its_best_values_decide(monkeypatch: pytest.MonkeyPatch) -> None:
    """The shortcut is taken (else the tests above would pass on the whole-row path alone), and not on ties."""
    calls: list[int] = []
    partition = np.argpartition
    monkeypatch.setattr(np, "argpartition", lambda a, *args, **kw: calls.append(len(a)) or partition(a, *args, **kw))
    rng = np.random.default_rng(1)
    assert len(sampling._top_k(ROWS["spread"](rng), 0.8, 40)) == 40 and calls == []
    assert len(sampling._top_k(ROWS["ties"](rng), 0.8, 40)) == 40 and calls == [V]


def test_filtered_rows_shared_with_helpers_draw_what_each_drew_alone() -> None:
    rng = np.random.default_rng(6)
    logits = rng.normal(0, 3, size=(16, V)).astype(np.float32)
    params = [dict(top_k=40, temperature=0.8), dict(top_p=0.9, temperature=1.0), dict(min_p=0.1, temperature=0.6),
              dict(top_k=8, top_p=0.5, temperature=1.2)] * 4
    assert len(params) * V * sampling.EXP_PASSES >= sampling.SHARE_ELEMENTS
    mine = [SamplerState.create(SamplingParams(max_tokens=8, seed=13, **p), i, V, ()) for i, p in enumerate(params)]
    theirs = [SamplerState.create(SamplingParams(max_tokens=8, seed=13, **p), i, V, ()) for i, p in enumerate(params)]
    for _ in range(3):
        assert pick_rows(logits, mine).tolist() == [one_row_draw(logits[i], st) for i, st in enumerate(theirs)]


def model_like_row(rng: np.random.Generator, width: int, top_at: int) -> np.ndarray:
    """A row shaped like a model's: most values far below a few likely tokens, its best one at `top_at`."""
    row = rng.normal(-8, 3, size=width).astype(np.float32)
    row[rng.integers(0, width, 40)] = rng.normal(4, 2, 40)
    row[top_at] = 12.0
    return row


def expanded(row: np.ndarray, temperature: float) -> tuple[bool, np.ndarray]:
    """The shortcut's running sum written out at every id (a skipped id holds the sum before it), and whether the
    shortcut was taken."""
    ids, sums = sampling._running_sum(row, temperature)
    if ids is None:
        return False, sums
    before = np.searchsorted(ids, np.arange(row.shape[0]), side="right")  # kept ids at or before each id
    return True, np.concatenate([np.zeros(1, np.float32), sums])[before]


def whole(row: np.ndarray, temperature: float) -> np.ndarray:
    t = np.float32(temperature)
    weights = row / t
    weights -= weights.max()
    np.exp(weights, out=weights)
    return np.cumsum(weights, out=weights)


@pytest.mark.parametrize("width", [V, 49152, 50_000, 3000])
@pytest.mark.parametrize("temperature", [1e-5, 0.05, 0.3, 0.7, 1.0, 1.5])
def test_the_running_sum_skips_only_weights_that_leave_it_as_it_was(width: int, temperature: float) -> None:
    """Written out at every id, the shortcut's sum is the whole row's, bit for bit: every value it skipped would
    have left the sum as it was. Wherever the best value lies: a sum starts small, so skipping starts after it."""
    rng = np.random.default_rng(width + int(temperature * 100))
    taken = 0
    for top_at in (0, width // 3, width - 1):
        row = model_like_row(rng, width, top_at)
        shortcut, sums = expanded(row, temperature)
        taken += shortcut
        np.testing.assert_array_equal(sums, whole(row, temperature))
    if width >= 49152 and temperature < 1.0:
        assert taken == 3, "a model's row at a temperature below 1 skips most of itself"


def test_the_running_sum_at_the_edge_of_half_an_ulp() -> None:
    """Values whose weights lie on either side of half an ulp of the sum, and where exp's result turns to 0: the
    margins keep every value that could round the sum up."""
    rng = np.random.default_rng(2)
    half_ulp_of_1 = np.log(2.0) * -24  # the sum is 1 once the first value is in
    row = np.concatenate([[0.0], half_ulp_of_1 + rng.uniform(-0.02, 0.02, V // 8),
                          np.log(2.0) * -25 + rng.uniform(-0.02, 0.02, V // 8),
                          rng.uniform(-112, -100, V - 1 - V // 4)]).astype(np.float32)
    rng.shuffle(row[1024:])  # each kind of value in every chunk after the first
    shortcut, sums = expanded(row, 1.0)
    assert shortcut
    np.testing.assert_array_equal(sums, whole(row, 1.0))
    assert sums[-1] > 1, "weights a little above half an ulp move the sum"


@pytest.mark.parametrize("odd", ["nan", "inf", "all banned", "one allowed"])
def test_the_running_sum_of_a_row_with_no_finite_max_or_one_token_is_the_whole_rows(odd: str) -> None:
    row = model_like_row(np.random.default_rng(5), V, 7)
    if odd == "nan":
        row[100] = np.nan
    elif odd == "inf":
        row[100] = np.inf
    elif odd == "all banned":
        row[:] = -np.inf
    else:
        row[:] = -np.inf
        row[200_000] = 1.0
    with np.errstate(invalid="ignore"):
        shortcut, sums = expanded(row, 0.7)
        np.testing.assert_array_equal(sums, whole(row, 0.7))
    assert shortcut == (odd == "one allowed")


def test_model_like_rows_draw_what_the_whole_batch_drew() -> None:
    rng = np.random.default_rng(9)
    temps = [0.7, 1.0, 0.3, 0.9] * 4
    logits = np.stack([model_like_row(rng, V, int(rng.integers(0, V))) for _ in temps])
    mine, theirs = states(17, temps), states(17, temps)
    for _ in range(8):
        assert pick_rows(logits, mine).tolist() == whole_batch_draw(logits, theirs)


@pytest.mark.parametrize("shape", [*ROWS, "zeros both ways", "flat"])
@pytest.mark.parametrize("params", [dict(top_p=0.9, temperature=1.0), dict(top_p=0.99, temperature=2.0),
                                    dict(top_p=0.5, min_p=0.01, temperature=1.5), dict(top_p=0.999999, temperature=1.0)],
                         ids=lambda p: ",".join(f"{k}={v}" for k, v in p.items()))
def test_top_p_past_its_candidates_draws_what_the_whole_rows_sort_drew(shape: str, params: dict,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the first candidates hold too little mass, the whole row by probability, without its stable argsort."""
    rng = np.random.default_rng(len(shape) + 40)
    if shape == "zeros both ways":  # +0 and -0 compare equal: their order is the ids'
        row = np.where(rng.random(V) < 0.5, np.float32(0.0), np.float32(-0.0)).astype(np.float32)
        row[rng.integers(0, V, 300)] = 0.5
    elif shape == "flat":
        row = rng.normal(0, 0.5, size=V).astype(np.float32)
    else:
        row = ROWS[shape](rng)
    calls: list[int] = []
    whole = sampling._by_probability
    monkeypatch.setattr(sampling, "_by_probability", lambda *a: calls.append(1) or whole(*a))
    mine = SamplerState.create(SamplingParams(max_tokens=8, seed=23, **params), 0, V, ())
    theirs = SamplerState.create(SamplingParams(max_tokens=8, seed=23, **params), 0, V, ())
    for _ in range(6):
        assert int(pick_rows(row[None, :], [mine])[0]) == one_row_draw(row, theirs)
    if shape in ("spread", "ties", "zeros both ways", "flat"):
        assert calls, "the first candidates held too little mass: the whole row's path was taken"


def test_by_probability_is_the_stable_sort_where_the_cut_reaches() -> None:
    rng = np.random.default_rng(12)
    for scaled in (np.round(rng.normal(0, 2, V)), rng.normal(0, 1, V), np.where(rng.random(V) < 0.3, -np.inf, 1.0)):
        for top_p in (0.1, 0.9, 0.999999):
            ids, probs = sampling._by_probability(scaled, top_p)
            order = np.argsort(-scaled, kind="stable")
            assert np.array_equal(ids, order[: len(ids)])
            assert np.array_equal(probs, _softmax(scaled[order])[: len(ids)])
