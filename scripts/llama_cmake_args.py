"""Print the CMAKE_ARGS that llama.cpp is compiled with on this machine.

One source for both llama-cpp-python's wheel (make install) and the llama-server that the benchmark
builds, so the two are compared on the same kernels. AMX is always off: these Intel machines report
AMX, but ggml's AMX matmul crashes on them (SIGILL/SIGSEGV). AVX-512 is used where the CPU has it,
otherwise AVX2.

CUDA is on where a GPU is there to use it: `nvidia-smi` lists one (the build is for its compute capability), or
SERVELM_CUDA=1 asks for it (for SERVELM_CUDA_ARCHITECTURES, default 80;86;89;90, when no GPU is listed).
SERVELM_CUDA=0 keeps the build CPU-only. A CUDA compiler alone decides nothing: many machines have nvcc and no GPU.
A CUDA build compiles ggml's CPU part for AVX2, as the build that ran on the GPU machines was: with every layer on
the GPU it computes almost nothing, and a build for the GPU host's own AVX-512 crashed at a model's load there
(docs/exactness.md, "On a GPU").
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

DEFAULT_CUDA_ARCHITECTURES = "80;86;89;90"
AVX512_FLAGS = {"avx512f", "avx512_vnni", "avx512_bf16"}


def cpu_flags(cpuinfo: str) -> set[str]:
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def cmake_args(flags: set[str]) -> list[str]:
    on = lambda name, flag: f"-DGGML_{name}={'ON' if flag in flags else 'OFF'}"  # noqa: E731
    args = ["-DGGML_NATIVE=OFF", on("AVX2", "avx2"), on("FMA", "fma"), on("F16C", "f16c")]
    args += [on("AVX512", "avx512f"), on("AVX512_VNNI", "avx512_vnni"), on("AVX512_BF16", "avx512_bf16")]
    args += ["-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF", "-DLLAMA_CURL=OFF"]
    return args


def listed_gpus() -> str:
    """nvidia-smi's compute capabilities, a line per GPU ("9.0"); "" where it is missing, fails or lists none."""
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader"],
                              capture_output=True, text=True, errors="replace", timeout=30, check=False)
    except (OSError, subprocess.SubprocessError):
        return ""
    return done.stdout if done.returncode == 0 else ""


def cuda_args(env: Mapping[str, str], gpus: str) -> list[str]:
    """The CUDA part of the arguments: none unless a GPU is listed (`gpus`: nvidia-smi's compute capabilities)
    or SERVELM_CUDA=1 asks; SERVELM_CUDA=0 turns it off whatever is listed."""
    want = env.get("SERVELM_CUDA", "").strip()
    if want == "0":
        return []
    caps = sorted({line.strip().replace(".", "") for line in gpus.splitlines()
                   if line.strip().replace(".", "").isdigit()})
    if not caps and want != "1":
        return []
    archs = env.get("SERVELM_CUDA_ARCHITECTURES", "").strip() or ";".join(caps) or DEFAULT_CUDA_ARCHITECTURES
    return ["-DGGML_CUDA=ON", f"-DCMAKE_CUDA_ARCHITECTURES={archs}"]


def all_args(flags: set[str], env: Mapping[str, str], gpus: str) -> list[str]:
    """The CPU's arguments and CUDA's; a CUDA build's CPU part for AVX2 (the module's docstring says why)."""
    cuda = cuda_args(env, gpus)
    return cmake_args(flags - AVX512_FLAGS if cuda else flags) + cuda


def main() -> int:
    path = Path("/proc/cpuinfo")
    flags = cpu_flags(path.read_text()) if path.exists() else set()
    gpus = listed_gpus() if os.environ.get("SERVELM_CUDA", "").strip() != "0" else ""
    print(" ".join(all_args(flags, os.environ, gpus)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
