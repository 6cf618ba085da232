"""Where does loading a model crash? Each variant loads it in a process of its own, so that one that dies (a
signal inside llama.cpp) says so and the next still runs; faulthandler prints the Python stack of a crash.

    python -m harness.load_variants MODEL.gguf [--slots 64 --context 1024 --step 2048]

With --imports, instead: the model's vocabulary alone, loaded after each of several imports in turn.
Variants, from llama.cpp alone to servelm's whole load: llama.cpp's default parameters and no callbacks; with
servelm's log callback; with its progress callback; servelm's runner without the self-check, on the GPU and
with no layers there; load_exact (the self-check, reloads included). Prints a line a variant: its exit status
and the last lines it wrote.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

_SETUP = "import faulthandler; faulthandler.enable(); import llama_cpp as C; from servelm.runners import llamacpp as L\n"
_VARIANTS = {
    "llama.cpp alone": "C.llama_backend_init(); m = C.llama_model_load_from_file(PATH, C.llama_model_default_params())"
                       "; assert m, 'not loaded'",
    "with the log callback": "L._silence_llama_logs(True); C.llama_backend_init()"
                             "; m = C.llama_model_load_from_file(PATH, C.llama_model_default_params()); assert m, 'not loaded'",
    "with the progress callback": "C.llama_backend_init(); p = C.llama_model_default_params()"
                                  "; p.progress_callback = cb = L._load_progress('m')"
                                  "; m = C.llama_model_load_from_file(PATH, p); assert m, 'not loaded'",
    "the runner, no layers on the GPU": "r = L.LlamaCppRunner(PATH.decode(), gpu_layers=0, **KW); print(r.placement)",
    "the runner": "r = L.LlamaCppRunner(PATH.decode(), **KW); print(r.placement)",
    "load_exact": "r = L.load_exact(PATH.decode(), **KW); print(r.placement, r.exactness.describe())",
}


# which import, made before llama.cpp's library is loaded, makes the load fail (a vocabulary-only load: the crash
# seen on a GPU machine came while llama.cpp read the vocabulary)
_IMPORTS = ("", "llguidance", "jinja2", "httptools", "uvloop", "pydantic_core", "PIL.Image", "yaml", "numpy",
            "servelm.constrain.grammars", "servelm.compose", "servelm.http.app", "servelm.http.server")
_VOCAB = "import llama_cpp as C\nC.llama_backend_init(); p = C.llama_model_default_params(); p.vocab_only = True\n" \
         "assert C.llama_model_load_from_file(PATH, p), 'llama.cpp could not load it'"


def _run(name: str, code: str, timeout: float) -> int:
    try:
        done = subprocess.run([sys.executable, "-X", "faulthandler", "-c", code], capture_output=True, text=True,
                              timeout=timeout)
        rc, out = done.returncode, (done.stdout + done.stderr).strip().splitlines()
    except subprocess.TimeoutExpired:
        rc, out = -1, ["timed out"]
    print(f"== {name}: exit {rc}")
    print("\n".join(out[-25 if rc else -3:]), flush=True)
    return rc


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m harness.load_variants", description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--slots", type=int, default=64)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--step", type=int, default=2048)
    ap.add_argument("--timeout", type=float, default=120)
    ap.add_argument("--imports", action="store_true", help="instead: a vocabulary-only load after each of several "
                    "imports, to find one that makes it fail")
    a = ap.parse_args(argv)
    if not Path(a.model).is_file():
        ap.error(f"no such model file: {a.model}")
    head = _SETUP + f"PATH = {a.model.encode()!r}\nKW = dict(num_slots={a.slots}, context_window={a.context}, " \
                    f"max_step_tokens={a.step}, verbose=True)\n"
    failed = 0
    for module in _IMPORTS if a.imports else ():
        failed += _run(f"a vocabulary after import {module or 'nothing'}",
                       f"PATH = {a.model.encode()!r}\n" + (f"import {module}\n" if module else "") + _VOCAB, a.timeout) != 0
    for name, code in _VARIANTS.items() if not a.imports else ():
        failed += _run(name, head + code, a.timeout) != 0
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
