"""The start-up self-check (runners/selfcheck.py): on the fake runner, whose rows depend on their token alone, and on
fakes whose rows depend on what shares their step, as some of ggml's kernels' do."""

from __future__ import annotations

import numpy as np
import pytest

from servelm.config import embedded_model_path
from servelm.engine.plan import StepPlan
from servelm.engine.runner import Exactness
from servelm.runners.fake import FakeRunner
from servelm.runners.selfcheck import check_exactness


class _RoundsByRows(FakeRunner):
    """A row computed in a step of exactly `rows` tokens rounds otherwise (as a kernel chosen by rows would)."""

    def __init__(self, rows: int, **kw) -> None:
        super().__init__(**kw)
        self.rows = rows

    def step(self, plan: StepPlan) -> np.ndarray:
        out = super().step(plan)
        return out + np.float32(1e-3) if plan.num_tokens == self.rows else out


class _RoundsBySlot(FakeRunner):
    def step(self, plan: StepPlan) -> np.ndarray:
        out = super().step(plan)
        return out + np.float32(1e-3) if any(c.slot == self.num_slots - 1 for c in plan.chunks) else out


def test_a_runner_whose_rows_depend_on_their_tokens_alone_is_exact():
    runner = FakeRunner(num_slots=12, vocab_size=500)
    assert check_exactness(runner) == ""
    assert runner.cells == {} or all(not c for c in runner.cells.values()), "the check leaves its slots empty"


@pytest.mark.parametrize("rows, shape", [(1, "a token a step, alone"), (10, "beside 9 other sequences"),
                                         (5, "in chunks of 5/1/7/11 in slot 11")])
def test_a_row_that_rounds_by_what_shares_its_step_is_found(rows, shape):
    reason = check_exactness(_RoundsByRows(rows, num_slots=12, vocab_size=500))
    assert shape in reason and "differ" in reason


def test_a_row_that_rounds_by_its_slot_is_found():
    assert "slot 11" in check_exactness(_RoundsBySlot(num_slots=12, vocab_size=500))


def test_with_one_slot_only_the_shapes_one_slot_makes_are_checked():
    assert check_exactness(FakeRunner(num_slots=1, vocab_size=500)) == ""


def test_what_the_check_found_reads_as_the_server_reports_it():
    assert Exactness(True).describe() == "exact"
    assert Exactness(True, fences=("no repacked weights",)).describe() == "exact (fences: no repacked weights)"
    assert Exactness(False, reason="x differs").describe() == "NOT exact: x differs"
    assert Exactness(False, checked=False).describe() == "not checked"


def test_load_exact_checks_on_a_thread_that_ends(monkeypatch) -> None:
    """The start-up check computes on a thread of its own that ends with it, never on the caller's (OpenMP would keep
    a second team of workers for the caller's thread, and the engine's passes would pay for it: docs/performance.md)."""
    import threading

    from servelm.runners import llamacpp

    ran_on: list[threading.Thread] = []

    def check(runner) -> str:
        ran_on.append(threading.current_thread())
        return ""

    monkeypatch.setattr(llamacpp, "check_exactness", check)
    runner = llamacpp.load_exact(embedded_model_path(), num_slots=2, context_window=256)
    try:
        assert runner.exactness.exact and len(ran_on) == 1
        assert ran_on[0] is not threading.current_thread() and not ran_on[0].is_alive()
    finally:
        runner.close()
