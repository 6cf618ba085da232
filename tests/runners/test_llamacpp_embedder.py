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


def test_a_lazy_context_made_while_the_runner_steps_changes_no_logits_row(runner):
    """The context is made on the embedding worker's thread, maybe while the engine's thread steps the same
    weights: every logits row of those steps equals the row stepped with no context being made beside it."""
    import threading

    from servelm.engine.plan import Clear, ScheduledChunk, SeqKey, StepPlan

    prompt = tuple(runner.model.tokenize("The harbour records list every ship that came in, with its cargo.",
                                         add_special=True, parse_special=True))

    def rows() -> list[np.ndarray]:
        runner.step(StepPlan(ops=[Clear(0)]))
        out = []
        for pos in range(len(prompt)):
            got = runner.step(StepPlan(chunks=[ScheduledChunk(SeqKey(0), 0, pos, prompt[pos:pos + 1],
                                                              prompt[pos - 1] if pos else None, (SeqKey(0),))]))
            out.append(got[-1].copy())
        return out

    alone = rows()
    made: list[object] = []

    def embed_lazily() -> None:
        for _ in range(3):
            e = LlamaCppEmbedder(share=runner, pooling="mean", window=256, max_seqs=4, threads=1, lazy=True)
            try:
                made.append(e.embed([e.tokenize("a guitar has six strings")]))
            finally:
                e.close()

    beside = threading.Thread(target=embed_lazily)
    beside.start()
    during = rows()
    beside.join(timeout=60)
    assert len(made) == 3 and all(np.array_equal(m, made[0]) for m in made)
    assert all(np.array_equal(a, b) for a, b in zip(alone, during, strict=True))


@pytest.mark.parametrize("window", [1, 2, 63])
def test_a_window_under_the_pass_s_inputs_embeds_and_does_not_abort_the_process(window):
    """`--chat-embedding-window 1` (or anything under the 64 inputs a pass may carry) made llama.cpp abort the whole
    process (GGML_ASSERT n_outputs_max) where the context was made: at the first embeddings request. A pass carries
    at most as many inputs as it has tokens, so the context is sized for no more."""
    import subprocess
    import sys

    code = (
        "from servelm.config import embedded_model_path\n"
        "from servelm.runners.llamacpp import LlamaCppEmbedder, LlamaCppRunner\n"
        "import numpy as np\n"
        "r = LlamaCppRunner(embedded_model_path(), num_slots=2, max_step_tokens=64, threads=1)\n"
        f"small = LlamaCppEmbedder(share=r, pooling='mean', window={window}, max_seqs=64, threads=1, lazy=True)\n"
        "wide = LlamaCppEmbedder(share=r, pooling='mean', window=256, max_seqs=64, threads=1)\n"
        "ids = small.tokenize('hi')[:1]\n"
        "assert small.max_batch_seqs <= small.max_batch_tokens\n"
        "assert np.array_equal(small.embed([ids]), wide.embed([ids]))\n"
        "print('embedded')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "embedded" in done.stdout, done.stderr[-2000:]
