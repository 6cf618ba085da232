"""A step's whole-row passes shared with helper threads (engine/sampling.py by_rows): the same results, bit for bit,
as one thread's, each row computed once, a row's exception raised to the caller once every row is let go."""

from __future__ import annotations

import threading

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


def test_every_row_is_computed_once_in_order() -> None:
    seen: list[int] = []
    lock = threading.Lock()

    def fn(i: int) -> int:
        with lock:
            seen.append(i)
        return i * i

    assert by_rows(40, sampling.SHARE_ELEMENTS, fn) == [i * i for i in range(40)]
    assert sorted(seen) == list(range(40))


def test_a_rows_exception_reaches_the_caller_once_no_row_runs() -> None:
    running = [0]
    lock = threading.Lock()

    def fn(i: int) -> int:
        with lock:
            running[0] += 1
        try:
            if i == 7:
                raise ValueError("row 7")
            np.argmax(np.ones(200_000, dtype=np.float32))  # some work, the GIL let go
            return i
        finally:
            with lock:
                running[0] -= 1

    with pytest.raises(ValueError, match="row 7"):
        by_rows(64, sampling.SHARE_ELEMENTS, fn)
    assert running[0] == 0, "no helper still reads a row when the caller goes on"


def test_small_work_stays_on_the_calling_thread() -> None:
    threads = by_rows(8, sampling.SHARE_ELEMENTS - 1, lambda i: threading.get_ident())
    assert set(threads) == {threading.get_ident()}
