"""The llama.cpp runner's fences, on real model files (issue 31), each forcing the shape that moved answers:
- F16 weights: a call of one row (a lone decode step, or a prompt chunk whose only logits row is its last) took
  ggml's one-row dot product, two rows or more llamafile's tinyBLAS; they round differently. pair_rows makes every
  call two rows and two logits rows.
- Q4_K weights: llama.cpp's repacked buffers compute rows in groups of four (a gemm) and the rest one by one (a
  gemv), so a row's logits depended on how many rows shared its call. repack=False loads them plain.
- ggml's tiled K-quant matmul (8 rows or more) is off for the process (GGML_CPU_TILED_MM=0, set on import).
Then load_exact picks the fewest fences that pass, and says so."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

from servelm.config import embedded_model_path
from servelm.runners.llamacpp import LlamaCppRunner, load_exact
from servelm.runners.selfcheck import check_exactness

pytestmark = pytest.mark.e2e

_spec = importlib.util.spec_from_file_location("requantize", Path(__file__).resolve().parents[2] / "scripts" / "requantize.py")
requantize = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(requantize)


def runner(path, **kw) -> LlamaCppRunner:
    return LlamaCppRunner(path, num_slots=12, context_window=256, **kw)


def test_the_tiled_k_quant_kernel_is_off_for_the_process():
    assert os.environ["GGML_CPU_TILED_MM"] == "0"


def test_f16_weights_round_a_lone_row_otherwise_unless_every_call_is_two_rows():
    path = requantize.requantize("F16")
    r = runner(path)
    try:
        assert "a token a step, alone" in check_exactness(r)
        r.set_pair_rows(True)
        assert check_exactness(r) == ""
    finally:
        r.close()


def test_repacked_q4_k_weights_round_by_rows_and_plain_ones_do_not():
    path = requantize.requantize("Q4_K_M")
    r = runner(path)
    try:
        assert check_exactness(r) != ""
    finally:
        r.close()
    r = runner(path, repack=False)
    try:
        assert check_exactness(r) == ""
    finally:
        r.close()


@pytest.mark.parametrize("kind, fences", [("Q4_1", ()), ("Q4_K_M", ("no repacked weights",)),
                                          ("F16", ("two rows a call",))])
def test_load_exact_takes_the_fewest_fences_that_pass(kind, fences):
    r = load_exact(requantize.requantize(kind), num_slots=12, context_window=256)
    try:
        assert r.exactness.exact and r.exactness.fences == fences
        assert r.repack == ("no repacked weights" not in fences) and r.pair_rows == ("two rows a call" in fences)
        assert check_exactness(r) == "", "the fences chosen hold on a second look"
    finally:
        r.close()


def test_a_saved_state_is_another_build_s_under_other_fences():
    """Cells computed under other fences round otherwise: the spill's files must not mix them."""
    r = runner(embedded_model_path())
    try:
        plain = r.state_fingerprint
        r.set_pair_rows(True)
        assert r.state_fingerprint != plain
    finally:
        r.close()


def test_a_lora_adapters_call_is_two_rows_so_any_chunking_reads_the_same(tmp_path):
    """Issue 36: an adapter's F32 matmuls took ggml's one-row dot product in a one-row call, as F16 weights do, so
    a prompt read a token a call (or a lone decode step) under an adapter rounded otherwise than one read in
    chunks, and greedy answers among other requests moved. A call with adapters is now two rows always."""
    import subprocess
    import sys

    import numpy as np

    from servelm.engine.plan import Clear, ScheduledChunk, SeqKey, StepPlan

    adapter = tmp_path / "lora.gguf"
    subprocess.run([sys.executable, str(Path(__file__).resolve().parents[2] / "scripts" / "make_test_lora.py"),
                    str(adapter)], check=True, capture_output=True)
    r = runner(embedded_model_path())
    try:
        r.load_adapter("a", str(adapter))
        prompt = tuple(r.tokenize("The harbour records list every ship that came in, with its cargo.",
                                  add_special=True, parse_special=True))

        def last_row(size: int, adapters: tuple) -> np.ndarray:
            r.step(StepPlan(ops=[Clear(0)]))
            for pos in range(0, len(prompt), size):
                part = prompt[pos: pos + size]
                last = pos + len(part) == len(prompt)
                out = r.step(StepPlan(chunks=[ScheduledChunk(SeqKey(0), 0, pos, part, prompt[pos - 1] if pos else None,
                                                             (SeqKey(0),) if last else (), adapters=adapters)]))
            return out[-1].copy()

        on = (("a", 1.0),)
        whole = last_row(len(prompt), on)
        assert not np.array_equal(whole, last_row(len(prompt), ())), "the adapter changes the logits"
        for size in (1, 2, 5):
            assert np.array_equal(last_row(size, on), whole), size
    finally:
        r.close()
