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
