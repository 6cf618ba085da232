"""FakeRunner: a scripted, deterministic model for fast tests of the engine, scheduler and HTTP layer.

It keeps its own book of KV cells per sequence slot and checks every plan against it (a decode at
position p needs cells 0..p-1 of that slot; forks copy, frees remove), so a scheduler bug shows up as
an error here rather than as subtly wrong text.

The "model": token t is followed by t+1 (wrapping from vocab-1 to FIRST_WORD), except that
END_TOKEN is followed by EOS. Text: token t is the letter chr(ord('a') + t % 26).
"""

from __future__ import annotations

import time

import numpy as np

from servelm.engine.scheduler import StepPlan

EOS = 0
FIRST_WORD = 1
END_TOKEN = 40


class FakeKVError(AssertionError):
    pass


class FakeRunner:
    def __init__(
        self,
        *,
        vocab_size: int = 64,
        num_slots: int = 4,
        spare_seqs: int = 8,
        kv_cells: int = 256,
        max_step_tokens: int = 32,
        context_window: int = 128,
        step_delay: float = 0.0,
        fim_tokens: tuple[int, int, int] | None = None,
    ) -> None:
        self.vocab_size = vocab_size
        self.num_slots = num_slots
        self.spare_seqs = spare_seqs
        self.kv_cells = kv_cells
        self.max_step_tokens = max_step_tokens
        self.context_window = context_window
        self.step_delay = step_delay
        self.fim_tokens = fim_tokens  # fill-in-the-middle (prefix, suffix, middle) tokens, if the model has them
        self.eog_ids = np.array([EOS], dtype=np.int64)
        self.chat_template = (
            "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}"
        )
        self.bos_token = ""
        self.eos_token = "</s>"
        self.description = "fake"
        self.cells: dict[int, list[int]] = {}  # slot → tokens at positions 0..len-1
        self.cell_ids: dict[int, list[int]] = {}  # slot → the identity of each of its cells (a copy shares them)
        self._next_cell = 0
        self.steps: list[StepPlan] = []
        self.max_cells_seen = 0

    # -- text -------------------------------------------------------------------------------------
    def tokenize(self, text: str, *, add_special: bool, parse_special: bool) -> list[int]:
        return [FIRST_WORD + (ord(c) % (self.vocab_size - FIRST_WORD)) for c in text]

    def token_bytes(self, token: int) -> bytes:
        return b"" if token == EOS else chr(ord("a") + token % 26).encode()

    def tokenize_text(self, data: bytes) -> list[int]:
        """Plain text → tokens that spell it (letters only; other bytes have no token here)."""
        return [(c - ord("a")) or 26 for c in data if ord("a") <= c <= ord("z")]

    def token_table(self) -> list[bytes]:
        return [b"\xff</s>" if t == EOS else self.token_bytes(t) for t in range(self.vocab_size)]

    def next_token(self, token: int) -> int:
        if token == END_TOKEN:
            return EOS
        return token + 1 if token + 1 < self.vocab_size else FIRST_WORD

    # -- the forward pass -------------------------------------------------------------------------
    def step(self, plan: StepPlan) -> np.ndarray:
        for op in plan.ops:
            if op[0] == "rm":
                self.cells.pop(op[1], None)
                self.cell_ids.pop(op[1], None)
                continue
            _, src, dst, n = op
            if len(self.cells.get(src, [])) < n:
                raise FakeKVError(f"copy of {n} cells from slot {src}, which holds {len(self.cells.get(src, []))}")
            if self.cells.get(dst):
                raise FakeKVError(f"copy into slot {dst}, which already holds cells")
            self.cells[dst] = list(self.cells[src][:n])
            self.cell_ids[dst] = list(self.cell_ids[src][:n])
        rows = []
        total = self.cells_in_use()
        for chunk in plan.chunks:
            slot = chunk.seq.slot
            held = self.cells.setdefault(slot, [])
            if chunk.start != len(held):
                raise FakeKVError(f"slot {slot} holds {len(held)} cells but the chunk starts at {chunk.start}")
            held.extend(chunk.tokens)
            self.cell_ids.setdefault(slot, []).extend(range(self._next_cell, self._next_cell + len(chunk.tokens)))
            self._next_cell += len(chunk.tokens)
            total += len(chunk.tokens)
            if chunk.all_logits:
                rows.extend(self.logits_after(t) for t in chunk.tokens)
            elif chunk.wants_logits:
                rows.append(self.logits_after(held[-1]))
        if total > self.kv_cells:
            raise FakeKVError(f"{total} cells in use, more than the cache's {self.kv_cells}")
        self.max_cells_seen = max(self.max_cells_seen, total)
        self.steps.append(plan)
        if self.step_delay:
            time.sleep(self.step_delay)
        if not rows:
            return np.empty((0, self.vocab_size), dtype=np.float32)
        return np.stack(rows)

    def logits_after(self, token: int) -> np.ndarray:
        """The fake model's row after `token`: its successor is far more likely than anything else, and
        the next few tokens after that a little more likely than the rest (so logprobs have an order)."""
        row = np.full(self.vocab_size, -10.0, dtype=np.float32)
        nxt = self.next_token(token)
        for k in range(1, 4):
            row[(nxt + k) % self.vocab_size] = -10.0 + (4 - k)
        row[nxt] = 10.0
        return row

    def cells_in_use(self) -> int:
        """Distinct cells, as a unified cache counts them (a copied cell once, however many hold it)."""
        return len({cell for ids in self.cell_ids.values() for cell in ids})

    def close(self) -> None:
        self.cells.clear()
        self.cell_ids.clear()


class FakeEmbedder:
    """A deterministic embedding model for fast tests of batching and the HTTP layer.

    Text: BOS, then one token per character (as FakeRunner spells it). The vector of an input depends on
    its tokens only, never on what shares its pass: component j is 1 + the mean of cos((j + 1) * t) over
    its tokens t. Every pass is recorded (`passes`), and checked against the model's limits.
    """

    BOS = 1

    def __init__(
        self,
        *,
        dim: int = 8,
        vocab_size: int = 64,
        context_window: int = 32,
        max_batch_tokens: int = 64,
        max_batch_seqs: int = 4,
        delay: float = 0.0,
    ) -> None:
        self.dim = dim
        self.vocab_size = vocab_size
        self.context_window = context_window
        self.max_batch_tokens = max_batch_tokens
        self.max_batch_seqs = max_batch_seqs
        self.delay = delay
        self.passes: list[list[list[int]]] = []
        self.fail_next = False

    def tokenize(self, text: str) -> list[int]:
        return [self.BOS] + [2 + ord(c) % (self.vocab_size - 2) for c in text]

    @staticmethod
    def vector_of(tokens: list[int], dim: int) -> np.ndarray:
        t = np.asarray(tokens, dtype=np.float64)[:, None]
        return (1.0 + np.cos(t * np.arange(1, dim + 1)).mean(axis=0)).astype(np.float32)

    def embed(self, inputs: list[list[int]]) -> np.ndarray:
        if self.delay:
            time.sleep(self.delay)
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("scripted failure")
        if not inputs or len(inputs) > self.max_batch_seqs or sum(map(len, inputs)) > self.max_batch_tokens:
            raise FakeKVError(f"a pass of {len(inputs)} inputs and {sum(map(len, inputs))} tokens exceeds the limits")
        if any(not ids or len(ids) > self.context_window or not 0 <= min(ids) <= max(ids) < self.vocab_size
               for ids in inputs):
            raise FakeKVError("an input is empty, too long or outside the vocabulary")
        self.passes.append([list(ids) for ids in inputs])
        return np.stack([self.vector_of(ids, self.dim) for ids in inputs])

    def close(self) -> None:
        pass
