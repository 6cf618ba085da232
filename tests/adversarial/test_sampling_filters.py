"""Sampling filters that remove nothing draw as no filter does. A black-box attack found `top_k` 49152 (SmolLM2's
whole vocabulary) or 2147483647 giving another text, for the same seed, than the same request without `top_k`: such
a row was drawn on the float64 path of filtered rows instead of the float32 one of temperature-only rows."""

from __future__ import annotations

import numpy as np
import pytest

from servelm.engine.sampling import SamplerState, pick_rows
from servelm.engine.types import SamplingParams

V = 4096


def draws(seed: int, temperature: float, **filters) -> list[int]:
    row = np.random.default_rng(seed).normal(0, 3, size=(1, V)).astype(np.float32)
    st = SamplerState.create(SamplingParams(max_tokens=8, temperature=temperature, seed=seed, **filters), 0, V, ())
    return [int(pick_rows(row.copy(), [st])[0]) for _ in range(8)]


@pytest.mark.parametrize("top_k", [V, V + 1, 2**31 - 1])
def test_a_top_k_of_the_whole_vocabulary_draws_as_none(top_k: int) -> None:
    for seed in range(24):
        for temperature in (0.7, 1.0, 2.0):
            assert draws(seed, temperature, top_k=top_k) == draws(seed, temperature), (seed, temperature)
