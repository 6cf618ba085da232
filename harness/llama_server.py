"""Build llama.cpp's own `llama-server` and `llama-batched-bench` from the llama.cpp that llama-cpp-python vendors.

The version comes from the `llama-cpp-python==X` pin in pyproject.toml; the source comes from that
version's sdist on PyPI (it carries `vendor/llama.cpp`); the CMake flags are exactly those of
`scripts/llama_cmake_args.py`, the same ones servelm's llama-cpp-python wheel is compiled with, so the
two servers run the same kernels, and `llama-batched-bench` (the kernel limit, harness/limit.py) runs them too.
The results are cached at `harness/.build/<version>/`.

    python -m harness.llama_server            # build (or find) llama-server and print its path
    python -m harness.llama_server --tool llama-batched-bench
    python -m harness.llama_server --force    # rebuild
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BUILD_ROOT = REPO / "harness" / ".build"
PIN = re.compile(r'"llama-cpp-python==([0-9][0-9A-Za-z.]*)"')

# The server and the batched bench (a tool) only: no tests or examples; static binaries.
TOOLS = ("llama-server", "llama-batched-bench")
EXTRA_ARGS = [
    "-DCMAKE_BUILD_TYPE=Release",
    "-DBUILD_SHARED_LIBS=OFF",
    "-DLLAMA_BUILD_SERVER=ON",
    "-DLLAMA_BUILD_TOOLS=ON",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DGGML_BUILD_TESTS=OFF",
    "-DGGML_BUILD_EXAMPLES=OFF",
]


def pinned_version(pyproject: Path = REPO / "pyproject.toml") -> str:
    """The llama-cpp-python version servelm is pinned to."""
    match = PIN.search(pyproject.read_text())
    if not match:
        raise SystemExit(f"no llama-cpp-python==X pin in {pyproject}")
    return match.group(1)


def cmake_flags() -> list[str]:
    """The CPU flags servelm's llama.cpp is compiled with (scripts/llama_cmake_args.py)."""
    out = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "llama_cmake_args.py")],
        check=True, capture_output=True, text=True,
    ).stdout
    return shlex.split(out)


def binary_path(version: str | None = None, tool: str = "llama-server") -> Path:
    return BUILD_ROOT / (version or pinned_version()) / tool


def _log(msg: str) -> None:
    print(f"[llama-server build] {msg}", file=sys.stderr, flush=True)


def _download_sdist(version: str, dest: Path) -> Path:
    found = sorted(dest.glob(f"llama_cpp_python-{version}.tar.gz")) + sorted(
        dest.glob(f"llama-cpp-python-{version}.tar.gz"))
    if found:
        return found[0]
    dest.mkdir(parents=True, exist_ok=True)
    _log(f"downloading the llama-cpp-python {version} sdist")
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--disable-pip-version-check", "--no-deps",
         "--no-binary", ":all:", f"llama-cpp-python=={version}", "-d", str(dest)],
        check=True,
    )
    found = sorted(dest.glob(f"llama[_-]cpp[_-]python-{version}.tar.gz"))
    if not found:
        raise SystemExit(f"pip download left no sdist in {dest}")
    return found[0]


def _extract(sdist: Path, dest: Path) -> Path:
    """Extract the sdist once; return its vendor/llama.cpp folder."""
    marker = dest / ".extracted"
    if not marker.exists():
        if dest.exists():
            shutil.rmtree(dest)
        dest.mkdir(parents=True)
        _log(f"extracting {sdist.name}")
        with tarfile.open(sdist) as tar:
            tar.extractall(dest, filter="data")
        marker.touch()
    tops = [p for p in dest.iterdir() if p.is_dir()]
    for top in tops:
        src = top / "vendor" / "llama.cpp"
        if (src / "CMakeLists.txt").exists():
            return src
    raise SystemExit(f"no vendor/llama.cpp/CMakeLists.txt under {dest}")


def build(force: bool = False, jobs: int | None = None, tool: str = "llama-server") -> Path:
    """Return the path of a built `tool` (one of TOOLS), building every tool first unless cached."""
    version = pinned_version()
    target = binary_path(version, tool)
    if target.exists() and not force:
        return target
    started = time.monotonic()
    work = BUILD_ROOT / version
    sdist = _download_sdist(version, BUILD_ROOT / "sdist")
    src = _extract(sdist, work / "src")
    build_dir = work / "cmake-build"
    flags = cmake_flags() + EXTRA_ARGS
    _log("cmake " + " ".join(flags))
    subprocess.run(["cmake", "-S", str(src), "-B", str(build_dir), *flags], check=True)
    jobs = jobs or os.cpu_count() or 2
    _log(f"building {', '.join(TOOLS)} with -j{jobs} (several minutes on 2 cores)")
    subprocess.run(
        ["cmake", "--build", str(build_dir), "--config", "Release", f"-j{jobs}", "--target", *TOOLS],
        check=True,
    )
    for name in TOOLS:
        built = next((p for p in (build_dir / "bin" / name, build_dir / name) if p.exists()), None)
        if built is None:
            raise SystemExit(f"the build finished but no {name} binary is under {build_dir}")
        tmp = binary_path(version, name).with_suffix(".tmp")
        shutil.copy2(built, tmp)
        tmp.replace(binary_path(version, name))
    (work / "cmake-flags.txt").write_text(" ".join(flags) + "\n")
    _log(f"built {', '.join(TOOLS)} in {time.monotonic() - started:.0f} s")
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--force", action="store_true", help="rebuild even if cached")
    parser.add_argument("-j", "--jobs", type=int, default=None, help="parallel compile jobs")
    parser.add_argument("--tool", choices=TOOLS, default="llama-server", help="which binary's path to print")
    args = parser.parse_args(argv)
    print(build(force=args.force, jobs=args.jobs, tool=args.tool))
    return 0


if __name__ == "__main__":
    sys.exit(main())
