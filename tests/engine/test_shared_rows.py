"""A step's whole-row passes shared with helper threads (engine/sampling.py by_rows): the same results, bit for bit,
as one thread's, a row's exception raised to the caller, and no wait for a helper that stalls."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from servelm.engine import sampling
from servelm.engine.sampling import argmax_rows, by_rows


def test_shared_argmax_is_numpys_with_ties_infinities_and_nan() -> None:
    rng = np.random.default_rng(0)
    rows = rng.normal(0, 3, size=(16, 262144)).astype(np.float32)
    rows[1, [5, 70000, 200000]] = 50.0  # ties at the top: the first wins
    rows[2] = -np.inf
    rows[3, 1234] = np.inf
    rows[4, [99, 100]] = np.nan
    rows[5] = np.round(rows[5])
    assert rows.size >= sampling.SHARE_ELEMENTS
    for _ in range(5):
        got = argmax_rows(rows)
        assert got.dtype == np.intp and got.tolist() == np.argmax(rows, axis=1).tolist()


def test_every_row_is_computed_in_order() -> None:
    seen: list[int] = []
    lock = threading.Lock()

    def fn(i: int) -> int:
        with lock:
            seen.append(i)
        return i * i

    assert by_rows(40, sampling.SHARE_ELEMENTS, fn) == [i * i for i in range(40)]
    assert set(seen) == set(range(40))


def test_a_rows_exception_reaches_the_caller() -> None:
    def fn(i: int) -> int:
        if i == 7:
            raise ValueError("row 7")
        np.argmax(np.ones(200_000, dtype=np.float32))  # some work, the GIL let go
        return i

    with pytest.raises(ValueError, match="row 7"):
        by_rows(64, sampling.SHARE_ELEMENTS, fn)


def test_a_stalled_helper_does_not_hold_the_caller_up() -> None:
    """A helper preempted in the middle of a row (here: blocked) costs the caller that row, computed again, not a
    wait; what the helper writes later goes nowhere."""
    caller, release = threading.get_ident(), threading.Event()

    def fn(i: int) -> int:
        if threading.get_ident() != caller:
            release.wait(5)
        return i + 1

    try:
        assert by_rows(16, sampling.SHARE_ELEMENTS, fn) == list(range(1, 17))
    finally:
        release.set()


def test_settle_waits_for_a_helper_still_reading_rows_after_the_caller_went_on() -> None:
    """The runner gives llama.cpp's logits buffer up only once no helper may still read a step's rows: settle()
    returns once the stalled helper's row is done, not before."""
    if not sampling._pool()[1]:
        pytest.skip("one core: no helper threads")
    caller, release, reading = threading.get_ident(), threading.Event(), threading.Event()

    def fn(i: int) -> int:
        if threading.get_ident() != caller:
            reading.set()
            release.wait(5)
        else:
            time.sleep(0.01)  # so that a helper wakes while rows are left
        return i

    try:
        assert by_rows(16, sampling.SHARE_ELEMENTS, fn) == list(range(16))
        assert reading.wait(5), "a helper took a row"
        settled = threading.Event()
        waiter = threading.Thread(target=lambda: (sampling.settle(), settled.set()))
        waiter.start()
        assert not settled.wait(0.2), "settle() returned while a helper still reads"
        release.set()
        assert settled.wait(5), "settle() returns once the helper is done"
        waiter.join()
    finally:
        release.set()


def test_small_work_stays_on_the_calling_thread() -> None:
    threads = by_rows(8, sampling.SHARE_ELEMENTS - 1, lambda i: threading.get_ident())
    assert set(threads) == {threading.get_ident()}


def test_the_engine_has_a_runner_that_may_give_its_rows_memory_up_settle_the_helpers_first() -> None:
    """LocalEngine hands a runner with a settle_readers hook (runners/llamacpp.py: before a call that may make
    llama.cpp move its logits buffer) the sampler's settle()."""
    from servelm.engine.local import LocalEngine
    from servelm.runners.fake import FakeRunner

    runner = FakeRunner(num_slots=2, max_step_tokens=16)
    runner.settle_readers = lambda: None  # type: ignore[attr-defined]
    LocalEngine(runner)
    assert runner.settle_readers is sampling.settle  # type: ignore[attr-defined]
