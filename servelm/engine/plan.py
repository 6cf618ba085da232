"""One step's plan, the only thing a runner needs to know of the engine: which tokens of which slot go into the
forward pass, and which KV operations run before it.

Each slot is a sequence id with a KV stream of its own (llama.cpp's non-unified cache): a sequence's cells are
its own, in position order, whatever else runs, which is half of what makes a sequence's logits independent of
its neighbours (docs/exactness.md). The runner reads the chunks under the rules that give the other half.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import groupby
from typing import NewType, Protocol

from servelm.engine.types import MediaChunk as MediaChunk  # what a runner reads an image chunk as

SeqKey = NewType("SeqKey", int)  # a sequence, as the engine's stages name it (engine/sequence.py's Sequence.key)
Piece = tuple[int, int, int]  # a chunk's tokens in one micro-batch: (chunk index, first token, tokens)
# Logits rows a step makes at most beyond one a sequence (a decoding row, a prompt's last): guesses and rows read for
# prompt logprobs stop there, whatever the step's token budget. A row is the whole vocabulary in float32 (1 MiB on a
# 262k one), which llama.cpp's output buffer and the runner's copy each hold, so this bounds their memory.
LOGITS_ROWS = 256


def max_logits_rows(num_slots: int) -> int:
    """The logits rows a step of a runner with `num_slots` slots makes at most."""
    return LOGITS_ROWS + num_slots


@dataclass(frozen=True, slots=True)
class Clear:
    """The slot's stream is emptied."""

    slot: int


@dataclass(frozen=True, slots=True)
class Keep:
    """The slot keeps its first `n` positions; the rest are dropped (a cached prefix reused in place)."""

    slot: int
    n: int


@dataclass(frozen=True, slots=True)
class Copy:
    """Slot `dst` gets the first `n` positions of slot `src` (a fork, a beam, a prefix another request read).

    llama.cpp copies one stream to another at its next forward pass, not when asked: until a plan with chunks is
    read, no Save of `dst` and no Restore into either slot may follow (the cells saved would be the ones `dst` held
    before; restored ones would be overwritten, or copied on). The scheduler keeps to it; the fake runner checks it."""

    src: int
    dst: int
    n: int


class SavedState(Protocol):
    data: bytes | None


@dataclass(frozen=True, slots=True)
class Save:
    """The slot's cells (its whole stream) are copied out to host memory, into `into.data`, before an op that gives
    them up (engine/spill.py)."""

    slot: int
    into: SavedState


@dataclass(frozen=True, slots=True)
class Restore:
    """The slot's stream is replaced by cells a Save copied out (from host memory, or a file), which must hold at
    least its first `n` positions. A runner that cannot restore them empties the slot and reports it (the step's
    other operations done, none of its chunks read): engine.runner.RestoreFailed."""

    slot: int
    data: bytes
    n: int


KVOp = Clear | Keep | Copy | Save | Restore


@dataclass(frozen=True, slots=True)
class ScheduledChunk:
    seq: SeqKey  # the sequence whose tokens these are (runners read only the fields below)
    slot: int
    start: int  # position of the first token
    tokens: tuple[int, ...]
    prev_token: int | None = None  # the token at start - 1, which a runner may read again beside a lone row
    samplers: tuple[SeqKey, ...] = ()  # the sequences that sample from the chunk's last row
    all_logits: bool = False  # a logits row for every token (prompt logprobs), not only the last
    # an image's positions: their inputs are its embeddings from `offset` on (tokens hold its placeholders)
    media: MediaChunk | None = None
    offset: int = 0
    # the last `drafted` tokens are guesses (engine/speculate.py): a row for each, after the sampler's row
    drafted: int = 0
    adapters: tuple[tuple[str, float], ...] = ()  # LoRA adapters (name, scale) its rows are computed with
    # a tile of the runner's tile_rows or more, read on flash attention's tiled kernel (ModelRunner.tile_rows): in a
    # call with tiled chunks of its length alone, so that every micro-batch gives each of its streams all of its rows
    tiled: bool = False

    @property
    def wants_logits(self) -> bool:
        return bool(self.samplers) or self.all_logits

    @property
    def num_rows(self) -> int:
        """Logits rows it makes: one per token read for its logprobs, else the sampler's and one per guess."""
        if self.all_logits:
            return len(self.tokens)
        return 1 + self.drafted if self.samplers else 0


@dataclass(slots=True)
class StepPlan:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    ops: list[KVOp] = field(default_factory=list)  # in the order they were decided, before the forward pass
    # slots whose Restore the runner refused (engine.runner.RestoreFailed): the plan as read again without their
    # chunks and without its (done) operations; Scheduler.update has those sequences read their prompts instead
    refused: frozenset[int] = frozenset()
    decode_tokens: int = 0  # of its tokens, those of decoding sequences (guesses included); the rest are prompts'

    @property
    def num_tokens(self) -> int:
        return sum(len(c.tokens) for c in self.chunks)

    @property
    def has_media(self) -> bool:
        return any(c.media is not None for c in self.chunks)

    @property
    def has_work(self) -> bool:
        return bool(self.chunks or self.ops)

    @property
    def logits_rows(self) -> int:
        return sum(c.num_rows for c in self.chunks)

    @property
    def max_drafted(self) -> int:
        return max((c.drafted for c in self.chunks), default=0)

    def without(self, keep: Callable[[ScheduledChunk], bool]) -> StepPlan:
        """The plan with only the chunks `keep` accepts (its operations and refusals as they are)."""
        return StepPlan([c for c in self.chunks if keep(c)], self.ops, self.refused)

    def rows(self) -> list[int]:
        """For each chunk, the logits row its samplers read (-1 when it has none): the last token's, or for a
        drafted chunk the row before its guesses, which come next. Runners return rows in chunk order: every
        row of an all-logits chunk, the last 1 + drafted rows of the others."""
        out, r = [], 0
        for chunk in self.chunks:
            n = chunk.num_rows
            out.append(-1 if not n else r + n - 1 if chunk.all_logits else r)
            r += n
        return out

    def calls(self) -> list[list[int]]:
        """The chunks (by index, in slot order) cut into llama_decode calls, as few as keep every row exact: one call
        for each set of LoRA adapters (they apply to a whole call) and another for each length of its tiled chunks
        (every micro-batch of which then gives each stream its whole chunk), less any chunk whose last token would be
        a micro-batch of its own (_lone_row), which goes in a call of its own. An image's chunk is a call of its
        own, last (llama.cpp takes a batch of embeddings or of tokens, not both)."""
        out: list[list[int]] = []
        chunks = self.chunks

        def kind(i: int) -> tuple[tuple[tuple[str, float], ...], int]:
            return chunks[i].adapters, len(chunks[i].tokens) if chunks[i].tiled else 0

        text = sorted((i for i, c in enumerate(chunks) if c.media is None), key=lambda i: (*kind(i), chunks[i].slot))
        for _, group in groupby(text, key=kind):
            call = list(group)
            while len(call) > 1 and (lone := self._lone_row(call)) is not None:
                call.remove(lone)
                out.append([lone])
            out.append(call)
        return out + [[i] for i, c in enumerate(chunks) if c.media is not None]

    def micro_batches(self, call: list[int]) -> list[list[Piece]]:
        """How llama.cpp cuts a call (chunks in slot order, one a slot) into micro-batches: its split_equal for a
        KV stream a sequence takes, from the first sequence with tokens left, the run of consecutive sequence ids
        with tokens left, and from each as many tokens as the shortest has left. Each micro-batch's pieces are
        (chunk index, first token, tokens). A runner that lays a call out in this order (micro-batch by
        micro-batch, each in slot order) gets them back as they are, its outputs in its own order. Each is
        computed with the same kernels whatever else it holds, so a row's logits do not depend on its neighbours
        (docs/exactness.md): a stream's rows stay below MAX_ROWS as its chunk does, or (a call of tiled chunks, all
        of one length) are its whole chunk."""
        chunks = self.chunks
        slots = [chunks[i].slot for i in call]
        sizes = [len(chunks[i].tokens) for i in call]
        left = list(sizes)
        out: list[list[Piece]] = []
        first, n = 0, len(call)
        while True:
            while first < n and not left[first]:  # the ones before it have no tokens left, and never again
                first += 1
            if first == n:
                return out
            end = first + 1  # the run: [first, end)
            while end < n and left[end] and slots[end] == slots[end - 1] + 1:
                end += 1
            k = min(left[first:end])
            out.append([(call[j], sizes[j] - left[j], k) for j in range(first, end)])
            for j in range(first, end):
                left[j] -= k

    def _lone_row(self, call: list[int]) -> int | None:
        """The chunk whose last token would be a micro-batch of its own, a single row of a single stream, if one is.
        A runner keeps such a row exact by reading its previous position again beside it (the llama.cpp runner's
        docstring), which it can only where that position is not read in the same call: a chunk of one token
        alone in its stream's micro-batch stays, a longer chunk's last token goes with the chunk to a call of its
        own."""
        return next((mb[0][0] for mb in self.micro_batches(call) if len(mb) == 1 and mb[0][1] and mb[0][2] == 1),
                    None)
