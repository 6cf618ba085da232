"""Print the CMAKE_ARGS that llama.cpp is compiled with on this machine.

One source for both llama-cpp-python's wheel (make install) and the llama-server that the benchmark
builds, so the two are compared on the same kernels. AMX is always off: these Intel machines report
AMX, but ggml's AMX matmul crashes on them (SIGILL/SIGSEGV). AVX-512 is used where the CPU has it,
otherwise AVX2.
"""

from __future__ import annotations

import sys
from pathlib import Path


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


def main() -> int:
    path = Path("/proc/cpuinfo")
    flags = cpu_flags(path.read_text()) if path.exists() else set()
    print(" ".join(cmake_args(flags)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
