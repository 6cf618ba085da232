from __future__ import annotations

import numpy as np

from servelm.engine.sampling import SamplerState, sample_rows
from servelm.engine.types import SamplingParams

V = 1000
EOG = np.array([0], dtype=np.int64)


def logits(seed: int = 0, rows: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).normal(0, 3, size=(rows, V)).astype(np.float32)


def state(index: int = 0, prompt: tuple[int, ...] = (), **kw) -> SamplerState:
    return SamplerState.create(SamplingParams(max_tokens=16, **kw), index, V, prompt)


def draw(st: SamplerState, row: np.ndarray) -> int:
    return int(sample_rows(row[None, :].copy(), [st], EOG)[0])


def test_greedy_is_argmax():
    x = logits(rows=3)
    out = sample_rows(x.copy(), [state(temperature=0.0) for _ in range(3)], EOG)
    assert list(out) == list(np.argmax(x, axis=1))


def test_logit_bias_bans_and_forces():
    x = logits()[0]
    best = int(np.argmax(x))
    assert draw(state(temperature=0.0, logit_bias=((best, -100.0),)), x) != best
    assert draw(state(temperature=1.0, seed=1, logit_bias=((7, 100.0),)), x) == 7


def test_seed_gives_the_same_draws_wherever_the_row_sits_in_the_batch():
    x = logits(3)[0]
    solo = [draw(st, x) for st in [state(temperature=1.0, seed=42)] for _ in range(1)]
    st_a = state(temperature=1.0, seed=42)
    seq_solo = [draw(st_a, x) for _ in range(20)]
    st_b = state(temperature=1.0, seed=42)
    others = [state(temperature=1.0) for _ in range(5)]
    seq_batched = []
    for _ in range(20):
        batch = np.stack([x] * 6)
        out = sample_rows(batch, [*others[:3], st_b, *others[3:]], EOG)
        seq_batched.append(int(out[3]))
    assert seq_solo == seq_batched and solo[0] == seq_solo[0]
    assert len(set(seq_solo)) > 1, "temperature 1 over a spread distribution draws different tokens"


def test_choices_of_one_seed_differ_from_each_other():
    x = logits(4)[0]
    draws = [[draw(st, x) for _ in range(10)] for st in (state(i, temperature=1.0, seed=9) for i in range(3))]
    assert draws[0] != draws[1] != draws[2]


def test_top_k_one_and_tiny_top_p_are_greedy():
    x = logits(5)[0]
    best = int(np.argmax(x))
    assert all(draw(state(temperature=1.5, seed=s, top_k=1), x) == best for s in range(10))
    assert all(draw(state(temperature=1.5, seed=s, top_p=1e-6), x) == best for s in range(10))


def test_top_k_keeps_draws_among_the_k_best():
    x = logits(6)[0]
    top = set(np.argsort(-x)[:5].tolist())
    assert all(draw(state(temperature=2.0, seed=s, top_k=5), x) in top for s in range(50))


def test_top_p_keeps_the_nucleus():
    x = np.full(V, -20.0, dtype=np.float32)
    x[[3, 4, 5]] = [5.0, 4.9, 4.8]  # three tokens share almost all the mass
    assert all(draw(state(temperature=1.0, seed=s, top_p=0.9), x) in (3, 4, 5) for s in range(50))


def test_min_p_drops_unlikely_tokens():
    x = np.zeros(V, dtype=np.float32)
    x[10] = 8.0
    x[11] = 7.5
    out = {draw(state(temperature=1.0, seed=s, min_p=0.1), x) for s in range(100)}
    assert out <= {10, 11} and out == {10, 11}


def test_penalties_push_away_from_seen_tokens():
    x = np.zeros(V, dtype=np.float32)
    x[5] = 2.0
    x[6] = 1.9
    st = state(temperature=0.0, frequency_penalty=1.0)
    assert draw(st, x) == 5
    st.record(5)
    assert draw(st, x) == 6
    rep = state(temperature=0.0, repetition_penalty=2.0, prompt=(5,))
    assert draw(rep, x) == 6, "repetition_penalty counts the prompt's tokens too"
    pres = state(temperature=0.0, presence_penalty=0.5)
    pres.record(5)
    assert draw(pres, x) == 6


def test_min_tokens_and_ignore_eos_ban_end_of_generation():
    x = np.zeros(V, dtype=np.float32)
    x[0] = 10.0
    assert draw(state(temperature=0.0), x) == 0
    assert draw(state(temperature=0.0, min_tokens=2), x) != 0
    assert draw(state(temperature=0.0, ignore_eos=True), x) != 0
