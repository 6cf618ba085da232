"""The flags llama.cpp is compiled with: AMX always off, AVX-512 only where the CPU has it."""

from __future__ import annotations

import importlib.util
from pathlib import Path

_path = Path(__file__).resolve().parents[2] / "scripts" / "llama_cmake_args.py"
_spec = importlib.util.spec_from_file_location("llama_cmake_args", _path)
mod = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(mod)


def test_amx_is_off_even_when_the_cpu_reports_it():
    args = mod.cmake_args({"avx2", "fma", "f16c", "avx512f", "amx_tile", "amx_int8", "amx_bf16"})
    assert {"-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF", "-DGGML_NATIVE=OFF"} <= set(args)
    assert "-DGGML_AVX512=ON" in args


def test_falls_back_to_avx2_without_avx512():
    args = mod.cmake_args(mod.cpu_flags("flags\t: fpu sse avx avx2 fma f16c\n"))
    assert "-DGGML_AVX2=ON" in args and "-DGGML_AVX512=OFF" in args and "-DGGML_AVX512_VNNI=OFF" in args


def test_cuda_follows_a_listed_gpu_not_the_compiler():
    assert mod.cuda_args({}, "") == []  # nvcc may be installed: without a listed GPU the build stays CPU-only
    assert mod.cuda_args({}, "9.0\n") == ["-DGGML_CUDA=ON", "-DCMAKE_CUDA_ARCHITECTURES=90"]
    assert mod.cuda_args({}, "8.6\n9.0\n8.6\n") == ["-DGGML_CUDA=ON", "-DCMAKE_CUDA_ARCHITECTURES=86;90"]
    assert mod.cuda_args({}, "No devices were found\n") == []


def test_cuda_on_request_and_off_on_request():
    assert mod.cuda_args({"SERVELM_CUDA": "1"}, "") == ["-DGGML_CUDA=ON",
                                                        f"-DCMAKE_CUDA_ARCHITECTURES={mod.DEFAULT_CUDA_ARCHITECTURES}"]
    assert mod.cuda_args({"SERVELM_CUDA": "1", "SERVELM_CUDA_ARCHITECTURES": "89"}, "") == [
        "-DGGML_CUDA=ON", "-DCMAKE_CUDA_ARCHITECTURES=89"]
    assert mod.cuda_args({"SERVELM_CUDA": "0"}, "9.0\n") == []


def test_no_nvidia_smi_lists_no_gpu(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # no nvidia-smi on the PATH
    assert mod.listed_gpus() == ""
    smi = tmp_path / "nvidia-smi"  # one that fails (a driver that is not loaded)
    smi.write_text("#!/bin/sh\necho 'NVIDIA-SMI has failed'; exit 9\n")
    smi.chmod(0o755)
    assert mod.listed_gpus() == ""
    smi.write_text("#!/bin/sh\nprintf '\\377\\376\\n'\n")  # bytes that are not UTF-8: no GPU, no crash
    assert mod.cuda_args({}, mod.listed_gpus()) == []
    smi.write_text("#!/bin/sh\necho 9.0\n")
    assert mod.cuda_args({}, mod.listed_gpus()) == ["-DGGML_CUDA=ON", "-DCMAKE_CUDA_ARCHITECTURES=90"]


def test_a_cuda_builds_cpu_part_is_for_avx2_as_the_build_that_ran_on_the_gpu_machines():
    flags = {"avx2", "fma", "f16c", "avx512f", "avx512_vnni", "avx512_bf16"}
    args = mod.all_args(flags, {}, "9.0\n")
    assert "-DGGML_CUDA=ON" in args and "-DGGML_AVX2=ON" in args
    assert {"-DGGML_AVX512=OFF", "-DGGML_AVX512_VNNI=OFF", "-DGGML_AVX512_BF16=OFF"} <= set(args)
    assert "-DGGML_AVX512=ON" in mod.all_args(flags, {}, "")  # without a GPU, the CPU's own
