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


class _Counted:
    """check_exactness as load_exact calls it, counted; `reason` "" passes every fence, else none."""

    def __init__(self, reason: str = "") -> None:
        self.calls = 0
        self.reason = reason

    def __call__(self, runner) -> str:
        self.calls += 1
        runner.tile_seconds = 0.25
        return self.reason


def _load(monkeypatch, check: _Counted, memo_dir, **kw):
    from servelm.runners import llamacpp

    monkeypatch.setattr(llamacpp, "check_exactness", check)
    runner = llamacpp.load_exact(embedded_model_path(), memo_dir=memo_dir, num_slots=2, context_window=256, **kw)
    found = (runner.exactness, runner.fence, runner.tile_rows, runner.tile_seconds)
    runner.close()
    return found


def test_a_restart_on_the_same_model_settings_and_build_takes_the_kept_finding(monkeypatch, tmp_path) -> None:
    check = _Counted()
    first = _load(monkeypatch, check, tmp_path)
    again = _load(monkeypatch, check, tmp_path)
    assert check.calls == 1, "the second load read the probe again"
    assert again == first and first[0].exact and first[3] == 0.25, (first, again)
    assert len(list(tmp_path.glob("*.json"))) == 1


def test_another_setting_checks_again_and_keeps_both(monkeypatch, tmp_path) -> None:
    check = _Counted()
    _load(monkeypatch, check, tmp_path, threads=1)
    _load(monkeypatch, check, tmp_path, threads=2)
    _load(monkeypatch, check, tmp_path, threads=1, kv_cache_type="q8_0")
    assert check.calls == 3
    _load(monkeypatch, check, tmp_path, threads=2)
    assert check.calls == 3 and len(list(tmp_path.glob("*.json"))) == 3


def test_a_model_found_not_exact_is_remembered_as_not_exact(monkeypatch, tmp_path) -> None:
    check = _Counted("position 3 differs")
    first = _load(monkeypatch, check, tmp_path)
    tried = check.calls
    again = _load(monkeypatch, check, tmp_path)
    assert check.calls == tried and not again[0].exact and again[0].reason == "position 3 differs" == first[0].reason


def test_without_a_memo_every_load_checks(monkeypatch) -> None:
    check = _Counted()
    _load(monkeypatch, check, None)
    _load(monkeypatch, check, None)
    assert check.calls == 2


def test_a_rebuilt_library_or_another_code_is_another_key(tmp_path) -> None:
    from servelm.runners.selfcheck import CheckMemo

    lib = tmp_path / "libllama.so"
    lib.write_bytes(b"x")
    one = CheckMemo(tmp_path, {"model": "m"}, [lib]).key
    assert CheckMemo(tmp_path, {"model": "m"}, [lib]).key == one
    lib.write_bytes(b"xy")
    assert CheckMemo(tmp_path, {"model": "m"}, [lib]).key != one
    assert CheckMemo(tmp_path, {"model": "n"}, [lib]).key != CheckMemo(tmp_path, {"model": "m"}, [lib]).key


def test_a_variable_that_chooses_kernels_is_another_key(tmp_path, monkeypatch) -> None:
    from servelm.runners.selfcheck import CheckMemo

    monkeypatch.delenv("GGML_CPU_TILED_MM", raising=False)
    one = CheckMemo(tmp_path, {"model": "m"}, []).key
    monkeypatch.setenv("GGML_CPU_TILED_MM", "1")
    tiled = CheckMemo(tmp_path, {"model": "m"}, []).key
    assert tiled != one
    monkeypatch.setenv("SERVELM_TEST_UNRELATED", "1")
    assert CheckMemo(tmp_path, {"model": "m"}, []).key == tiled, "a variable of no kernel's changed the key"


def test_a_tiles_pass_is_timed_whatever_the_slots_and_the_step() -> None:
    """A server of --max-step-tokens 32 (or 2 slots) left its tiles untimed, and --prompt-tiles auto decided for
    it otherwise than for the same model on default flags: their answers differed in the last bits."""
    for kw in ({"num_slots": 2}, {"num_slots": 12, "max_step_tokens": 32}):
        runner = FakeRunner(vocab_size=500, tile_rows=64, context_window=256, **kw)
        runner.tile_seconds = 0.0
        assert check_exactness(runner) == "" and runner.tile_seconds > 0, kw
