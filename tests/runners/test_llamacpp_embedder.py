"""A chat model's embedding context made at its first pass (`lazy`): nothing made before, the same vectors after."""

from __future__ import annotations

import numpy as np
import pytest

from servelm.config import embedded_model_path
from servelm.runners.llamacpp import LlamaCppEmbedder, LlamaCppRunner


@pytest.fixture(scope="module")
def runner():
    r = LlamaCppRunner(embedded_model_path(), num_slots=2, max_step_tokens=64, threads=1)
    yield r
    r.close()


def test_a_lazy_context_is_made_at_its_first_pass_and_embeds_as_one_made_at_load(runner):
    lazy = LlamaCppEmbedder(share=runner, pooling="mean", window=256, max_seqs=4, threads=1, lazy=True)
    eager = LlamaCppEmbedder(share=runner, pooling="mean", window=256, max_seqs=4, threads=1)
    try:
        assert lazy._ctx is None  # no context, no compute buffers, until a pass needs them
        assert (lazy.dim, lazy.vocab_size, lazy.context_window, lazy.cross_encoder) == \
            (eager.dim, eager.vocab_size, eager.context_window, eager.cross_encoder)
        inputs = [lazy.tokenize("a guitar has six strings"), lazy.tokenize("hello")]
        first = lazy.embed(inputs)
        assert lazy._ctx is not None
        assert np.array_equal(first, eager.embed(inputs))
        assert np.array_equal(lazy.embed(inputs), first)  # the context it made is the one it keeps
    finally:
        lazy.close()
        eager.close()
    lazy.close()  # a second close does nothing


def test_a_lazy_context_needs_its_pooling_named(runner):
    with pytest.raises(ValueError, match="pooling"):
        LlamaCppEmbedder(share=runner, window=256, lazy=True)


def test_a_lazy_context_closed_before_any_pass_frees_nothing_of_the_runner(runner):
    LlamaCppEmbedder(share=runner, pooling="mean", window=256, max_seqs=4, threads=1, lazy=True).close()
    assert runner.model._model  # the shared weights stay the runner's
