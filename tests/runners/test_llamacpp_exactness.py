"""The llama.cpp runner's fences, on real model files (issue 31), each forcing the shape that moved answers:
- F16 weights: a call of one row (a lone decode step, or a prompt chunk whose only logits row is its last) took
  ggml's one-row dot product, two rows or more llamafile's tinyBLAS; they round differently. pair_rows makes every
  call two rows and two logits rows.
- Q4_K weights: llama.cpp's repacked buffers compute rows in groups of four (a gemm) and the rest one by one (a
  gemv), so a row's logits depended on how many rows shared its call. repack=False loads them plain.
- ggml's tiled K-quant matmul (8 rows or more) is off for the process (GGML_CPU_TILED_MM=0, set on import).
- Or fences by shape: the fast kernels kept, every micro-batch (and its logits rows) given a shape that takes one
  path: repacked Q4_K in rows by 4 (all by the gemm), and with the tiled kernel on, 8 rows or more.
Then load_exact picks the cheapest fence that passes, and says so."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from servelm.config import embedded_model_path
from servelm.runners.llamacpp import MAX_ROWS, Fence, LlamaCppRunner, load_exact
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


@pytest.mark.timeout(900)  # two self-checks; minutes on a busy 2-core machine
def test_repacked_q4_k_weights_are_exact_read_in_rows_by_four_and_not_in_pairs():
    """The repacked gemm takes rows in groups of four and the gemv the rest: rows by 4 (pads after a stream's last
    row) keep every row on the gemm; pairs of rows are all gemv, which a 24-row chunk is not."""
    r = runner(requantize.requantize("Q4_K_M"))
    try:
        r.set_fence(Fence(min_rows=2, multiple=2))
        assert "differ" in check_exactness(r)
        r.set_fence(Fence(min_rows=4, multiple=4))
        assert check_exactness(r) == ""
        assert r.max_rows == MAX_ROWS // 4 * 4 and r.context_window == 256 - 3, "room for a stream's pads"
        r.set_fence(Fence())
        assert (r.max_rows, r.context_window) == (MAX_ROWS, 256)
    finally:
        r.close()


def _in_a_process(code: str, tiled: str) -> subprocess.CompletedProcess[str]:
    """`code` in a Python process of its own whose ggml reads GGML_CPU_TILED_MM=`tiled` (once, for the process)."""
    return subprocess.run([sys.executable, "-c", code], env={**os.environ, "GGML_CPU_TILED_MM": tiled},
                          capture_output=True, text=True, timeout=900)


@pytest.mark.timeout(900)
def test_with_the_tiled_kernel_on_a_k_quant_model_is_fenced_by_shape():
    """GGML_CPU_TILED_MM=1: Q4_K_M's Q6_K and Q4_K weights take the tiled kernel from 8 rows on; every micro-batch
    8 rows or more (and repacked Q4_K in rows by 4) keeps each row on one kernel."""
    path = requantize.requantize("Q4_K_M")
    proc = _in_a_process("from servelm.runners.llamacpp import SHAPE_FENCES, load_exact\n"
                         f"r = load_exact({str(path)!r}, SHAPE_FENCES, num_slots=12, context_window=256)\n"
                         "print(r.exactness.describe())", "1")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1].startswith("exact (fences: ") and "8 rows or more" in proc.stdout


def test_the_tiled_switch_is_0_or_1():
    proc = _in_a_process("import servelm.runners.llamacpp", "yes")
    assert proc.returncode != 0 and "GGML_CPU_TILED_MM='yes'" in proc.stderr


@pytest.mark.parametrize("kind, fences", [("Q4_1", ()), ("Q4_K_M", ("no repacked weights",)),
                                          ("F16", ("two rows a call",))])
@pytest.mark.slow
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
        paired = r.state_fingerprint
        tiles, r.tile_rows = r.tile_rows, 0  # a prompt's first cells read in rows, not tiles (--prompt-tiles)
        assert tiles and r.state_fingerprint != paired, "a file written with tiles is not read without them"
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
        prompt = tuple(r.model.tokenize("The harbour records list every ship that came in, with its cargo.",
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
