"""LlamaModel and LlamaCppRunner: the only module that touches llama.cpp (through llama-cpp-python's ctypes C API).

A LlamaModel is the model file loaded (weights, vocabulary, templates, metadata; or the vocabulary alone). A
LlamaCppRunner computes with one: one context with `num_slots` sequences, each with a KV stream of its own (a
non-unified cache, as long as the context window) and flash attention on. Each step is one llama_decode call where
llama.cpp allows it, over a batch whose buffers are numpy arrays we own, filled with vector operations. Every C
pointer is created and freed here.

A sequence's logits are bitwise the same whatever shares its steps, however its prompt is chunked, and whether
its prefix was read or copied from the cache (docs/exactness.md). ggml's CPU flash attention has three kernels: a
row-at-a-time one, a tiled one for 64 or more query rows of a stream, and a split-KV one for a single row of a
single stream once 512 cells are in view; they round differently. So every row is computed by the first, but
the leading whole tiles of a prompt (SequenceGroup.tiled_end), which are by the second, whatever shares their
call (its rows are computed a tile of 64 at a time, zero-padded, each row on its own against key tiles from
position 0, so neither the other rows of its chunk nor where the chunk starts change a row's result):
- a sequence reads at most MAX_ROWS (63) tokens a step (the scheduler keeps to it), but in its prompt's whole
  tiles: those it reads `tile_rows` (64) or more at a time, in a call with tiled chunks of the same length alone
  (StepPlan.calls), so that llama.cpp gives each stream its whole chunk in one micro-batch;
- a call is laid out micro-batch by micro-batch as llama.cpp's own micro-batching cuts it (from the first sequence
  with tokens left, the run of consecutive sequence ids with tokens left, as many tokens from each as the shortest
  has: StepPlan.micro_batches), so that every micro-batch is the one planned: decoding and prompt-reading slots
  share a call, every stream's first row in one micro-batch, then what each prompt chunk has left;
- a micro-batch that would be one row of one stream past LONE_ROW_FROM reads that sequence's previous position
  again beside it (the cell is rewritten with the same values), so it is never a lone row; a chunk whose last token
  alone would be one (its previous position read in the same call) goes in a call of its own (StepPlan.calls).
Each stream holds one sequence, its cells in position order (a sliding-window layer's too: its cache is as long as
the others'). Matrix products take one of several kernels by weight type and by the rows of the micro-batch
(docs/exactness.md has the table); the fences that keep a row's kernel the same whatever shares its call:
- ggml's tiled K-quant kernel (from 8 rows on) is off for the process (GGML_CPU_TILED_MM=0), so K-quant and IQ
  weights always take their row-by-row dot product;
- `repack` False loads the weights without llama.cpp's repacked buffers (whose 4-row gemm and 1-row gemv round
  Q4_K differently);
- `pair_rows` makes every micro-batch at least two rows, and at least two logits rows when it has any, for weights whose
  one-row kernel (a dot product) and several-row one (llamafile's tinyBLAS: F32, F16, BF16, IQ4_NL) round
  differently.
Or by shape (a Fence's rows rule): the fast kernels kept, every micro-batch's rows and logits rows made a count that
takes one path: repacked Q4_K in rows by 4 (its gemm takes rows in groups of 4, its gemv the rest; a micro-batch of
a multiple of 4 is all gemm), and with the tiled kernel on (GGML_CPU_TILED_MM=1) 8 rows or more. Each stream of a
micro-batch that breaks the rule gets as many pads after its last row (its last token again, at the positions
after, dropped after the call), so llama.cpp cuts the same micro-batch; a chunk with rows after such a micro-batch
goes in a call of its own; the logits rows the rule lacks are asked of the micro-batch's other rows and dropped.
runners/selfcheck.py finds which fence a model needs, the cheapest of FENCES that passes (load_exact).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

# ggml's tiled K-quant matmul (from 8 rows a call on) rounds otherwise than the row-by-row dot product it replaces,
# so a row's logits would depend on how many rows share its call: off for the whole process, before any matmul
# runs (ggml reads it once). GGML_CPU_TILED_MM=1 keeps it on for the process: K-quant text models are then fenced by
# shape instead (every micro-batch 8 rows or more), and K-quant embedding models are not fenced (docs/operations.md).
os.environ.setdefault("GGML_CPU_TILED_MM", "0")

import llama_cpp as C  # noqa: E402
import numpy as np  # noqa: E402

from servelm.engine.plan import Clear, Copy, Keep, KVOp, MediaChunk, Save, ScheduledChunk, StepPlan, max_logits_rows
from servelm.engine.runner import Exactness, KVCacheFull, RestoreFailed
from servelm.gguf_header import open_regular
from servelm.runners.media import Projector
from servelm.runners.selfcheck import CheckMemo, check_exactness

if os.environ["GGML_CPU_TILED_MM"] not in ("0", "1"):
    raise ValueError(f"GGML_CPU_TILED_MM={os.environ['GGML_CPU_TILED_MM']!r}: 0 (servelm's default: ggml's tiled K-quant "
                     "kernel off) or 1 (on, K-quant models fenced by shape)")
TILED_MM = os.environ["GGML_CPU_TILED_MM"] == "1"  # as ggml reads it, once, for the whole process

_LOG_LEVEL_WARN = 3
# the KV cache's types: ggml's type, and its block (values, bytes): q8_0 is 32 int8 and a float16 scale
_KV_TYPES = {"f16": (C.GGML_TYPE_F16, 1, 2), "q8_0": (C.GGML_TYPE_Q8_0, 32, 34), "q4_0": (C.GGML_TYPE_Q4_0, 32, 18)}
MAX_ROWS = 63  # a stream's rows in one micro-batch: below flash attention's tiled kernel (64)
FA_TILE_ROWS = 64  # ... from which on its tiled kernel takes them (GGML_FA_TILE_Q): a prompt's whole tiles go so
# A single row of a single stream goes to the split-KV kernel once its view is 512 cells (llama.cpp pads the view
# to 256: from position 256 on); from here on, such a row gets its previous position beside it.
LONE_ROW_FROM = 240
_CELL_PAD = 256
# A micro-batch's own cost (each reads the weights), in rows' time: on 2 cores the default model computes a call of r rows of one stream
# in about 4.5 + 4.0 r ms, and each step adds about 1.5 ms of the engine's own (engine/speculate.py's cost model)
CALL_COST_ROWS = 1.5  # llama.cpp pads each stream to a multiple of this
PAD_ROOM = 16  # a call's room beyond max_step_tokens for a shape fence's pads (llama.cpp's n_batch and n_ubatch)


@dataclass(frozen=True)
class Fence:
    """What keeps a row on one kernel whatever shares its call (the module's docstring): the weights repacked or
    not, and the rows of every micro-batch (and its logits rows, where it has any): at least `min_rows`, in
    multiples of `multiple`. (2, 1) is pair_rows's layout (a lone row re-reads its previous position); any other
    rule beyond (1, 1) is a shape fence, met by pads after each stream's last row, dropped after the call."""

    repack: bool = True
    min_rows: int = 1
    multiple: int = 1

    def __post_init__(self) -> None:
        if not 1 <= self.min_rows <= PAD_ROOM // 2 or self.multiple not in (1, 2, 4, 8):
            raise ValueError(f"a fence's rows: min_rows 1 to {PAD_ROOM // 2}, multiple 1, 2, 4 or 8, not "
                             f"{self.min_rows} and {self.multiple}")

    @property
    def pair(self) -> bool:
        return (self.min_rows, self.multiple) == (2, 1)

    @property
    def shape(self) -> bool:
        return (self.min_rows, self.multiple) not in ((1, 1), (2, 1))

    def fits(self, rows: int) -> bool:
        return rows >= self.min_rows and rows % self.multiple == 0

    def words(self) -> tuple[str, ...]:
        """As /v1/models says it: "no repacked weights", "two rows a call", "rows by 4 a call", "8 rows or more a call"."""
        rows = () if (self.min_rows, self.multiple) == (1, 1) else ("two rows a call",) if self.pair else (
            (f"{self.min_rows} rows or more" if self.min_rows > self.multiple else "rows")
            + (f" by {self.multiple}" if self.multiple > 1 else "") + " a call",)
        return ("no repacked weights",) * (not self.repack) + rows


# The fences load_exact tries, cheapest first by a lone decode row's cost, where a fence costs most: a kernel fence
# keeps it one row (two with pair rows), a shape fence makes it 4 or 8. harness/exactness_matrix.py, SmolLM2 Q4_K_M,
# 1 thread, tokens a CPU second (prompt / 1 stream / 16 streams): no repacked weights 118 / 42.6 / 129, repacked in
# rows by 4 179 / 30.4 / 142, tiled on and 8 rows or more 156 / 13.8 / 173. So with the tiled kernel off, the kernel
# fences, then repacked Q4_K in whole groups of four rows; with it on (GGML_CPU_TILED_MM=1, an operator's choice for
# many streams), every micro-batch 8 rows or more (the tiled kernel's floor), repacked (in fours) or not.
KERNEL_FENCES = (Fence(), Fence(min_rows=2), Fence(repack=False), Fence(repack=False, min_rows=2))
SHAPE_FENCES = ((Fence(min_rows=8, multiple=4), Fence(repack=False, min_rows=8)) if TILED_MM else
                (Fence(min_rows=4, multiple=4),))
FENCES = KERNEL_FENCES + SHAPE_FENCES
_quiet_logs: Any = None
log = logging.getLogger("servelm.runners")


# llama.cpp's file types by number, named as its quantize tool names them (LLAMA_FTYPE_MOSTLY_Q4_K_M → Q4_K_M)
_FTYPES = {int(getattr(C, n)): n.removeprefix("LLAMA_FTYPE_MOSTLY_").removeprefix("LLAMA_FTYPE_ALL_")
           for n in dir(C) if n.startswith("LLAMA_FTYPE_") and n != "LLAMA_FTYPE_GUESSED"}


def _builtin_templates() -> set[str]:
    """The names of llama.cpp's built-in chat templates."""
    n = int(C.llama_chat_builtin_templates((ctypes.c_char_p * 1)(), 0))
    out = (ctypes.c_char_p * n)()
    C.llama_chat_builtin_templates(out, n)
    return {name.decode() for name in out if name}


def builtin_template_for(architecture: str) -> str | None:
    """The name of llama.cpp's built-in chat template for a model architecture (gemma3 → gemma), if it has one
    other than ChatML: what a model file with no chat template of its own is rendered with."""
    names = _builtin_templates()
    for name in (architecture, architecture.rstrip("0123456789")):
        if name in names and name != "chatml":
            return name
    return None


def _load_progress(model_path: str | Path) -> Any:
    """A progress callback for llama_model_load_from_file that logs every tenth of the load, so that a long
    load shows it is moving. The caller keeps it alive while llama.cpp may call it."""
    name = Path(model_path).name
    last = [-1]

    def progress(fraction: float, _user: ctypes.c_void_p) -> bool:
        tenth = int(fraction * 10 + 1e-6)
        if tenth > last[0]:
            last[0] = tenth
            log.info("loading model %s: %d%%", name, tenth * 10)
        return True  # go on loading

    return C.llama_progress_callback(progress)


_log_capture: list[bytes] | None = None  # llama.cpp's log lines while an adapter loads (LlamaCppRunner.load_adapter)


def _silence_llama_logs(verbose: bool) -> None:
    """Keep llama.cpp's warnings and errors on stderr; drop its chatter unless verbose."""
    global _quiet_logs

    def write(level: int, text: bytes, _user: ctypes.c_void_p) -> None:
        if _log_capture is not None:  # a LoRA adapter's load, which says why it fails only here
            _log_capture.append(text)
        if verbose or level >= _LOG_LEVEL_WARN and level != 5:  # 5 is GGML_LOG_LEVEL_CONT
            os.write(2, text)

    _quiet_logs = C.llama_log_callback(write)  # kept alive as long as llama.cpp may call it
    C.llama_log_set(_quiet_logs, ctypes.c_void_p(0))


def _tokenize(vocab: Any, text: str, add_special: bool, parse_special: bool) -> list[int]:
    data = text.encode("utf-8")
    cap = len(data) + 8
    buf = (C.llama_token * cap)()
    n = C.llama_tokenize(vocab, data, len(data), buf, cap, add_special, parse_special)
    if n < 0:
        cap = -n
        buf = (C.llama_token * cap)()
        n = C.llama_tokenize(vocab, data, len(data), buf, cap, add_special, parse_special)
    return list(buf[:n])


def _pair(model: Any, vocab: Any, query: str, document: str) -> list[int]:
    """A query and a document as one input of a cross-encoder, as llama-server writes it: the model's rerank template
    (`{query}`, `{document}`) when it has one, else BOS, the query, EOS (SEP where there is no EOS), SEP, the document
    and EOS, each special token where the vocabulary adds it."""
    template = C.llama_model_chat_template(model, b"rerank")
    if template:
        text = template.decode("utf-8").replace("{query}", query).replace("{document}", document)
        return _tokenize(vocab, text, False, True)
    eos = C.llama_vocab_eos(vocab)
    eos = C.llama_vocab_sep(vocab) if eos == C.LLAMA_TOKEN_NULL else eos
    add_eos = bool(C.llama_vocab_get_add_eos(vocab))
    ids = [C.llama_vocab_bos(vocab)] if C.llama_vocab_get_add_bos(vocab) else []
    ids += _tokenize(vocab, query, False, False)
    ids += [eos] if add_eos else []
    ids += [C.llama_vocab_sep(vocab)] if C.llama_vocab_get_add_sep(vocab) else []
    ids += _tokenize(vocab, document, False, False)
    ids += [eos] if add_eos else []
    return [int(i) for i in ids]


def _batch(size: int, *, outputs: bool, embd: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, Any]:
    """A llama_batch of `size` tokens (or, with `embd`, of `size` embeddings that wide) whose buffers are numpy
    arrays we fill with vector operations (tokens or embeddings, positions, one sequence id per token, output
    flags); returns those arrays and the batch."""
    tok = np.zeros((size, embd) if embd else size, dtype=np.float32 if embd else np.int32)
    pos = np.zeros(size, dtype=np.int32)
    nseq = np.ones(size, dtype=np.int32)
    seq = np.zeros(size, dtype=np.int32)
    out = np.full(size, 1 if outputs else 0, dtype=np.int8)
    i32p = ctypes.POINTER(ctypes.c_int32)
    seq_ptrs = (i32p * size)(*[ctypes.cast(seq.ctypes.data + 4 * i, i32p) for i in range(size)])
    batch = C.llama_batch()
    batch.token = i32p() if embd else tok.ctypes.data_as(i32p)
    batch.embd = tok.ctypes.data_as(ctypes.POINTER(ctypes.c_float)) if embd else ctypes.POINTER(ctypes.c_float)()
    batch.pos = pos.ctypes.data_as(i32p)
    batch.n_seq_id = nseq.ctypes.data_as(i32p)
    batch.seq_id = ctypes.cast(seq_ptrs, ctypes.POINTER(i32p))
    batch.logits = out.ctypes.data_as(ctypes.POINTER(ctypes.c_int8))
    batch._keep = (nseq, seq_ptrs)  # the batch holds raw pointers into these: they must live as long
    return tok, pos, seq, out, batch


@dataclass(frozen=True)
class Device:
    """A device llama.cpp's ggml can compute on (its backend registry): the CPU, and a GPU where llama.cpp was
    built with a GPU backend (CUDA) and finds one."""

    name: str  # ggml's: CPU, CUDA0, …
    description: str  # the hardware's own name
    kind: str  # cpu, gpu, igpu (an integrated GPU), accel, meta
    free_bytes: int
    total_bytes: int


_DEVICE_KINDS = ("cpu", "gpu", "igpu", "accel", "meta")  # ggml_backend_dev_type's values, in order


@cache
def _ggml() -> ctypes.CDLL:
    """ggml's library as llama.cpp loaded it (beside libllama: the same copy), for its device registry, which
    llama-cpp-python does not bind."""
    here = Path(C.llama_cpp._lib._name).parent
    path = next((here / n for n in ("libggml.so.0", "libggml.so", "libggml.dylib", "ggml.dll") if (here / n).exists()),
                here / "libggml.so")
    lib = ctypes.CDLL(str(path))
    dev = ctypes.c_void_p
    for fn, args, res in (("ggml_backend_dev_count", [], ctypes.c_size_t), ("ggml_backend_dev_get", [ctypes.c_size_t], dev),
                          ("ggml_backend_dev_name", [dev], ctypes.c_char_p),
                          ("ggml_backend_dev_description", [dev], ctypes.c_char_p),
                          ("ggml_backend_dev_type", [dev], ctypes.c_int),
                          ("ggml_backend_dev_memory", [dev, ctypes.POINTER(ctypes.c_size_t),
                                                       ctypes.POINTER(ctypes.c_size_t)], None)):
        getattr(lib, fn).argtypes, getattr(lib, fn).restype = args, res
    return lib


def devices() -> list[Device]:
    """The devices llama.cpp sees now, in its order (a GPU's free memory as of this call)."""
    C.llama_backend_init()
    lib, out = _ggml(), []
    for i in range(int(lib.ggml_backend_dev_count())):
        dev = lib.ggml_backend_dev_get(i)
        free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
        lib.ggml_backend_dev_memory(dev, ctypes.byref(free), ctypes.byref(total))
        kind = int(lib.ggml_backend_dev_type(dev))
        out.append(Device(lib.ggml_backend_dev_name(dev).decode(errors="replace"),
                          lib.ggml_backend_dev_description(dev).decode(errors="replace"),
                          _DEVICE_KINDS[kind] if 0 <= kind < len(_DEVICE_KINDS) else str(kind), free.value, total.value))
    return out


def gpus() -> list[Device]:
    """The GPUs llama.cpp may offload layers to (none on a CPU-only build, or where its GPU backend finds none)."""
    return [d for d in devices() if d.kind in ("gpu", "igpu")]


def _model_params(*, vocab_only: bool = False, repack: bool = True, gpu_layers: int | None = None,
                  main_gpu: int | None = None) -> Any:
    """llama.cpp's model parameters: every layer on the GPU unless `gpu_layers` says how many (-1: all, 0: none);
    `main_gpu` puts the whole model on that GPU alone (llama.cpp's split mode none) rather than across them all."""
    mparams = C.llama_model_default_params()
    mparams.vocab_only = vocab_only
    mparams.use_extra_bufts = repack
    mparams.n_gpu_layers = -1 if gpu_layers is None else gpu_layers
    if main_gpu is not None:
        found = len(gpus())
        if main_gpu >= found:
            raise ValueError(f"--main-gpu {main_gpu}: llama.cpp finds {found} GPU{'s' * (found != 1)} here"
                             + (" (a CPU-only build, or no GPU)" if not found else ""))
        mparams.split_mode = C.LLAMA_SPLIT_MODE_NONE
        mparams.main_gpu = main_gpu
    return mparams


def placement(model: Any, gpu_layers: int | None, main_gpu: int | None) -> str:
    """Where a loaded model's layers are, in words: "CPU", or the GPU and how many of its layers (llama.cpp counts
    the output layer as one) are there."""
    found = gpus()
    layers = int(C.llama_model_n_layer(model)) + 1
    on_gpu = 0 if not found else layers if gpu_layers is None or gpu_layers < 0 else min(gpu_layers, layers)
    if not on_gpu:
        return "CPU"
    where = [found[main_gpu]] if main_gpu is not None else found
    names = ", ".join(f"{d.name} ({d.description})" for d in where)
    return f"{names}: {on_gpu} of {layers} layers" + ("" if on_gpu == layers else ", the rest on the CPU")


def _free(owner: LlamaCppRunner | LlamaCppEmbedder) -> None:
    """Free an owner's llama.cpp context, then the weights if it loaded them itself (an embedder's; a runner's are
    its LlamaModel's); a second call does nothing."""
    if owner._ctx:
        C.llama_free(owner._ctx)
        owner._ctx = None
    if isinstance(owner, LlamaCppEmbedder) and owner._model:
        C.llama_model_free(owner._model)
        owner._model = None


def _gguf_tensor_count(path: str | Path) -> int | None:
    """The tensor count a GGUF file's header gives (GGUF v2 and later: magic, u32 version, u64 count), or None
    for what is not such a file (llama.cpp's loader says why)."""
    try:
        with open_regular(path) as f:  # a FIFO given as --lora never blocks the start
            head = f.read(16)
    except OSError:
        return None
    if len(head) < 16 or head[:4] != b"GGUF" or int.from_bytes(head[4:8], "little") < 2:
        return None
    return int.from_bytes(head[8:16], "little")


class LlamaModel:
    """A model file loaded by llama.cpp: the weights pointer, the vocabulary, the chat templates and the metadata
    (engine/runner.py's ModelInfo, what the wiring reads). `vocab_only` loads the vocabulary and metadata alone, no
    weights (servelm/ray's ingress tokenizes with it); a LlamaCppRunner computes with a model loaded whole, and closes
    it with its context."""

    def __init__(
        self,
        model_path: str | Path,
        *,
        vocab_only: bool = False,
        repack: bool = True,  # llama.cpp's repacked weight buffers (faster; Q4_K's rounds by rows: load_exact)
        gpu_layers: int | None = None,  # layers on the GPU (None or -1: all, where llama.cpp finds a GPU)
        main_gpu: int | None = None,  # the one GPU the model goes on (None: across every GPU llama.cpp finds)
        verbose: bool = False,
    ) -> None:
        _silence_llama_logs(verbose)
        C.llama_backend_init()
        self.path = Path(model_path)
        self.vocab_only, self.repack, self.gpu_layers, self.main_gpu = vocab_only, repack, gpu_layers, main_gpu
        mparams = _model_params(vocab_only=vocab_only, repack=repack, gpu_layers=0 if vocab_only else gpu_layers,
                                main_gpu=None if vocab_only else main_gpu)
        self._progress = mparams.progress_callback = _load_progress(model_path)  # kept alive as long as self
        self._model: Any = C.llama_model_load_from_file(str(model_path).encode(), mparams)
        if not self._model:
            raise RuntimeError(f"llama.cpp could not load the model file {model_path}")
        self._vocab = C.llama_model_get_vocab(self._model)
        self.vocab_size = int(C.llama_vocab_n_tokens(self._vocab))
        self.trained_context = int(C.llama_model_n_ctx_train(self._model))
        self.weights_bytes = int(C.llama_model_size(self._model))
        self.eog_ids = np.array([t for t in range(self.vocab_size) if C.llama_vocab_is_eog(self._vocab, t)], dtype=np.int64)
        self._pieces = [self._piece(t) for t in range(self.vocab_size)]
        self.chat_template = self._meta("tokenizer.chat_template")
        self.bos_token = self._token_text(C.llama_vocab_bos(self._vocab))
        self.eos_token = self._token_text(C.llama_vocab_eos(self._vocab))
        self.add_bos = bool(C.llama_vocab_get_add_bos(self._vocab))
        fim = (C.llama_vocab_fim_pre(self._vocab), C.llama_vocab_fim_suf(self._vocab), C.llama_vocab_fim_mid(self._vocab))
        # fill-in-the-middle tokens
        self.fim_tokens: tuple[int, int, int] | None = None if -1 in fim else (int(fim[0]), int(fim[1]), int(fim[2]))
        self.description = self._meta("general.name") or self.path.stem

    def placement(self) -> str:
        """Where its layers are, in words (module-level placement())."""
        return placement(self._model, self.gpu_layers, self.main_gpu)

    def cell_bytes(self, kv_cache_type: str) -> int:
        """One KV cell's size: keys and values of every layer in the cache's type (a sliding-window layer's cache is
        as long as the others', so it counts the same)."""
        n_embd, n_head = int(C.llama_model_n_embd(self._model)), max(1, int(C.llama_model_n_head(self._model)))
        arch = self.architecture
        k_len = int(self._meta(f"{arch}.attention.key_length") or n_embd // n_head)
        v_len = int(self._meta(f"{arch}.attention.value_length") or k_len)
        n_kv = int(C.llama_model_n_head_kv(self._model))
        _, block, block_bytes = _KV_TYPES[kv_cache_type]
        per_layer = (-(-n_kv * k_len // block) + -(-n_kv * v_len // block)) * block_bytes
        return int(C.llama_model_n_layer(self._model)) * per_layer

    def file_fingerprint(self, *more: str) -> str:
        """The model file's fingerprint (its size, first and last MiB) with `more` (what else a saved state depends
        on: the runner's cache type and layout, llama.cpp's build)."""
        h = hashlib.sha256()
        size = self.path.stat().st_size
        with open(self.path, "rb") as f:
            h.update(f.read(1 << 20))
            f.seek(max(0, size - (1 << 20)))
            h.update(f.read(1 << 20))
        h.update("|".join((str(size), *more)).encode())
        return h.hexdigest()

    # -- metadata and text ------------------------------------------------------------------------
    def _meta(self, key: str) -> str | None:
        buf = ctypes.create_string_buffer(1 << 16)
        n = C.llama_model_meta_val_str(self._model, key.encode(), buf, len(buf))
        if n < 0:
            return None
        if n >= len(buf):
            buf = ctypes.create_string_buffer(n + 1)
            C.llama_model_meta_val_str(self._model, key.encode(), buf, len(buf))
        return buf.value.decode("utf-8", errors="replace")

    def _piece(self, token: int, special: bool = False) -> bytes:
        buf = ctypes.create_string_buffer(64)
        n = C.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, special)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = C.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, special)
        return buf.raw[:n]

    def _token_text(self, token: int) -> str:
        return "" if token < 0 else self._piece(token, special=True).decode("utf-8", errors="replace")

    def token_bytes(self, token: int) -> bytes:
        return self._pieces[token] if 0 <= token < self.vocab_size else b""

    def tokenize_text(self, data: bytes) -> list[int]:
        return self.tokenize(data.decode("utf-8", errors="replace"), add_special=False, parse_special=False)

    def token_table(self) -> list[bytes]:
        """Every token's bytes for grammar masks; control tokens as b"\\xff" + their text (llguidance's mark)."""
        table = []
        for t in range(self.vocab_size):
            if C.llama_vocab_get_attr(self._vocab, t) & C.LLAMA_TOKEN_ATTR_CONTROL:
                table.append(b"\xff" + self._piece(t, special=True))
            else:
                table.append(self._pieces[t])
        return table

    def tokenize(self, text: str, *, add_special: bool, parse_special: bool) -> list[int]:
        return _tokenize(self._vocab, text, add_special, parse_special)

    def tokenize_pair(self, query: str, document: str) -> list[int]:
        """A reranker's input for a query and a document (servelm/ray's ingress tokenizes it here)."""
        return _pair(self._model, self._vocab, query, document)

    def control_tokens(self) -> list[tuple[str, int, bool, bool]]:
        """(text, id, lstrip, rstrip) of every token that parsing special tokens reads from text as itself and
        plain tokenizing does not: llama.cpp's control and unknown tokens."""
        out = []
        for t in range(self.vocab_size):
            attr = C.llama_vocab_get_attr(self._vocab, t)
            if attr & (C.LLAMA_TOKEN_ATTR_CONTROL | C.LLAMA_TOKEN_ATTR_UNKNOWN):
                text = (C.llama_vocab_get_text(self._vocab, t) or b"").decode("utf-8", errors="replace")
                out.append((text, t, bool(attr & C.LLAMA_TOKEN_ATTR_LSTRIP), bool(attr & C.LLAMA_TOKEN_ATTR_RSTRIP)))
        return out

    @property
    def quantization(self) -> str:
        """The file's type as llama.cpp names it (Q4_K_M, F16, …): most of its weights' type."""
        ftype = self._meta("general.file_type")
        return _FTYPES.get(int(ftype), f"type {ftype}") if ftype and ftype.isdigit() else "unknown"

    @property
    def architecture(self) -> str:
        return self._meta("general.architecture") or ""

    def builtin_template(self) -> str | None:
        """The name of llama.cpp's built-in chat template for this model's architecture (gemma3 → gemma), if it
        has one."""
        return builtin_template_for(self.architecture)

    def apply_builtin_template(self, name: str, messages: list[tuple[str, str]], add_generation_prompt: bool) -> str:
        """Messages (role, content) rendered by llama.cpp's built-in template `name`."""
        keep = [(role.encode(), text.encode()) for role, text in messages]
        chat = (C.llama_chat_message * max(1, len(keep)))(*[C.llama_chat_message(r, t) for r, t in keep])
        size = 2 * sum(len(r) + len(t) for r, t in keep) + 256
        for _ in range(2):
            buf = ctypes.create_string_buffer(size)
            n = C.llama_chat_apply_template(name.encode(), chat, len(keep), add_generation_prompt, buf, size)
            if n < 0:
                raise ValueError(f"llama.cpp's {name} template could not render these messages")
            if n <= size:
                return buf.raw[:n].decode("utf-8", errors="replace")
            size = n
        raise ValueError(f"llama.cpp's {name} template did not fit its buffer")

    @property
    def bos_id(self) -> int | None:
        """The BOS token the tokenizer puts first (None when the model asks for none)."""
        bos = int(C.llama_vocab_bos(self._vocab))
        return bos if self.add_bos and bos >= 0 else None

    def close(self) -> None:
        if self._model:
            C.llama_model_free(self._model)
            self._model = None


def _in_order(places: list[tuple[int, int]], total: int) -> bool:
    """Whether a call's logits rows are the plan's rows 0..total, in order, and only those."""
    r = 0
    for row, k in places:
        if row != r:
            return False
        r += k
    return r == total


class LlamaCppRunner:
    """The executor (engine/runner.py's ModelRunner) on a LlamaModel: the context with its KV streams, the batches,
    the KV operations and the LoRA adapters. Given a path it loads its model (repack, gpu_layers, main_gpu and
    verbose are that load's); either way it owns `model`, and close() frees both."""

    def __init__(
        self,
        model: LlamaModel | str | Path,
        *,
        num_slots: int = 16,
        context_window: int | None = 2048,  # None: the model's trained context, within kv_budget_mib
        kv_budget_mib: int = 768,
        max_step_tokens: int = 2048,
        threads: int | None = None,
        verbose: bool = False,
        mmproj: str | Path | None = None,  # a vision projector GGUF for this model: images in prompts
        kv_cache_type: str = "f16",  # f16, q8_0 or q4_0 (_KV_TYPES)
        repack: bool = True,  # llama.cpp's repacked weight buffers (faster; Q4_K's rounds by rows: load_exact)
        pair_rows: bool = False,  # every call at least two rows and two logits rows (see the module's docstring)
        gpu_layers: int | None = None,  # layers on the GPU (None or -1: all, where llama.cpp finds a GPU)
        main_gpu: int | None = None,  # the one GPU the model goes on (None: across every GPU llama.cpp finds)
    ) -> None:
        if not isinstance(model, LlamaModel):
            model = LlamaModel(model, repack=repack, gpu_layers=gpu_layers, main_gpu=main_gpu, verbose=verbose)
        elif model.vocab_only:
            raise ValueError("a runner computes: give it a model loaded with its weights, not its vocabulary alone")
        self.model = model
        self.repack = model.repack
        self.fence = Fence(self.repack, 2 if pair_rows else 1)
        self.vocab_size = model.vocab_size
        self.eog_ids = model.eog_ids
        self.token_bytes = model.token_bytes
        train_ctx = model.trained_context
        self.kv_cache_type = kv_cache_type
        self.kv_cell_bytes = model.cell_bytes(kv_cache_type)
        self.placement = model.placement()
        if context_window is None:
            context_window = self._budgeted_context(train_ctx, num_slots, kv_budget_mib, model.path.name)
        self.context_window = min(context_window, train_ctx) if train_ctx else context_window
        self.num_slots = num_slots
        self.kv_cells = num_slots * self.context_window
        self.max_step_tokens = max(max_step_tokens, num_slots)
        self.max_rows = MAX_ROWS
        self.tile_rows = self._tile_rows()
        self.tile_seconds = 0.0  # one tile's pass, timed by the self-check (runners/selfcheck.py)
        self.call_cost_rows = CALL_COST_ROWS
        self.lone_row_from: int | None = 0 if pair_rows else LONE_ROW_FROM
        # a call's tokens (a prompt's tiled chunk, under two tiles, may go past a small step's budget), a shape
        # fence's pads included
        self._capacity = max(self.max_step_tokens, 2 * self.tile_rows) + PAD_ROOM
        self.exactness = Exactness(False, checked=False)  # load_exact checks it
        self.forward_calls = 0  # llama_decode calls since start
        # waits until nothing reads the rows a step handed out (the engine sets it: its sampler's helper threads may
        # still read them), before a call that may make llama.cpp give their buffer up for a larger one
        self.settle_readers: Callable[[], None] = lambda: None
        self._decode_s = 0.0  # their wall time (decode_seconds)
        self._adapters: dict[str, Any] = {}  # LoRA adapters by name: llama.cpp's llama_adapter_lora pointers
        self._applied: tuple[tuple[str, float], ...] = ()  # the adapters set on the context now
        self._lock = threading.Lock()  # a step, or an adapter's load or free: never two at once

        n_threads = threads or os.cpu_count() or 1
        self.projector: Projector | None = None
        self._ctx: Any = None
        if mmproj is not None:
            try:
                self.projector = Projector(mmproj, model._model, threads=n_threads, verbose=verbose)
            except Exception:
                model.close()
                raise
            # an image whose positions attend both ways is one micro-batch: as many as fit a step's batch
            self.projector.max_whole = self.max_step_tokens
        cparams = C.llama_context_default_params()
        stream = -(-max(self.context_window, 1) // _CELL_PAD) * _CELL_PAD
        self._window = (self.context_window, stream)  # as asked, and a stream's cells
        cparams.n_ctx = stream * num_slots
        cparams.n_batch = self._capacity
        cparams.n_ubatch = self._capacity
        cparams.n_seq_max = num_slots
        cparams.kv_unified = False  # a stream per sequence: its cells its own, in position order
        # a sliding-window layer's cache as long as the others': its cells stay in position order (a window-sized
        # ring would place them where the window left room), and a cached prefix keeps what a later turn reads
        cparams.swa_full = True
        cparams.flash_attn_type = C.LLAMA_FLASH_ATTN_TYPE_ENABLED  # also what a quantized V cache needs
        cparams.type_k = cparams.type_v = _KV_TYPES[kv_cache_type][0]
        cparams.n_threads = n_threads
        cparams.n_threads_batch = n_threads
        cparams.no_perf = True  # decode_seconds is timed here, around the call: llama.cpp's own counters missed a
        # third of the calls' wall time under load (15.4 of 23.9 s), and reading them gave up the GIL twice a step
        self._ctx = C.llama_init_from_model(model._model, cparams)
        if not self._ctx:
            self.close()
            raise RuntimeError("llama.cpp could not create a context (out of memory?)")
        self._mem = C.llama_get_memory(self._ctx)
        # what a saved sequence state depends on: the model file, the cache's type, the context's layout and
        # llama.cpp's build (a state saved under another fingerprint is never loaded)
        self._model_fingerprint = model.file_fingerprint(kv_cache_type, str(self.context_window), str(num_slots),
                                                         C.__version__)
        self._init_batch(self._capacity)

    @property
    def state_fingerprint(self) -> str:
        """What a saved sequence state depends on: the model's fingerprint and the fences its cells were computed
        under (they round the cells otherwise)."""
        rows = f"|{self.fence.min_rows}x{self.fence.multiple}" if self.fence.shape else ""
        tiles = f"|tiles {self.tile_rows}" if self.tile_rows else ""  # a prompt's first cells are the tiled kernel's
        return hashlib.sha256(f"{self._model_fingerprint}|{self.repack}|{self.pair_rows}{rows}{tiles}".encode()).hexdigest()

    @property
    def pair_rows(self) -> bool:
        return self.fence.pair

    def set_pair_rows(self, on: bool) -> None:
        self.set_fence(Fence(self.repack, 2 if on else 1))

    def set_fence(self, fence: Fence) -> None:
        """The rows rule of `fence` from the next step on (its weights' repacking is the load's: load_exact reloads
        for another). A stream's rows stay below flash attention's tiled kernel with a fence's pads among them."""
        if fence.repack != self.repack:
            raise ValueError("a fence's repacking is chosen at load: reload the model for another")
        self.fence = fence
        self.tile_rows = self._tile_rows()  # the self-check checks them again
        self.lone_row_from = 0 if fence.min_rows > 1 else LONE_ROW_FROM
        self.max_rows = MAX_ROWS // fence.multiple * fence.multiple
        asked, cells = self._window  # a sequence's last position leaves room in its stream for the pads after it
        self.context_window = min(asked, cells - max(fence.min_rows, fence.multiple) + 1) if fence.shape else asked

    def _tile_rows(self) -> int:
        """A prompt's whole tiles on flash attention's tiled kernel: on the CPU (a GPU's kernels take other shapes)."""
        return FA_TILE_ROWS if self.placement == "CPU" else 0

    def _budgeted_context(self, trained: int, slots: int, budget_mib: int, name: str) -> int:
        """The context window a KV budget holds for `slots` streams: the trained context, or less (a multiple of
        256, at least 256); the start-up log says which and why."""
        fits = (budget_mib << 20) // max(1, slots * self.kv_cell_bytes)
        window = trained if trained and trained <= fits else max(_CELL_PAD, fits // _CELL_PAD * _CELL_PAD)
        total = slots * -(-window // _CELL_PAD) * _CELL_PAD * self.kv_cell_bytes
        if trained and window < trained:
            log.info("%s: context window %d of the model's %d tokens: %d streams x %d cells x %d bytes = %d MiB, "
                     "within --kv-budget-mib %d (raise it, or lower --max-num-seqs, for a longer one; "
                     "--context-window sets it outright)", name, window, trained, slots, window, self.kv_cell_bytes,
                     total >> 20, budget_mib)
        else:
            log.info("%s: context window %d tokens (the model's own): %d streams x %d bytes a cell = %d MiB of KV "
                     "cache", name, window, slots, self.kv_cell_bytes, total >> 20)
        return window

    # -- the batch --------------------------------------------------------------------------------
    def _init_batch(self, size: int) -> None:
        self._tok, self._pos, self._seq, self._out, self._batch = _batch(size, outputs=False)
        # a plan's logits rows, however long the step (engine/plan.py)
        self._logits = np.empty((min(size, max_logits_rows(self.num_slots)), self.vocab_size), dtype=np.float32)
        # the last call's logits in llama.cpp's own buffer, and where each run of them goes in self._logits, until
        # copied there (_flush) or handed out whole (a step of one call whose rows lie in the plan's order)
        self._held: tuple[np.ndarray, list[tuple[int, int]]] | None = None
        self._out_rows = 0  # the most logits rows a call has had: more may make llama.cpp move its buffer
        self._views: dict[tuple[int, int], np.ndarray] = {}  # llama.cpp's logits buffer as arrays: (address, rows)
        self._media_batch: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, Any] | None = None
        if self.projector is not None:
            self._media_batch = _batch(self.max_step_tokens, outputs=False, embd=self.projector.n_embd)

    def encode_media(self, media: MediaChunk) -> None:
        if self.projector is None:
            raise ValueError("this model has no vision projector")
        self.projector.embeddings(media)

    def load_adapter(self, name: str, path: str | Path) -> None:
        """A LoRA adapter GGUF loaded for this model under `name`; a ValueError with llama.cpp's reason for a file
        that is not one of this model's adapters."""
        global _log_capture
        with self._lock:
            if name in self._adapters:
                raise ValueError(f"the adapter {name!r} is loaded already")
            if _gguf_tensor_count(path) == 0:  # llama.cpp loads it, and it changes nothing
                raise ValueError("the file holds no tensors (an adapter with nothing to apply)")
            _log_capture = []
            try:
                adapter = C.llama_adapter_lora_init(self.model._model, str(path).encode())
                said = b"".join(_log_capture).decode(errors="replace")
            finally:
                _log_capture = None
            if not adapter:
                lines = [ln.strip() for ln in said.splitlines() if ln.strip()]
                failed = [ln.split(": ", 1)[-1] for ln in lines if "failed" in ln]
                raise ValueError("; ".join(failed or lines[-1:]) or f"llama.cpp could not load {path} as a LoRA adapter")
            self._adapters[name] = adapter

    def free_adapter(self, name: str) -> None:
        """The adapter's weights freed (no request may use it any more)."""
        with self._lock:
            adapter = self._adapters.pop(name, None)
            if adapter is None:
                return
            if any(n == name for n, _ in self._applied):
                C.llama_set_adapters_lora(self._ctx, None, 0, None)
                self._applied = ()
            C.llama_adapter_lora_free(adapter)

    def _use_adapters(self, adapters: tuple[tuple[str, float], ...]) -> None:
        """The context's adapters for the next call (llama.cpp applies them to a whole pass)."""
        if adapters == self._applied:
            return
        n = len(adapters)
        handles = (C.llama_adapter_lora_p_ctypes * n)(*(self._adapters[name] for name, _ in adapters))
        scales = (ctypes.c_float * n)(*(scale for _, scale in adapters))
        rc = C.llama_set_adapters_lora(self._ctx, handles if n else None, n, scales if n else None)
        if rc != 0:
            raise RuntimeError(f"llama.cpp could not set the LoRA adapters {[a for a, _ in adapters]} ({rc})")
        self._applied = adapters

    def step(self, plan: StepPlan) -> np.ndarray:
        with self._lock:
            return self._step(plan)

    def _step(self, plan: StepPlan) -> np.ndarray:
        failed: set[int] = set()  # slots whose Restore the model refused, and slots copied from them since
        for op in plan.ops:
            self._apply(op, failed)
        if failed:
            raise RestoreFailed(failed)
        first, total = [], 0  # each chunk's first logits row
        for chunk in plan.chunks:
            first.append(total)
            total += chunk.num_rows
        calls = plan.calls()
        # the calls with the adapters set now go first: each change of them costs llama.cpp a graph reservation
        calls.sort(key=lambda call: (plan.chunks[call[0]].media is not None, plan.chunks[call[0]].adapters != self._applied))
        before = self.forward_calls
        for call in calls:
            self._decode(plan, call, first)
        held = self._held
        if held is not None and self.forward_calls == before + 1 and _in_order(held[1], total):
            self._held = None  # the step's one call made its rows in the plan's order: no copy of them
            return held[0][:total]
        self._flush()
        return self._logits[:total]

    def _flush(self) -> None:
        """The held call's logits rows copied to their places in self._logits (before another call overwrites them)."""
        if self._held is not None:
            out, places = self._held
            self._held = None
            r = 0
            for row, k in places:
                if row >= 0:
                    self._logits[row : row + k] = out[r : r + k]
                r += k

    def _apply(self, op: KVOp, failed: set[int]) -> None:
        if isinstance(op, Clear):
            C.llama_memory_seq_rm(self._mem, op.slot, -1, -1)
        elif isinstance(op, Keep):
            C.llama_memory_seq_rm(self._mem, op.slot, op.n, -1)
        elif isinstance(op, Copy) and op.src in failed:  # nothing to copy: the destination is as lost
            C.llama_memory_seq_rm(self._mem, op.dst, -1, -1)
            failed.add(op.dst)
        elif isinstance(op, Copy):  # a copy between streams copies the whole stream; what lies past n is dropped
            C.llama_memory_seq_cp(self._mem, op.src, op.dst, -1, -1)
            C.llama_memory_seq_rm(self._mem, op.dst, op.n, -1)
        elif isinstance(op, Save):
            op.into.data = self.save_seq(op.slot)
        else:
            try:
                self.load_seq(op.slot, op.data)
                held = int(C.llama_memory_seq_pos_max(self._mem, op.slot)) + 1
                if int(C.llama_memory_seq_pos_min(self._mem, op.slot)) != 0 or held < op.n:
                    raise RuntimeError(f"the state holds positions up to {held}, not the {op.n} promised")
            except RuntimeError as exc:
                log.warning("a saved prefix-cache state was refused by the model (%s); slot %d is read from its "
                            "prompt instead", exc, op.slot)
                C.llama_memory_seq_rm(self._mem, op.slot, -1, -1)
                failed.add(op.slot)

    def save_seq(self, slot: int) -> bytes:
        """The slot's stream as llama.cpp's per-sequence state (positions, keys and values of every layer)."""
        size = C.llama_state_seq_get_size(self._ctx, slot)
        buf = (ctypes.c_uint8 * size)()
        if C.llama_state_seq_get_data(self._ctx, buf, size, slot) != size:
            raise RuntimeError(f"llama.cpp could not save the state of sequence {slot}")
        return bytes(buf)

    def load_seq(self, slot: int, data: bytes) -> None:
        """The slot's stream replaced by a state save_seq made (of this model and cache type)."""
        C.llama_memory_seq_rm(self._mem, slot, -1, -1)
        buf = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
        if C.llama_state_seq_set_data(self._ctx, buf, len(data), slot) != len(data):
            C.llama_memory_seq_rm(self._mem, slot, -1, -1)
            raise RuntimeError(f"llama.cpp could not restore a saved state into sequence {slot}")

    def _decode(self, plan: StepPlan, call: list[int], first: list[int]) -> None:
        """One llama_decode over the chunks `call` names, laid out micro-batch by micro-batch as llama.cpp cuts it
        (StepPlan.micro_batches), so that it cuts it so; their logits rows go to self._logits at their places."""
        chunks = plan.chunks
        head = chunks[call[0]]
        self._use_adapters(head.adapters)
        if head.media is not None:
            self._decode_media(head, first[call[0]])
            return
        fence = self.fence
        # a LoRA adapter's F32 matmuls take another kernel for a one-row call: an adapter's call has two rows always
        pair = not fence.shape and (fence.pair or bool(head.adapters))
        micros = plan.micro_batches(call)
        # lone rows (the module's docstring): micro-batches of one row of one stream, each a whole chunk (StepPlan.calls)
        lone = [] if fence.shape else [
            m[0][0] for m in micros if len(m) == 1 and m[0][2] == 1 and (pair or chunks[m[0][0]].start >= LONE_ROW_FROM)]
        widen = [self._pads(plan, m) for m in micros] if fence.shape else [0] * len(micros)
        # a shape fence pads a micro-batch only where it is each stream's last: a chunk with more after it goes alone
        stuck = [i for m, j in zip(micros, widen, strict=True) if j < 0 for i, o, k in m if o + k < len(chunks[i].tokens)]
        room = self._capacity - (0 if fence.shape else PAD_ROOM)
        wide = sum(len(chunks[i].tokens) for i in call) + len(lone) + sum(len(m) * j for m, j in zip(micros, widen, strict=True))
        if len(call) > 1 and (stuck or (lone or fence.shape) and wide > room):
            rest = [i for i in call if i not in lone and i not in stuck]
            parts = [[i] for i in lone + stuck] + [rest] if lone or stuck else [call[: len(call) // 2], call[len(call) // 2 :]]
            for part in filter(None, parts):  # no room to widen them here
                self._decode(plan, part, first)
            return
        n = 0
        places: list[tuple[int, int, int]] = []  # (batch row, row in self._logits or -1 for none, rows) per run of logits rows
        pads: list[tuple[int, int]] = []  # (slot, position) of pads, dropped after the call
        for micro, j in zip(micros, widen, strict=True):
            at, mine = n, len(places)
            for i, offset, count in micro:
                chunk = chunks[i]
                tokens, start, lead = chunk.tokens[offset : offset + count], chunk.start + offset, 0
                if i in lone:
                    if chunk.prev_token is not None and start > 0:  # its previous position again, in front
                        C.llama_memory_seq_rm(self._mem, chunk.slot, start - 1, -1)
                        tokens, start, lead = (chunk.prev_token, *tokens), start - 1, 1
                    elif pair:  # none (a sequence's first, or one after an image): a pad after it
                        j = 1
                if j > 0:  # pads after the stream's last row
                    pads.append((chunk.slot, start + len(tokens)))
                    tokens = (*tokens, *(tokens[-1],) * j)
                end = self._put(n, tokens, start, chunk.slot)
                skip = len(chunk.tokens) - chunk.num_rows  # its tokens before the first with a logits row
                lo = max(offset, skip)
                if lo < offset + count:
                    self._out[n + lead + lo - offset : n + lead + count] = 1
                    places.append((n + lead + lo - offset, first[i] + lo - skip, offset + count - lo))
                n = end
            got = sum(r for _, _, r in places[mine:])
            # logits rows that the rule wants beside those asked for, from the micro-batch's others (pads last)
            want = 0 if not got else (2 - got if pair else 0) if not fence.shape else self._short(got)
            if want > 0:
                for row in np.flatnonzero(self._out[at:n] == 0)[-want:] + at:
                    self._out[row] = 1
                    places.append((int(row), -1, 1))
        self._batch.n_tokens = n
        try:
            self._run(self._batch, [(row, k) for _, row, k in sorted(places)])
        finally:
            for slot, pos in pads:
                C.llama_memory_seq_rm(self._mem, slot, pos, -1)

    def _short(self, rows: int) -> int:
        """How many rows `rows` lacks to meet the fence's rule (the fewest that make it)."""
        fence = self.fence
        return max(fence.min_rows, -(-rows // fence.multiple) * fence.multiple) - rows

    def _pads(self, plan: StepPlan, micro: list[tuple[int, int, int]]) -> int:
        """The pads each stream of a micro-batch takes after its rows for the shape fence's rule (as many for each,
        so that llama.cpp cuts the same micro-batch); -1 where some stream has rows after it in the call."""
        rows = sum(k for _, _, k in micro)
        if self.fence.fits(rows):
            return 0
        if any(o + k < len(plan.chunks[i].tokens) for i, o, k in micro):
            return -1
        return next(j for j in range(1, PAD_ROOM) if self.fence.fits(len(micro) * (micro[0][2] + j)))

    def _put(self, n: int, tokens: tuple[int, ...], start: int, slot: int) -> int:
        """The tokens of one stream, from position `start`, into the batch from its token n on, none an output yet;
        returns where they end."""
        end = n + len(tokens)
        if end > len(self._tok):
            raise ValueError(f"a call of {end} tokens or more exceeds the batch of {len(self._tok)}")
        self._tok[n:end] = tokens
        self._pos[n:end] = np.arange(start, start + len(tokens), dtype=np.int32)
        self._seq[n:end] = slot
        self._out[n:end] = 0
        return end

    def _decode_media(self, chunk: ScheduledChunk, row: int) -> None:
        """An image's positions, their embeddings as input, in a pass of their own; a non-causal image (whole, by
        the scheduler) with causal attention off for the pass, as libmtmd's helper does."""
        media = chunk.media
        assert media is not None and self.projector is not None and self._media_batch is not None
        embd, pos, seq, out, batch = self._media_batch
        k = len(chunk.tokens)
        embd[:k] = self.projector.embeddings(media)[chunk.offset : chunk.offset + k]
        pos[:k] = np.arange(chunk.start, chunk.start + k, dtype=np.int32)
        seq[:k] = chunk.slot
        out[:k] = 0
        places = [(row, 1)] if chunk.wants_logits else []
        out[k - 1] = 1 if places else 0
        if places and self.pair_rows and k > 1:  # a second logits row, as for text (the module's docstring)
            out[k - 2] = 1
            places.insert(0, (-1, 1))
        batch.n_tokens = k
        if not media.causal:
            C.llama_set_causal_attn(self._ctx, False)
        try:
            self._run(batch, places)
        finally:
            if not media.causal:
                C.llama_set_causal_attn(self._ctx, True)

    def _run(self, batch: Any, places: list[tuple[int, int]]) -> None:
        """llama_decode; the logits rows it made are held in llama.cpp's buffer (self._held), with where they go in
        self._logits: (row, rows) per run of them, -1 for none."""
        self._flush()
        self.forward_calls += 1
        got = sum(k for _, k in places)
        if got > self._out_rows:  # llama.cpp may free its logits buffer for a larger one: no one may read the old
            self.settle_readers()
        start = time.perf_counter()
        try:
            rc = C.llama_decode(self._ctx, batch)
            logits = C.llama_get_logits(self._ctx) if got and rc == 0 else None  # (a GPU's pass ends at this sync)
        finally:
            self._decode_s += time.perf_counter() - start
        if rc == 1:
            raise KVCacheFull("llama.cpp found no KV cache slot for the batch")
        if rc != 0:
            raise RuntimeError(f"llama_decode failed with code {rc}")
        self._out_rows = max(self._out_rows, got)
        if got:
            self._held = (self._view(logits, got), places)

    def _view(self, logits: Any, rows: int) -> np.ndarray:
        """The first `rows` rows of llama.cpp's logits buffer as an array over it, made once for each address and
        number of rows (numpy's ctypes bridge, run cold after each pass, was about 0.06 ms of a one-stream step on the
        runner alone); the views of a buffer llama.cpp has given up are dropped when another address appears."""
        key = (ctypes.addressof(logits.contents), rows)
        view = self._views.get(key)
        if view is None:
            if any(address != key[0] for address, _ in self._views):
                self._views.clear()
            view = self._views[key] = np.ctypeslib.as_array(logits, shape=(rows, self.vocab_size))
        return view

    @property
    def decode_seconds(self) -> float:
        """Wall time inside the llama_decode calls of steps since start: the pass itself (on the CPU backend the call
        returns when its graph is computed), and the wait for the GIL as the call returns."""
        return self._decode_s

    def clear(self) -> None:
        C.llama_memory_clear(self._mem, True)

    def close(self) -> None:
        """The projector, the context, then the model; a second call does nothing."""
        if self.projector is not None:
            self.projector.close()
        _free(self)
        self.model.close()


def on_a_passing_thread(fn: Callable[[LlamaCppRunner], str], runner: LlamaCppRunner) -> str:
    """fn(runner) on a thread of its own that ends with it. ggml computes with OpenMP, and libgomp keeps a team of
    worker threads for every thread that has started a parallel region, for as long as that thread lives; with two
    teams on the machine's cores it stops spinning its workers between passes, and every llama_decode pays for waking
    them: on 2 cores a lone row took 14 ms instead of 9.5 once the start-up check had computed on the main thread
    and the engine's thread served (docs/performance.md). A thread that ends takes its team with it."""
    result: list[str] = []
    error: list[BaseException] = []

    def run() -> None:
        try:
            result.append(fn(runner))
        except BaseException as exc:  # handed to the caller, as if fn had run there
            error.append(exc)

    thread = threading.Thread(target=run, name="servelm-selfcheck")
    thread.start()
    thread.join()
    if error:
        raise error[0]
    return result[0]


def load_exact(model_path: str | Path, fences: tuple[Fence, ...] | None = None, memo_dir: Path | None = None,
               **kwargs: Any) -> LlamaCppRunner:
    """A LlamaCppRunner with the cheapest fence its self-check passes (runners/selfcheck.py), of `fences` (FENCES:
    none; every call at least two rows; without repacked weights, reloaded; without both; then by shape, where a
    model reads images never). A model that passes none is served as loaded, its `exactness` saying why it is not
    exact. With `memo_dir`, a finding kept there for this model, these settings, this build and this machine is
    taken without checking again (selfcheck.CheckMemo), and a new finding is kept there."""
    runner = LlamaCppRunner(model_path, **kwargs)
    name = Path(model_path).name
    log.info("%s runs on %s", name, runner.placement)
    tried = fences or FENCES
    memo = _memo(runner, tried, memo_dir, kwargs) if memo_dir is not None else None
    found = memo.recall() if memo is not None else None
    if found is not None and (found["fence"] is None or 0 <= found["fence"] < len(tried)):
        return _recalled(runner, model_path, tried, found, kwargs)
    first = ""
    for i, fence in enumerate(tried):
        if fence.shape and runner.projector is not None:
            continue  # an image's rows are its own (no pads among them): no shape fences
        if fence.repack != runner.repack:
            runner.close()
            runner = LlamaCppRunner(model_path, repack=fence.repack, **kwargs)
        runner.set_fence(fence)
        reason = on_a_passing_thread(check_exactness, runner)
        if not reason:
            runner.exactness = Exactness(True, fences=fence.words())
            if first:
                log.info("%s: a row's logits depended on what shared its call (%s); exact with: %s",
                         name, first, ", ".join(fence.words()))
            else:
                log.info("%s: exact under load (the self-check's rows all equal), with no fence of its own", name)
            if memo is not None:
                memo.keep(i, first, runner.tile_rows, runner.tile_seconds)
            return runner
        first = first or reason
    runner.close()
    runner = _not_exact(model_path, first, kwargs)
    if memo is not None:
        memo.keep(None, first, 0, 0.0)
    return runner


def _not_exact(model_path: str | Path, reason: str, kwargs: dict[str, Any]) -> LlamaCppRunner:
    runner = LlamaCppRunner(model_path, **kwargs)
    runner.exactness = Exactness(False, reason=reason)
    log.warning("%s is NOT exact under load on this machine: %s. Its answers may depend on what else the server "
                "runs; /v1/models and /health say so", Path(model_path).name, reason)
    return runner


def _memo(runner: LlamaCppRunner, tried: tuple[Fence, ...], directory: Path, kwargs: dict[str, Any]) -> CheckMemo:
    """The memo of this check: the model file and the context's layout (the runner's fingerprint, which names
    llama.cpp's version), where the model runs, the settings it was loaded with (a projector's file by its size and
    time as well), the fences tried, and llama.cpp's libraries."""
    settings = {k: v for k, v in sorted(kwargs.items()) if k != "verbose"}
    if (mmproj := settings.get("mmproj")) is not None:
        st = Path(mmproj).stat()
        settings["mmproj"] = f"{mmproj}:{st.st_size}:{st.st_mtime_ns}"
    library = Path(C.llama_cpp._lib._name).parent
    return CheckMemo(directory, {"model": runner._model_fingerprint, "placement": runner.placement,
                                 "settings": repr(settings), "fences": repr(tried)},
                     [p for p in library.iterdir() if p.suffix in (".so", ".dylib", ".dll") or ".so." in p.name])


def _recalled(runner: LlamaCppRunner, model_path: str | Path, tried: tuple[Fence, ...], found: dict[str, Any],
              kwargs: dict[str, Any]) -> LlamaCppRunner:
    """The runner as the remembered check left it: its fence (reloaded for another repacking), its tiles, the
    tile's timed pass; or not exact, with the check's reason."""
    name, when = Path(model_path).name, time.strftime("%Y-%m-%d %H:%M", time.localtime(found["checked_at"]))
    index = found["fence"]
    if index is None:
        runner.close()
        log.info("%s: the self-check of %s on this build, machine and settings found it not exact", name, when)
        return _not_exact(model_path, found["reason"], kwargs)
    fence = tried[index]
    if fence.repack != runner.repack:
        runner.close()
        runner = LlamaCppRunner(model_path, repack=fence.repack, **kwargs)
    runner.set_fence(fence)
    runner.tile_rows = min(runner.tile_rows, max(0, found["tile_rows"]))
    runner.tile_seconds = max(0.0, found["tile_seconds"])
    runner.exactness = Exactness(True, fences=fence.words())
    log.info("%s: exact under load%s, as the self-check of %s on this build, machine and settings found "
             "(--no-self-check-cache checks again)", name,
             f" with: {', '.join(fence.words())}" if fence.words() else "", when)
    return runner


class LlamaCppEmbedder:
    """A llama.cpp context in embedding mode: many inputs per forward pass, one pooled vector each.

    Owns its model (loaded from `model_path`), or borrows the model of a LlamaCppRunner (`share`) and owns
    only its context; close() frees what it owns. Pooling comes from the model file unless `pooling` names
    one ("mean", "cls", "last", "rank"): a chat model has none of its own and is asked for "mean". Every forward
    pass carries whole inputs (a pooled vector cannot span two passes), so the batch, the micro-batch and
    the context all have `window` tokens, and one input may have at most `window` tokens.

    With rank pooling (a reranker: a cross-encoder's classification head) the model is a `cross_encoder`: an
    input is a query and a document together (`tokenize_pair`), and its row holds the head's scores.

    `lazy` (with a `pooling` named) makes the context at the first pass, on the thread that runs it, not now: a
    chat model's embedding context costs its start and its memory only where embeddings are asked for.
    """

    _POOLING = {"mean": C.LLAMA_POOLING_TYPE_MEAN, "cls": C.LLAMA_POOLING_TYPE_CLS, "last": C.LLAMA_POOLING_TYPE_LAST,
                "rank": C.LLAMA_POOLING_TYPE_RANK}

    def __init__(
        self,
        model_path: str | Path | None = None,
        *,
        share: LlamaCppRunner | None = None,
        pooling: str | None = None,
        window: int | None = None,
        max_seqs: int = 64,
        threads: int | None = None,
        verbose: bool = False,
        gpu_layers: int | None = None,  # as LlamaCppRunner's, for a model of its own
        main_gpu: int | None = None,
        lazy: bool = False,
    ) -> None:
        if (model_path is None) == (share is None):
            raise ValueError("give either a model path or a runner to share the model of")
        if lazy and pooling is None:
            raise ValueError("a context made later needs its pooling named now")
        self._ctx: Any = None
        self._model: Any = None  # set only when this embedder owns the model
        if share is not None:
            model = share.model._model
            self.description = share.model.description
            self.placement = share.placement
        elif model_path is None:
            raise ValueError("an embedder needs a model file or a runner to share")
        else:
            _silence_llama_logs(verbose)
            C.llama_backend_init()
            model = C.llama_model_load_from_file(str(model_path).encode(),
                                                 _model_params(gpu_layers=gpu_layers, main_gpu=main_gpu))
            if not model:
                raise RuntimeError(f"llama.cpp could not load the model file {model_path}")
            self._model = model
            self.description = Path(model_path).stem
            self.placement = placement(model, gpu_layers, main_gpu)
        self._vocab = C.llama_model_get_vocab(model)
        self.vocab_size = int(C.llama_vocab_n_tokens(self._vocab))
        train_ctx = int(C.llama_model_n_ctx_train(model))
        self.context_window = min(window or train_ctx, train_ctx)
        self.max_batch_tokens = self.context_window
        # llama.cpp's LLAMA_MAX_SEQ is 256; and a pass carries no more inputs than tokens (a context sized for more
        # sequences than its batch has tokens aborts the process as it is made)
        self.max_batch_seqs = max(1, min(max_seqs, 256, self.context_window))

        cparams = C.llama_context_default_params()
        cparams.n_ctx = self.context_window
        cparams.n_batch = self.context_window
        cparams.n_ubatch = self.context_window
        cparams.n_seq_max = self.max_batch_seqs
        cparams.kv_unified = True  # a causal model's inputs share the whole cache (one pass at a time)
        cparams.embeddings = True
        cparams.pooling_type = self._POOLING[pooling] if pooling else C.LLAMA_POOLING_TYPE_UNSPECIFIED
        n_threads = threads or os.cpu_count() or 1
        cparams.n_threads = n_threads
        cparams.n_threads_batch = n_threads
        cparams.no_perf = True
        self._cparams = cparams
        self._llama_model = model  # the model it reads (its own, or the runner's it shares)
        self._mem: Any = None
        if lazy:
            self.cross_encoder = pooling == "rank"
        else:
            self._open()
            self.cross_encoder = C.llama_pooling_type(self._ctx) == C.LLAMA_POOLING_TYPE_RANK
        self.dim = int(C.llama_model_n_cls_out(model) if self.cross_encoder else C.llama_model_n_embd_out(model))
        self._init_batch(self.max_batch_tokens)

    def _open(self) -> None:
        """Make the context (at load, or at a lazy embedder's first pass)."""
        self._ctx = C.llama_init_from_model(self._llama_model, self._cparams)
        if not self._ctx:
            self.close()
            raise RuntimeError("llama.cpp could not create an embedding context (out of memory?)")
        if C.llama_pooling_type(self._ctx) == C.LLAMA_POOLING_TYPE_NONE:
            self.close()
            raise ValueError(f"{self.description} has no pooling: give one (e.g. pooling='mean')")
        self._mem = C.llama_get_memory(self._ctx)  # None for encoder-only models such as BERT

    def _init_batch(self, size: int) -> None:
        self._tok, self._pos, self._seq, self._out, self._batch = _batch(size, outputs=True)  # pooling reads every token

    def tokenize(self, text: str) -> list[int]:
        """Text → token ids with the model's own special tokens (BERT: [CLS] … [SEP]); none parsed from text."""
        return _tokenize(self._vocab, text, True, False)

    def tokenize_pair(self, query: str, document: str) -> list[int]:
        return _pair(self._llama_model, self._vocab, query, document)

    def embed(self, inputs: list[list[int]]) -> np.ndarray:
        """One forward pass over every input, each as its own sequence; rows of pooled (unnormalized) vectors.

        The caller keeps within max_batch_tokens, max_batch_seqs and the vocabulary: llama.cpp aborts the
        process (GGML_ASSERT) rather than return an error for an oversized pass, so this checks again.
        """
        total = sum(len(ids) for ids in inputs)
        if not inputs or total > self.max_batch_tokens or len(inputs) > self.max_batch_seqs:
            raise ValueError(f"a pass of {len(inputs)} inputs and {total} tokens does not fit this context")
        n = 0
        for s, ids in enumerate(inputs):
            k = len(ids)
            if k == 0:
                raise ValueError("an empty input has no embedding")
            self._tok[n : n + k] = ids
            self._pos[n : n + k] = np.arange(k, dtype=np.int32)
            self._seq[n : n + k] = s
            n += k
        if int(self._tok[:n].min()) < 0 or int(self._tok[:n].max()) >= self.vocab_size:
            raise ValueError("a token id is outside the vocabulary")
        self._batch.n_tokens = n
        if not self._ctx:
            self._open()
        try:
            rc = C.llama_decode(self._ctx, self._batch)  # encoder-only models are encoded by llama_decode
            if rc != 0:
                raise RuntimeError(f"llama_decode failed with code {rc} in embedding mode")
            out = np.empty((len(inputs), self.dim), dtype=np.float32)
            for s in range(len(inputs)):
                ptr = C.llama_get_embeddings_seq(self._ctx, s)
                if not ptr:
                    raise RuntimeError(f"llama.cpp returned no pooled embedding for sequence {s}")
                out[s] = np.ctypeslib.as_array(ptr, shape=(self.dim,))
            return out
        finally:
            if self._mem:
                C.llama_memory_clear(self._mem, True)

    def close(self) -> None:
        _free(self)
