"""A model's exactness, checked at start-up (docs/exactness.md).

The same probe tokens are read in the shapes serving gives them, and every logits row is compared bitwise with
the row the one-chunk read made of the same position:
- a token a step, alone (a lone decode row);
- a token a step, beside other sequences' tokens (a decode step of several streams);
- in chunks of other sizes, in another slot (a prompt read in pieces; a cached prefix read on from);
- in chunks beside another sequence's chunk of the same length (two prompts read in one call).
A runner that passes computes a row the same way whatever shares its call, which is what makes answers exact
under load. The check takes a few dozen forward passes of the probe's length; it leaves the slots it used empty.

A runner with tiles (ModelRunner.tile_rows: a prompt's whole tiles read on flash attention's tiled kernel) that
passes has them checked too, on a probe of two tiles: read a tile a call alone, two tiles in one chunk, the rest of
them from inside the first tile on (a cached prefix's end), and a tile beside another sequence's tile; the row after
each chunk is compared (every cell of the chunk is in its view).
Should one differ, the runner reads no tiles (tile_rows 0), and says so in the log. The second tile's pass is timed
(ModelRunner.tile_seconds): a tile is read whole, so a decoding step that reads one takes at least that long.

CheckMemo remembers what a check found, in a file named by everything the finding depends on: the model file,
the runner's settings and the fences tried, llama.cpp's build (its libraries' sizes and times), this machine's CPU,
and the code of the check and of the runner. A start that matches all of it takes the finding without reading the
probe again; any change to one of them checks again. A file that is missing, unreadable, corrupt or of another
key is ignored (and replaced by the next check's); a directory that cannot be written leaves every start checking.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import platform
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from servelm.engine.plan import Clear, Keep, ScheduledChunk, SeqKey, StepPlan
from servelm.engine.runner import ModelRunner

PROBE_TOKENS = 24
_PIECES = (5, 1, 7, 11)  # the probe read in chunks of these sizes
_NEIGHBOURS = 9  # decode rows beside the probe's: past the 8 rows where some kernels switch

log = logging.getLogger("servelm.runner")


MEMO_VERSION = 1
MEMO_MAX_BYTES = 64 << 10  # a finding is a few hundred bytes: a bigger file is not one of ours
_MEMO_FIELDS: dict[str, type | tuple[type, ...]] = {"version": int, "key": str, "fence": (int, type(None)), "reason": str, "tile_rows": int,
                "tile_seconds": float, "checked_at": float}


_KERNEL_ENV = ("GGML_", "LLAMA_", "CUDA_", "OMP_", "SERVELM_CUDA")  # variables that choose kernels or devices


def _machine() -> str:
    """This machine's CPU as its kernels see it: the model name and feature flags, the architecture, the cores, and
    the environment's variables that choose kernels (GGML_CPU_TILED_MM among them) or devices."""
    cpu = ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            cpu = "|".join(line.strip() for line in f.read(1 << 16).split("\n\n")[0].splitlines()
                           if line.startswith(("model name", "flags", "Features", "CPU part")))
    except OSError:
        cpu = platform.processor()
    kernels = sorted((k, v) for k, v in os.environ.items() if k.startswith(_KERNEL_ENV))
    return f"{platform.machine()}|{os.cpu_count()}|{cpu}|{kernels}"


def _files(paths: list[Path]) -> str:
    """Each file's name, size and modification time (a rebuilt library or an edited source is another key)."""
    out = []
    for p in sorted(paths):
        try:
            st = p.stat()
            out.append(f"{p.name}:{st.st_size}:{st.st_mtime_ns}")
        except OSError:
            out.append(f"{p.name}:missing")
    return ";".join(out)


def _code() -> str:
    """The check's own code and the runner's: a change to either checks again."""
    here = Path(__file__).resolve().parent
    h = hashlib.sha256()
    for name in ("selfcheck.py", "llamacpp.py"):
        try:
            h.update((here / name).read_bytes())
        except OSError:
            h.update(name.encode())
    return h.hexdigest()


class CheckMemo:
    """A self-check's finding, kept in `directory` under a key of `parts` (with this machine, the check's code and
    MEMO_VERSION). recall() gives the finding only when the file is ours and its key is this one."""

    def __init__(self, directory: Path, parts: Mapping[str, object], libraries: list[Path]) -> None:
        text = json.dumps({**{k: str(v) for k, v in parts.items()}, "machine": _machine(), "code": _code(),
                           "libraries": _files(libraries), "version": MEMO_VERSION}, sort_keys=True)
        self.key = hashlib.sha256(text.encode()).hexdigest()
        self.path = Path(directory) / f"{self.key[:32]}.json"

    def recall(self) -> dict[str, Any] | None:
        try:
            with open(self.path, "rb") as f:
                raw = f.read(MEMO_MAX_BYTES + 1)
        except OSError:
            return None
        try:
            found = json.loads(raw) if len(raw) <= MEMO_MAX_BYTES else None
        except ValueError:
            found = None
        if not isinstance(found, dict) or set(found) != set(_MEMO_FIELDS) or found["key"] != self.key or \
                found["version"] != MEMO_VERSION or \
                not all(isinstance(found[k], t) and not isinstance(found[k], bool) for k, t in _MEMO_FIELDS.items()):
            log.info("the self-check's remembered finding %s is not one of this key's: checking again", self.path)
            return None
        return found

    def keep(self, fence: int | None, reason: str, tile_rows: int, tile_seconds: float) -> None:
        found = {"version": MEMO_VERSION, "key": self.key, "fence": fence, "reason": reason, "tile_rows": tile_rows,
                 "tile_seconds": float(tile_seconds), "checked_at": time.time()}
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps(found), encoding="utf-8")
            os.replace(tmp, self.path)
        except OSError as exc:
            log.warning("the self-check's finding could not be kept in %s (%s): the next start checks again",
                        self.path.parent, exc.strerror or exc)
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)


def _probe(vocab_size: int, n: int, seed: int) -> list[int]:
    rng = np.random.default_rng(seed)
    return [int(t) for t in rng.integers(min(100, vocab_size - 1), vocab_size, n)]


def _chunk(slot: int, start: int, tokens: list[int], *, prev: int | None, all_logits: bool = False,
           tiled: bool = False) -> ScheduledChunk:
    return ScheduledChunk(SeqKey(slot), slot, start, tuple(tokens), prev, samplers=(SeqKey(slot),), all_logits=all_logits,
                          tiled=tiled)


class _Compare:
    def __init__(self, reference: np.ndarray) -> None:
        self.reference = reference
        self.failure = ""

    def row(self, shape: str, position: int, row: np.ndarray) -> None:
        if self.failure or np.array_equal(row, self.reference[position]):
            return
        delta = float(np.max(np.abs(row.astype(np.float64) - self.reference[position])))
        self.failure = f"position {position} read {shape} has other logits than read in one chunk (largest " \
                       f"difference {delta:.3g})"


def check_exactness(runner: ModelRunner, length: int = PROBE_TOKENS) -> str:
    """Reads the probe in each shape on `runner` (its slots must be empty); returns "" when every row equals the
    one-chunk read's, else what differed first."""
    length = min(length, runner.max_rows, runner.context_window)
    toks = _probe(runner.vocab_size, length, 0)
    slots = runner.num_slots
    last = slots - 1
    used = list(range(min(slots, _NEIGHBOURS + 1)))

    def step(chunks: list[ScheduledChunk], clear: tuple[int, ...] = ()) -> np.ndarray:
        return np.array(runner.step(StepPlan(chunks, [Clear(s) for s in clear])), copy=True)

    def prev(p: int) -> int | None:
        return toks[p - 1] if p else None

    try:
        cmp = _Compare(step([_chunk(0, 0, toks, prev=None, all_logits=True)], clear=(0,)))
        for p in range(length):  # a token a step, alone
            cmp.row("a token a step, alone", p, step([_chunk(0, p, [toks[p]], prev=prev(p))], (0,) if p == 0 else ())[0])
        if slots > 1:  # a token a step, beside other sequences' tokens
            others = [_probe(runner.vocab_size, length, s) for s in used]
            for p in range(length):
                chunks = [_chunk(0, p, [toks[p]], prev=prev(p))]
                chunks += [_chunk(s, p, [others[s][p]], prev=others[s][p - 1] if p else None) for s in used[1:]]
                cmp.row(f"a token a step beside {len(used) - 1} other sequences", p,
                        step(chunks, tuple(used) if p == 0 else ())[0])
        start = 0  # in chunks of other sizes, in the last slot
        for size in _PIECES:
            size = min(size, length - start)
            if size <= 0:
                break
            rows = step([_chunk(last, start, toks[start : start + size], prev=prev(start))], (last,) if start == 0 else ())
            cmp.row(f"in chunks of {'/'.join(map(str, _PIECES))} in slot {last}", start + size - 1, rows[0])
            start += size
        if slots > 1:  # in chunks beside another sequence's chunk of the same length
            other = _probe(runner.vocab_size, length, 99)
            half = length // 2
            for a, b in ((0, half), (half, length)):
                chunks = [_chunk(0, a, toks[a:b], prev=prev(a)), _chunk(1, a, other[a:b], prev=other[a - 1] if a else None)]
                cmp.row("in a chunk beside another sequence's chunk", b - 1, step(chunks, (0, 1) if a == 0 else ())[0])
        if not cmp.failure and runner.tile_rows and (why := _check_tiles(runner, step)):
            log.warning("flash attention's tiled kernel is not exact here (%s): prompts are read a few rows at a "
                        "time instead", why)
            runner.tile_rows = 0
        return cmp.failure
    finally:
        runner.step(StepPlan([], [Clear(s) for s in sorted({*used, *range(min(slots, 4)), last})]))


def _check_tiles(runner: ModelRunner, step: Callable[[list[ScheduledChunk], tuple[int, ...]], np.ndarray]) -> str:
    """Two tiles of probe tokens read a tile a call in slot 0 (the reference), then as one chunk of two tiles in
    slot 1, then in slot 1 again from inside the first tile on (its cells cut there, as a cached prefix's are), then
    the first tile beside another sequence's (slots 2 and 3): "" when the last row of each read equals
    the reference's (each row attends to every cell of its chunk, so a cell computed otherwise shows in it), else
    what differed first. Timed where the context holds two tiles, compared where a step carries them too."""
    tile = runner.tile_rows
    if runner.context_window < 2 * tile:
        return ""
    toks = _probe(runner.vocab_size, 2 * tile, 7)
    other = _probe(runner.vocab_size, tile, 70)

    def chunk(slot: int, start: int, n: int, probe: list[int]) -> ScheduledChunk:
        return _chunk(slot, start, probe[start : start + n], prev=probe[start - 1] if start else None, tiled=True)

    first = step([chunk(0, 0, tile, toks)], (0,))[0]
    began = time.perf_counter()
    second = step([chunk(0, tile, tile, toks)], ())[0]
    # a tile's pass, its shape read once already: timed whatever the slots and the step (compose.settle_tiles
    # decides by it), so that servers of one machine and model decide alike
    runner.tile_seconds = time.perf_counter() - began
    if runner.num_slots < 4 or runner.max_step_tokens < 2 * tile:
        return ""  # the comparisons below take four slots and a step of two tiles
    cmp = _Compare(np.stack([first, second]))
    cmp.row("as one chunk of two tiles", 1, step([chunk(1, 0, 2 * tile, toks)], (1,))[0])
    cut = tile // 2 + 2  # the rest from here: more than a tile, starting inside the first
    rest = runner.step(StepPlan([chunk(1, cut, 2 * tile - cut, toks)], [Keep(1, cut)]))
    cmp.row("from inside its first tile on", 1, np.array(rest[0], copy=True))
    cmp.row("a tile beside another sequence's tile", 0, step([chunk(2, 0, tile, toks), chunk(3, 0, tile, other)],
                                                              (2, 3))[0])
    return cmp.failure
