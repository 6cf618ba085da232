"""Other quantizations of the embedded SmolLM2, made with llama.cpp's own llama_model_quantize (allow_requantize:
from its Q4_1 file), for the tests' model matrix and harness/exactness_matrix.py. Each file is made once and kept in
a cache per llama-cpp-python version (quantizing is that build's arithmetic), outside the repository.

    .venv/bin/python scripts/requantize.py Q4_K_M F16     # prints each file's path
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

# every type llama.cpp quantizes to that its CPU backend serves, by the name its quantize tool gives it
TYPES = ("F32", "F16", "BF16", "Q8_0", "Q6_K", "Q5_K_M", "Q5_K_S", "Q5_1", "Q5_0", "Q4_K_M", "Q4_K_S", "Q4_1",
         "Q4_0", "Q3_K_M", "Q3_K_S", "Q2_K", "IQ4_NL", "IQ4_XS")


def cache_dir() -> Path:
    import llama_cpp

    base = os.environ.get("SERVELM_MODEL_CACHE") or os.path.join(os.environ.get("XDG_CACHE_HOME") or
                                                                  os.path.expanduser("~/.cache"), "servelm", "models")
    return Path(base) / f"llama-cpp-python-{llama_cpp.__version__}"


def requantize(kind: str, source: Path | None = None) -> Path:
    """The embedded model (or `source`) as `kind` (one of TYPES), made once and cached."""
    import llama_cpp as C

    from servelm.config import embedded_model_path

    if kind not in TYPES:
        raise ValueError(f"unknown type {kind!r}: one of {', '.join(TYPES)}")
    src = source or embedded_model_path()
    out = cache_dir() / f"{src.stem.rsplit('.', 1)[0]}.{kind}.gguf"
    if out.is_file():
        return out
    if kind == "Q4_1" and source is None:
        return src  # the embedded file is Q4_1 already
    out.parent.mkdir(parents=True, exist_ok=True)
    params = C.llama_model_quantize_default_params()
    name = f"LLAMA_FTYPE_ALL_{kind}" if kind == "F32" else f"LLAMA_FTYPE_MOSTLY_{kind}"
    params.ftype = getattr(C, name)
    params.allow_requantize = True
    params.nthread = os.cpu_count() or 1
    tmp = out.with_name(out.name + f".{os.getpid()}.tmp")
    if C.llama_model_quantize(str(src).encode(), str(tmp).encode(), params) != 0:
        tmp.unlink(missing_ok=True)
        raise RuntimeError(f"llama_model_quantize could not make {kind} from {src}")
    tmp.replace(out)  # whole or not at all: a test run that stops halfway leaves no broken file
    return out


def main(argv: list[str]) -> int:
    for kind in argv or TYPES:
        print(requantize(kind))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
