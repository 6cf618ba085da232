"""Where a model runs: the devices llama.cpp's ggml finds, the --n-gpu-layers and --main-gpu settings, and the
placement /v1/models, /health and the start-up log report. On a machine without a GPU (CI) llama.cpp finds the
CPU alone, whatever it was built with, and every layer is on the CPU."""

from __future__ import annotations

import subprocess
import sys

import pytest

from servelm.config import embedded_embedding_model_path, embedded_model_path
from servelm.runners import llamacpp
from servelm.runners.llamacpp import Device, LlamaCppEmbedder, LlamaCppRunner, LlamaModel, devices, gpus, placement

pytestmark = pytest.mark.skipif(bool(gpus()), reason="these check the CPU-only case; a GPU machine has scripts/gpu_check.sh")


def test_llama_cpp_finds_the_cpu_and_no_gpu_here():
    found = devices()
    assert [d.kind for d in found if d.kind == "cpu"] == ["cpu"], found
    cpu = next(d for d in found if d.kind == "cpu")
    assert cpu.name == "CPU" and cpu.description and cpu.total_bytes > 0
    assert gpus() == []


def test_a_model_loaded_here_runs_on_the_cpu_with_or_without_the_gpu_flag():
    for layers in (-1, 0, 5):
        r = LlamaCppRunner(embedded_model_path(), num_slots=1, context_window=64, max_step_tokens=16, gpu_layers=layers)
        try:
            assert r.placement == "CPU"
        finally:
            r.close()


def test_an_embedding_model_reports_its_placement_too():
    own = LlamaCppEmbedder(embedded_embedding_model_path(), window=64, max_seqs=2, gpu_layers=-1)
    runner = LlamaCppRunner(embedded_model_path(), num_slots=1, context_window=64, max_step_tokens=16)
    shared = LlamaCppEmbedder(share=runner, pooling="mean", window=64, max_seqs=2)
    try:
        assert own.placement == "CPU" and shared.placement == runner.placement == "CPU"
    finally:
        for m in (shared, own, runner):
            m.close()


def test_main_gpu_on_a_machine_without_one_says_so_before_loading():
    with pytest.raises(ValueError, match=r"--main-gpu 0: llama.cpp finds 0 GPUs here"):
        LlamaCppRunner(embedded_model_path(), num_slots=1, context_window=64, max_step_tokens=16, main_gpu=0)


def test_the_placement_names_the_gpu_and_its_share_of_the_layers(monkeypatch):
    """What a GPU machine reports, with llama.cpp's device list stood in for (the model is the CPU's)."""
    h100 = Device("CUDA0", "NVIDIA H100 80GB HBM3", "gpu", 80 << 30, 80 << 30)
    monkeypatch.setattr(llamacpp, "gpus", lambda: [h100])
    m = LlamaModel(embedded_model_path(), gpu_layers=0)
    try:
        layers = m._meta("llama.block_count")
        assert layers is not None
        every = int(layers) + 1  # llama.cpp counts the output layer as one
        assert placement(m._model, -1, None) == f"CUDA0 (NVIDIA H100 80GB HBM3): {every} of {every} layers"
        assert placement(m._model, 10, 0) == f"CUDA0 (NVIDIA H100 80GB HBM3): 10 of {every} layers, the rest on the CPU"
        assert placement(m._model, 0, None) == "CPU"
    finally:
        m.close()


def test_serve_refuses_a_main_gpu_it_has_not_got_in_one_line(tmp_path):
    done = subprocess.run([sys.executable, "-m", "servelm", "serve", "--main-gpu", "0", "--no-embedding-model",
                           "--port", "0"], capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "servelm: --main-gpu 0: llama.cpp finds 0 GPUs here" in done.stderr, done.stderr[-2000:]
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize("flag", [["--n-gpu-layers", "-2"], ["--n-gpu-layers", "5000"], ["--main-gpu", "-1"]])
def test_out_of_range_gpu_flags_are_refused_before_any_load(flag):
    done = subprocess.run([sys.executable, "-m", "servelm", "serve", *flag], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "invalid setting" in done.stderr, done.stderr[-1500:]
