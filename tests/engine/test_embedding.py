"""EmbeddingEngine over the fake embedding model: batching across requests, limits, order, failures."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest

from servelm.engine.embedding import EmbeddingEngine, EmbeddingError
from servelm.runners.fake import FakeEmbedder


@pytest.fixture
def model() -> FakeEmbedder:
    return FakeEmbedder(max_batch_tokens=20, max_batch_seqs=3, context_window=16)


@pytest.fixture
def engine(model: FakeEmbedder):
    e = EmbeddingEngine(model)
    e.start()
    yield e
    e.stop()


def expected(model: FakeEmbedder, inputs: list[list[int]]) -> np.ndarray:
    return np.stack([model.vector_of(ids, model.dim) for ids in inputs])


async def test_one_request_comes_back_in_order(engine, model):
    inputs = [[1, 2, 3], [4, 5], [6], [7, 8, 9, 10]]
    out = await engine.embed(inputs)
    assert out.shape == (4, model.dim)
    np.testing.assert_array_equal(out, expected(model, inputs))


async def test_passes_respect_the_token_budget_and_the_sequence_count(engine, model):
    inputs = [[5] * n for n in (9, 9, 3, 1, 1, 1, 16, 2)]
    out = await engine.embed(inputs)
    np.testing.assert_array_equal(out, expected(model, inputs))
    for p in model.passes:
        assert len(p) <= 3 and sum(map(len, p)) <= 20
    # arrival order is kept: [9, 9] then [3, 1, 1] (three inputs) then [1, 16, 2]
    assert [[len(ids) for ids in p] for p in model.passes] == [[9, 9], [3, 1, 1], [1, 16, 2]]


async def test_requests_that_arrive_together_share_passes(model):
    model.delay = 0.05
    engine = EmbeddingEngine(model)
    engine.start()
    try:
        # the first request keeps the worker busy while the others queue; then they go in one pass
        first = asyncio.ensure_future(engine.embed([[1] * 10]))
        await asyncio.sleep(0.01)
        rest = [engine.embed([[2 + i, 3]]) for i in range(3)]
        results = await asyncio.gather(first, *rest)
    finally:
        engine.stop()
    assert len(model.passes) == 2
    assert sorted(ids[0] for ids in model.passes[1]) == [2, 3, 4]
    for i, r in enumerate(results[1:]):
        np.testing.assert_array_equal(r, expected(model, [[2 + i, 3]]))


async def test_vectors_do_not_depend_on_the_neighbours(engine, model):
    alone = await engine.embed([[7, 8, 9]])
    together = await engine.embed([[1], [7, 8, 9], [3, 3]])
    np.testing.assert_array_equal(alone[0], together[1])


async def test_too_long_or_empty_inputs_are_refused_before_queueing(engine, model):
    with pytest.raises(ValueError):
        await engine.embed([[1] * 17])
    with pytest.raises(ValueError):
        await engine.embed([[]])
    assert model.passes == []
    assert (await engine.embed([])).shape == (0, model.dim)


async def test_a_failing_pass_fails_its_requests_and_the_engine_goes_on(engine, model):
    model.fail_next = True
    with pytest.raises(EmbeddingError):
        await engine.embed([[1, 2]])
    out = await engine.embed([[1, 2]])
    np.testing.assert_array_equal(out, expected(model, [[1, 2]]))
    assert engine.alive


async def test_a_cancelled_request_drops_its_queued_inputs(model):
    model.delay = 0.05
    engine = EmbeddingEngine(model)
    engine.start()
    try:
        busy = asyncio.ensure_future(engine.embed([[1]]))
        await asyncio.sleep(0.01)
        doomed = asyncio.ensure_future(engine.embed([[9]] * 12))
        await asyncio.sleep(0.01)
        doomed.cancel()
        await busy
        await asyncio.sleep(0.1)
        assert engine.stats().waiting == 0
    finally:
        engine.stop()
    assert sum(len(p) for p in model.passes) < 13  # at most the pass in flight ran


async def test_stats_count_passes_and_inputs(engine):
    await engine.embed([[1], [2], [3], [4]])
    s = engine.stats()
    assert (s.running, s.waiting, s.inputs) == (0, 0, 4) and s.passes == 2


async def test_stop_fails_what_waits(model):
    engine = EmbeddingEngine(model)  # never started: requests wait
    task = asyncio.ensure_future(engine.embed([[1]]))
    await asyncio.sleep(0.01)
    engine.stop()
    with pytest.raises(EmbeddingError):
        await task


async def test_the_worker_ends_when_the_queue_is_empty_and_the_next_input_starts_another(engine, model):
    """No thread that once computed outlives its work (OpenMP keeps a spinning team per such thread, which slows
    every other engine's passes): each burst of work gets a worker that ends with it."""
    seen: list[threading.Thread] = []
    embed = model.embed

    def recording(inputs):
        seen.append(threading.current_thread())
        return embed(inputs)

    model.embed = recording
    await engine.embed([[1, 2]])
    first = seen[-1]
    first.join(timeout=5)
    assert not first.is_alive(), "the worker ended once the queue was empty"
    assert engine.alive, "an engine without a worker is still up: the next input starts one"
    await engine.embed([[3, 4]])
    assert seen[-1] is not first and seen[-1] is not threading.current_thread()
    assert np.array_equal(await engine.embed([[5]]), expected(model, [[5]]))
    engine.stop()
    assert not engine.alive
    with pytest.raises(EmbeddingError):
        await engine.embed([[6]])
