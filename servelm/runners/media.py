"""Projector: a deployment's vision projector (an mmproj GGUF) through llama.cpp's multimodal library, libmtmd.

It reads an image file (png, jpeg, gif, bmp: what libmtmd's stb_image decodes) into what the prompt holds in its
place: the projector's marker tokens and its media chunks (MediaChunk), and, on the engine thread, encodes a
chunk into the embeddings the runner decodes into a sequence. libmtmd's context is not thread-safe: every call
into it holds one lock (the reader runs on the request's thread while the engine thread encodes). llama-cpp-python's
own multimodal chat handlers reset the whole context on every request, so they are not used; only the C API is.

Encoded embeddings are kept by the image's key (its bytes' hash and chunk index), up to a byte budget, so that an
image read in pieces, or sent again while it is still kept, is encoded once. This module owns libmtmd's pointers
and frees them.
"""

from __future__ import annotations

import collections
import ctypes
import io
import logging
import os
import re
import struct
import threading
import time
from pathlib import Path
from typing import Any

import llama_cpp as C
import llama_cpp.mtmd_cpp as M
import numpy as np

from servelm.engine.plan import MediaChunk

log = logging.getLogger("servelm.runners")
MAX_PIXELS = 4096 * 4096  # an image larger than this is refused before it is decoded (a small file may hold a huge one)
_CACHE_BYTES = 64 << 20  # encoded embeddings kept for reuse
_errors: collections.deque[str] = collections.deque(maxlen=8)  # libmtmd's latest warnings, for a start-up error
_log_callback: Any = None


def _hook_logs(verbose: bool) -> None:
    """libmtmd's log lines: warnings and errors to stderr (and kept for a start-up error), the rest when verbose."""
    global _log_callback

    def write(level: int, text: bytes, _user: ctypes.c_void_p) -> None:
        if level >= 3 and level != 5:  # GGML_LOG_LEVEL_WARN, ERROR; 5 is CONT
            _errors.append(text.decode("utf-8", errors="replace").strip())
        if verbose or level >= 3 and level != 5:
            os.write(2, text)

    _log_callback = C.llama_log_callback(write)  # kept alive as long as libmtmd may call it
    M.mtmd_log_set(_log_callback, ctypes.c_void_p(0))
    M.mtmd_helper_log_set(_log_callback, ctypes.c_void_p(0))


_FORMATS = {"PNG": "png", "JPEG": "jpeg", "GIF": "gif", "BMP": "bmp"}  # what libmtmd's stb_image decodes
_SOF = re.compile(rb"\xff[\xc0-\xc3\xc5-\xc7\xc9-\xcb\xcd-\xcf]")  # JPEG's start-of-frame markers


def image_size(data: bytes) -> tuple[str, int, int]:
    """The format and the largest pixel size a decoder could read from an image file (png, jpeg, gif, bmp), without
    decoding it. The header is read by Pillow, which reads markers and header variants as decoders do (JPEG fill
    bytes, OS/2 bitmap headers, a PNG's IHDR first); a JPEG's size is also the largest of every frame header its
    bytes hold anywhere, since a decoder takes the first it meets and a crafted file can hide one from a parser that
    reads another. Raises ValueError for anything else (webp included: libmtmd's decoder does not read it)."""
    from PIL import Image, UnidentifiedImageError

    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        raise ValueError("WebP images cannot be decoded by this server; send png, jpeg, gif or bmp")
    if data.startswith(b"\x89PNG") and data[12:16] != b"IHDR":  # a decoder takes the first chunk as the header
        raise ValueError("the PNG data does not begin with its header chunk (IHDR)")
    try:
        with Image.open(io.BytesIO(data), formats=list(_FORMATS)) as image:
            fmt, (width, height) = _FORMATS[str(image.format)], image.size
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError, struct.error, Image.DecompressionBombError) as exc:
        raise ValueError("the data is not an image this server decodes (png, jpeg, gif or bmp)") from exc
    if fmt == "jpeg":
        for match in _SOF.finditer(data):
            at = match.start()
            if at + 9 <= len(data):
                h, w = struct.unpack(">HH", data[at + 5 : at + 9])
                if w * h > width * height:
                    width, height = w, h
    return fmt, width, height


class Projector:
    """libmtmd's context for one model: reads images into prompt pieces and encodes them (see the module doc)."""

    def __init__(self, path: str | Path, model: Any, *, threads: int, verbose: bool = False) -> None:
        _hook_logs(verbose)
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"the projector file does not exist: {self.path}")
        params = M.mtmd_context_params_default()
        params.use_gpu = False
        params.print_timings = False
        params.n_threads = threads
        params.warmup = True
        _errors.clear()
        self._ctx: Any = M.mtmd_init_from_file(str(self.path).encode(), model, params)
        if not self._ctx:
            why = " ".join(_errors) or "see the log above"
            raise ValueError(f"the projector {self.path.name} does not fit this model or could not be loaded: {why}")
        try:
            if not M.mtmd_support_vision(self._ctx):
                raise ValueError(f"the projector {self.path.name} has no vision encoder (audio is not supported)")
            if M.mtmd_decode_use_mrope(self._ctx):
                raise ValueError(f"the projector {self.path.name} places images with M-RoPE positions (Qwen-VL's), "
                                 "which servelm does not support yet")
        except ValueError:
            self.close()
            raise
        self.causal = not M.mtmd_decode_use_non_causal(self._ctx, None)
        self.n_embd = int(C.llama_model_n_embd_inp(model))
        self.max_whole = 0  # the most positions a non-causal chunk may have: set by the runner (its batch)
        self._lock = threading.Lock()
        self._kept: collections.OrderedDict[str, np.ndarray] = collections.OrderedDict()
        self._kept_bytes = 0
        self.kept_bytes_max = _CACHE_BYTES + int(self.path.stat().st_size)  # its cache, and its weights
        self.encoded = 0  # chunks encoded since start
        self.encode_seconds = 0.0

    # -- reading (a request's thread) ---------------------------------------------------------------
    def read(self, data: bytes) -> list[tuple[int, ...] | MediaChunk]:
        _, width, height = image_size(data)
        if width * height > MAX_PIXELS or not width or not height:
            raise ValueError(f"the image is {width} x {height} pixels; this server reads at most {MAX_PIXELS:,} pixels")
        with self._lock:
            out = self._tokenized(data)
        for piece in out:
            if isinstance(piece, MediaChunk) and not self.causal and self.max_whole and piece.length > self.max_whole:
                raise ValueError(f"the image takes {piece.length} positions, more than this deployment's batch of "
                                 f"{self.max_whole} (raise --max-step-tokens)")
        return out

    def _tokenized(self, data: bytes, encode: bool = False) -> list[tuple[int, ...] | MediaChunk]:
        """libmtmd's chunks for the image: text as token tuples, images as MediaChunks; with `encode`, each image
        chunk's embeddings are kept. Called with the lock held."""
        buf = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
        bitmap = M.mtmd_helper_bitmap_init_from_buf(self._ctx, buf, len(data), False)
        if not bitmap:
            raise ValueError("the image could not be decoded")
        chunks = M.mtmd_input_chunks_init()
        try:
            if M.mtmd_bitmap_is_audio(bitmap):
                raise ValueError("the data is audio, not an image")
            part = M.mtmd_input_part()
            part.bitmap = bitmap
            parts = (ctypes.POINTER(M.mtmd_input_part) * 1)(ctypes.pointer(part))
            if M.mtmd_tokenize_from_parts(self._ctx, chunks, parts, 1, False) != 0:
                raise ValueError("the projector could not read the image")
            out: list[tuple[int, ...] | MediaChunk] = []
            k = 0
            for i in range(M.mtmd_input_chunks_size(chunks)):
                chunk = M.mtmd_input_chunks_get(chunks, i)
                if M.mtmd_input_chunk_get_type(chunk) == M.MTMD_INPUT_CHUNK_TYPE_TEXT:
                    n = ctypes.c_size_t()
                    ids = M.mtmd_input_chunk_get_tokens_text(chunk, ctypes.byref(n))
                    out.append(tuple(ids[j] for j in range(n.value)))
                    continue
                media = MediaChunk(data, k, int(M.mtmd_input_chunk_get_n_tokens(chunk)), self.causal)
                if encode:
                    self._encode(media.key, chunk, media.length)
                out.append(media)
                k += 1
            return out
        finally:
            M.mtmd_input_chunks_free(chunks)
            M.mtmd_bitmap_free(bitmap)

    # -- encoding (the engine thread) -----------------------------------------------------------------
    def embeddings(self, media: MediaChunk) -> np.ndarray:
        """The chunk's embeddings, (length, n_embd) float32: kept ones, else the image's chunks encoded now."""
        kept = self._kept.get(media.key)
        if kept is None:
            with self._lock:
                self._tokenized(media.data, encode=True)
            kept = self._kept.get(media.key)
            if kept is None or len(kept) != media.length:
                raise ValueError("the image read differently than when the request was prepared")
        self._kept.move_to_end(media.key)
        return kept

    def _encode(self, key: str, chunk: Any, n_tokens: int) -> None:
        start = time.perf_counter()
        if M.mtmd_encode_chunk(self._ctx, chunk) != 0:
            raise RuntimeError("libmtmd failed to encode the image")
        embd = np.ctypeslib.as_array(M.mtmd_get_output_embd(self._ctx), shape=(n_tokens, self.n_embd)).copy()
        self.encode_seconds += time.perf_counter() - start
        self.encoded += 1
        self._kept[key] = embd
        self._kept_bytes += embd.nbytes
        while self._kept_bytes > _CACHE_BYTES and len(self._kept) > 1:
            _, old = self._kept.popitem(last=False)
            self._kept_bytes -= old.nbytes

    def close(self) -> None:
        if self._ctx:
            M.mtmd_free(self._ctx)
            self._ctx = None
