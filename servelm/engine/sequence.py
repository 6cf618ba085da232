"""Per-sequence and per-request state as the scheduler keeps it: which tokens, which slot, how far computed.

Only the scheduler writes it (Scheduler.update after each step, add/abort/schedule between them); the other stages
of a step name a sequence by its key (plan.SeqKey) and keep their own state of it (engine/choice.py).

A request with n choices is a SequenceGroup of n Sequences. The group's prompt is computed once, by its
first sequence; the others then get copies of those KV cells in their own slots (a fork) and sample their
first tokens from the same logits row, each with its own RNG.
"""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field

from servelm.engine.plan import SeqKey
from servelm.engine.speculate import Drafter
from servelm.engine.types import MediaSpan, SamplingParams, Tenant


class SeqStatus(enum.Enum):
    WAITING = "waiting"  # no slot yet
    FORK_PENDING = "fork_pending"  # holds a slot; waits for the group's prompt to be computed
    RUNNING = "running"  # holds a slot; prefilling or decoding
    FINISHED = "finished"


_seq_keys = itertools.count()


@dataclass(eq=False)
class Sequence:
    group: SequenceGroup
    index: int
    token_ids: list[int]
    status: SeqStatus = SeqStatus.WAITING
    num_computed: int = 0  # tokens whose KV cells are in its slot's stream
    slot: int | None = None  # the llama.cpp sequence id (its own KV stream) while it holds one
    key: SeqKey = field(default_factory=lambda: SeqKey(next(_seq_keys)))
    drafter: Drafter | None = None  # its prompt-lookup index and rate of kept guesses, once it decodes
    last_row: int = 0  # the scheduler's step in which it last had a decoding row (rows that yield go in turn)

    @property
    def prompt_len(self) -> int:
        return self.group.prompt_len

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def num_pending(self) -> int:
        """Tokens that still need a forward pass before the next one can be sampled."""
        return len(self.token_ids) - self.num_computed

    @property
    def reads_prompt(self) -> bool:
        """Running, with more than its next token still to compute: a prompt (or what is left of one) to read."""
        return self.status is SeqStatus.RUNNING and self.num_pending > 1

    @property
    def holds_slot(self) -> bool:
        return self.slot is not None


@dataclass(eq=False)
class SequenceGroup:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    arrival: int = field(default_factory=lambda: next(_seq_keys))
    seqs: list[Sequence] = field(default_factory=list)
    forked: bool = False  # the others have copies of the first one's prompt cells
    cached_tokens: int = 0  # prompt tokens whose cells came from the prefix cache
    scope: str = ""  # the prefix-cache scope it reads and writes (GenerationRequest.cache_scope)
    pin_seconds: float = 0.0  # its cells at rest are given up after others' for this long (GenerationRequest's)
    media: tuple[MediaSpan, ...] = ()  # images in the prompt, in position order
    priority: int = 0  # lower runs first (vLLM's); equal ones first come, first served
    adapters: tuple[tuple[str, float], ...] = ()  # LoRA adapters its rows are computed with (name, scale)
    preempted: int = 0  # times its sequence gave its slot up to a request ranked above it
    tenant: Tenant = Tenant()  # who it counts against for the slots' fair share (engine/fairness.py)
    # its prompt positions below this are read in whole tiles of the runner's tile_rows (flash attention's tiled
    # kernel), the rest a few rows at a time (its row kernel): set by the scheduler when it is added (0: none)
    tiled_end: int = 0
    # perf_counter times: received by the engine, first scheduled (its prompt begins), its first token
    received_at: float = field(default_factory=time.perf_counter)
    started_at: float = 0.0
    first_token_at: float = 0.0

    def __post_init__(self) -> None:
        if not self.seqs:
            self.seqs = [Sequence(self, i, list(self.prompt_token_ids)) for i in range(self.params.num_seqs)]

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def live(self) -> list[Sequence]:
        return [s for s in self.seqs if s.status is not SeqStatus.FINISHED]

    @property
    def finished(self) -> bool:
        return all(s.status is SeqStatus.FINISHED for s in self.seqs)

    def span_at(self, pos: int) -> MediaSpan | None:
        """The image whose positions include `pos`, if any."""
        for span in self.media:
            if span.start <= pos < span.end:
                return span
        return None

    def next_span(self, pos: int) -> MediaSpan | None:
        """The first image at or after `pos`."""
        return next((span for span in self.media if span.start >= pos), None)

    def whole(self, n: int) -> int:
        """n leading prompt positions, cut back to the start of an image they would end inside: an image's cells
        are reused whole or read again whole (its positions are read in the same pieces every time)."""
        span = self.span_at(n)
        return span.start if span is not None and span.start < n else n

    @property
    def preemptible(self) -> bool:
        """Whether it can give its slot up and resume later with the same answer: one running sequence, no beam
        search, no prompt logprobs, no image."""
        return (len(self.seqs) == 1 and self.seqs[0].status is SeqStatus.RUNNING and self.params.beam is None
                and self.params.prompt_logprobs is None and not self.media)

    def holds_kv(self) -> bool:
        return any(s.holds_slot for s in self.seqs)
