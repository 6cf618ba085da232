"""FakeRunner: a scripted, deterministic model for fast tests of the engine, scheduler and HTTP layer.

It keeps its own book of KV cells per sequence slot (a stream each, as the real runner's) and checks every plan
against it (a chunk at position p needs exactly cells 0..p-1 of its slot; copies need what they copy; a slot holds
at most the context window; a sequence reads at most max_rows tokens a step), so a scheduler bug shows up as an
error here rather than as subtly wrong text.

The "model": token t is followed by t+1 (wrapping from vocab-1 to FIRST_WORD), except that
END_TOKEN is followed by EOS. Text: token t is the letter chr(ord('a') + t % 26).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np

from servelm.engine.plan import Clear, Copy, Keep, MediaChunk, Restore, Save, StepPlan, max_logits_rows
from servelm.engine.runner import Exactness, RestoreFailed

EOS = 0
FIRST_WORD = 1
END_TOKEN = 40
OPEN_IMAGE, CLOSE_IMAGE = 27, 29  # the fake projector's markers around an image


class FakeKVError(AssertionError):
    pass


class FakeModel:
    """The fake model's vocabulary, template and metadata (engine/runner.py's ModelInfo): token t is the letter
    chr(ord('a') + t % 26), EOS renders as nothing."""

    def __init__(self, *, vocab_size: int = 64, trained_context: int = 128,
                 fim_tokens: tuple[int, int, int] | None = None) -> None:
        self.vocab_size = vocab_size
        self.bos_id = None
        self.fim_tokens = fim_tokens  # fill-in-the-middle (prefix, suffix, middle) tokens, if the model has them
        self.eog_ids = np.array([EOS], dtype=np.int64)
        self.chat_template: str | None = (
            "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}"
        )
        self.bos_token = ""
        self.eos_token = "</s>"
        self.description = "fake"
        self.quantization = "F32"
        self.weights_bytes = 0
        self.trained_context = trained_context

    def control_tokens(self) -> None:
        """The fake model's markers are plain text: it makes no control-token distinction."""
        return None

    def builtin_template(self) -> str | None:
        return None

    def apply_builtin_template(self, name: str, messages: list[tuple[str, str]], add_generation_prompt: bool) -> str:
        raise ValueError("the fake model has no built-in templates")

    def tokenize(self, text: str, *, add_special: bool, parse_special: bool) -> list[int]:
        return [FIRST_WORD + (ord(c) % (self.vocab_size - FIRST_WORD)) for c in text]

    def token_bytes(self, token: int) -> bytes:
        return b"" if token == EOS else chr(ord("a") + token % 26).encode()

    def tokenize_text(self, data: bytes) -> list[int]:
        """Plain text → tokens that spell it (letters only; other bytes have no token here)."""
        return [(c - ord("a")) or 26 for c in data if ord("a") <= c <= ord("z")]

    def token_table(self) -> list[bytes]:
        return [b"\xff</s>" if t == EOS else self.token_bytes(t) for t in range(self.vocab_size)]


class FakeRunner:
    """The fake executor on a FakeModel (`model`: its own, of `vocab_size` and `fim_tokens`, unless given)."""

    def __init__(
        self,
        *,
        vocab_size: int = 64,
        num_slots: int = 4,
        max_step_tokens: int = 32,
        context_window: int = 128,
        max_rows: int = 63,
        tile_rows: int = 64,
        step_delay: float = 0.0,
        row_delay: float = 0.0,
        fim_tokens: tuple[int, int, int] | None = None,
        projector: FakeProjector | None = None,
        model: FakeModel | None = None,
    ) -> None:
        self.model = model or FakeModel(vocab_size=vocab_size, trained_context=context_window, fim_tokens=fim_tokens)
        self.vocab_size = self.model.vocab_size
        self.eog_ids = self.model.eog_ids
        self.token_bytes = self.model.token_bytes
        self.num_slots = num_slots
        self.max_step_tokens = max_step_tokens
        self.context_window = context_window
        self.kv_cells = num_slots * context_window
        self.adapters: dict[str, int] = {}  # fake LoRA adapters: name → the shift of every logits row
        self.max_rows = max_rows
        self.tile_rows = tile_rows
        self.tile_seconds = 0.0  # not timed (its step computes nothing)
        self.call_cost_rows = 1.5
        self.lone_row_from: int | None = None  # it reads a lone row alone
        self.kv_cell_bytes = 64
        self.forward_calls = 0
        self.decode_seconds = 0.0  # none: the fake computes nothing (its step counts as the runner's own work)
        self.step_delay = step_delay
        self.row_delay = row_delay  # and this much more a token of the step: a step's cost is linear, as a model's
        self.state_fingerprint = "fake-model"
        self.exactness = Exactness(False, checked=False)  # check_exactness(runner) checks it, as load_exact does
        self.cells: dict[int, list[int]] = {}  # slot → tokens at positions 0..len-1
        self.tiled: dict[int, int] = {}  # slot → its leading cells read in whole tiles (the rest were not)
        # slots a Copy wrote or read since the last forward pass: llama.cpp makes a copy between streams at its next
        # decode, so a Save of its destination or a Restore into either slot before then reads or loses wrong cells
        self.copied_to: set[int] = set()
        self.copied_from: set[int] = set()
        self.steps: list[StepPlan] = []
        self.max_cells_seen = 0
        self.projector = projector  # reads images (FakeProjector); None: a text-only model
        self.encoded: list[str] = []  # the media chunks' keys, in the order they were encoded

    def next_token(self, token: int) -> int:
        if token == END_TOKEN:
            return EOS
        return token + 1 if token + 1 < self.vocab_size else FIRST_WORD

    # -- the forward pass -------------------------------------------------------------------------
    def encode_media(self, media: MediaChunk) -> None:
        if self.projector is None:
            raise FakeKVError("an image chunk for a model without a projector")
        if media.data.startswith(b"fail"):
            raise ValueError("scripted encoding failure")
        self.encoded.append(media.key)

    def _check_media(self, calls: list[list[int]], plan: StepPlan) -> None:
        """An image's chunk is a pass of its own, holds its placeholders, and is whole unless it is causal."""
        for call in calls:
            if any(plan.chunks[i].media is not None for i in call) and len(call) > 1:
                raise FakeKVError("an image chunk shares a forward pass")
        for chunk in plan.chunks:
            media = chunk.media
            if media is None:
                if any(t < 0 for t in chunk.tokens):
                    raise FakeKVError("a text chunk holds an image's placeholder")
                continue
            if media.key not in self.encoded:
                raise FakeKVError("an image read before it was encoded")
            if set(chunk.tokens) != {media.placeholder}:
                raise FakeKVError("an image chunk whose tokens are not its placeholder")
            if not media.causal and (chunk.offset or len(chunk.tokens) != media.length):
                raise FakeKVError("a non-causal image read in pieces")

    def step(self, plan: StepPlan) -> np.ndarray:
        calls = plan.calls()
        self._check_media(calls, plan)
        failed: set[int] = set()  # as the llama.cpp runner: refused restores, and copies of them
        for op in plan.ops:
            if isinstance(op, Copy) and op.src in failed:
                self.cells.pop(op.dst, None)
                self.tiled.pop(op.dst, None)
                failed.add(op.dst)
            elif isinstance(op, Keep) and op.slot in failed:
                continue  # an empty stream keeps its nothing (llama.cpp's seq_rm past n of it does nothing)
            elif isinstance(op, Clear):
                self.cells.pop(op.slot, None)
                self.tiled.pop(op.slot, None)
            elif isinstance(op, Keep):
                held = self.cells.get(op.slot, [])
                if len(held) < op.n:
                    raise FakeKVError(f"keep {op.n} cells of slot {op.slot}, which holds {len(held)}")
                self.cells[op.slot] = held[: op.n]
                self.tiled[op.slot] = min(self.tiled.get(op.slot, 0), op.n)
            elif isinstance(op, Save) and op.slot in self.copied_to:
                raise FakeKVError(f"save of slot {op.slot}, which a copy writes only at the next forward pass")
            elif isinstance(op, Restore) and op.slot in self.copied_to | self.copied_from:
                raise FakeKVError(f"restore into slot {op.slot}, which a copy made at the next forward pass touches")
            elif isinstance(op, Save):
                op.into.data = self.save_seq(op.slot)
            elif isinstance(op, Restore):
                try:
                    self.load_seq(op.slot, op.data)
                    if len(self.cells[op.slot]) < op.n:
                        raise FakeKVError(f"a state of {len(self.cells[op.slot])} cells, not {op.n}")
                except (FakeKVError, ValueError, TypeError):
                    self.cells.pop(op.slot, None)
                    failed.add(op.slot)
            else:
                assert isinstance(op, Copy)
                if len(self.cells.get(op.src, [])) < op.n:
                    raise FakeKVError(f"copy of {op.n} cells from slot {op.src}, which holds "
                                      f"{len(self.cells.get(op.src, []))}")
                self.cells[op.dst] = list(self.cells[op.src][: op.n])
                self.tiled[op.dst] = min(self.tiled.get(op.src, 0), op.n)
                self.copied_to.add(op.dst)
                self.copied_from.add(op.src)
        if failed:
            self.steps.append(StepPlan([], plan.ops))
            raise RestoreFailed(failed)
        self.forward_calls += len(calls)  # the passes the llama.cpp runner would make
        if plan.logits_rows > max_logits_rows(self.num_slots):  # the llama.cpp runner's buffer holds no more
            raise FakeKVError(f"a step of {plan.logits_rows} logits rows, more than "
                              f"{max_logits_rows(self.num_slots)}")
        for call in calls:  # llama.cpp's micro-batches give a tiled chunk's stream a tile or more (its tiled kernel)
            for piece in (p for mb in plan.micro_batches(call) for p in mb if plan.chunks[p[0]].tiled):
                if piece[2] < self.tile_rows:
                    raise FakeKVError(f"a micro-batch gives a tiled chunk of slot {plan.chunks[piece[0]].slot} "
                                      f"{piece[2]} rows, less than a tile")
        rows: list[np.ndarray] = []
        for chunk in plan.chunks:
            held = self.cells.setdefault(chunk.slot, [])
            if chunk.start != len(held):
                raise FakeKVError(f"slot {chunk.slot} holds {len(held)} cells but the chunk starts at {chunk.start}")
            if chunk.tiled:  # after cells that were all read so (else a position's kernel would vary); a tile or
                # more, which the micro-batch check above has seen to
                if not self.tile_rows or self.tiled.get(chunk.slot, 0) != chunk.start:
                    raise FakeKVError(f"a tiled chunk of {len(chunk.tokens)} tokens at {chunk.start} of slot "
                                      f"{chunk.slot}, after {self.tiled.get(chunk.slot, 0)} tiled cells")
                self.tiled[chunk.slot] = chunk.start + len(chunk.tokens)
            elif len(chunk.tokens) == 1 and 0 < chunk.start <= self.tiled.get(chunk.slot, 0):
                # a lone row: the llama.cpp runner may read its previous position again beside it, on the row kernel,
                # which would rewrite a tiled cell with other values
                raise FakeKVError(f"a single row at {chunk.start} of slot {chunk.slot}, right after tiled cells")
            elif len(chunk.tokens) > self.max_rows and (chunk.media is None or chunk.media.causal):
                raise FakeKVError(f"a chunk of {len(chunk.tokens)} tokens: more than {self.max_rows} rows of a stream")
            if chunk.start and chunk.prev_token != (held[-1] if held[-1] >= 0 else None):  # none after an image
                raise FakeKVError(f"chunk at {chunk.start} of slot {chunk.slot}: prev_token {chunk.prev_token}, "
                                  f"cell {held[-1]}")
            held.extend(chunk.tokens)
            if len(held) > self.context_window:
                raise FakeKVError(f"slot {chunk.slot} holds {len(held)} cells, more than its {self.context_window}")
            shift = sum(self.adapters[name] * scale for name, scale in chunk.adapters)  # KeyError: not loaded
            rows.extend(np.roll(self.logits_after(t), round(shift)) for t in held[len(held) - chunk.num_rows :])
        self.max_cells_seen = max(self.max_cells_seen, self.cells_in_use())
        self.steps.append(plan)
        if plan.chunks:  # the forward pass: llama.cpp has made every copy by now
            self.copied_to.clear()
            self.copied_from.clear()
        if self.step_delay or self.row_delay:
            time.sleep(self.step_delay + self.row_delay * plan.num_tokens)
        if not rows:
            return np.empty((0, self.vocab_size), dtype=np.float32)
        return np.stack(rows)

    def load_adapter(self, name: str, path: str) -> None:
        """A fake adapter: a file whose text is an integer, by which it shifts every logits row (times its scale)."""
        if name in self.adapters:
            raise ValueError(f"the adapter {name!r} is loaded already")
        try:
            self.adapters[name] = int(Path(path).read_text())
        except ValueError:
            raise ValueError(f"{path}: not a fake LoRA adapter (an integer)") from None

    def free_adapter(self, name: str) -> None:
        self.adapters.pop(name, None)

    def save_seq(self, slot: int) -> bytes:
        return json.dumps(["fake-state", self.cells.get(slot, []), self.tiled.get(slot, 0)]).encode()

    def load_seq(self, slot: int, data: bytes) -> None:
        kind, cells, tiled = json.loads(data)
        if kind != "fake-state":
            raise FakeKVError("not a state this runner saved")
        self.cells[slot] = list(cells)
        self.tiled[slot] = tiled

    def logits_after(self, token: int) -> np.ndarray:
        """The fake model's row after `token`: its successor is far more likely than anything else, and
        the next few tokens after that a little more likely than the rest (so logprobs have an order)."""
        row = np.full(self.vocab_size, -10.0, dtype=np.float32)
        # after an image (a negative placeholder) comes a word that depends on the image
        nxt = self.next_token(token) if token >= 0 else FIRST_WORD + 1 + (-token) % (END_TOKEN - FIRST_WORD - 1)
        for k in range(1, 4):
            row[(nxt + k) % self.vocab_size] = -10.0 + (4 - k)
        row[nxt] = 10.0
        return row

    def cells_in_use(self) -> int:
        return sum(len(cells) for cells in self.cells.values())

    def close(self) -> None:
        self.cells.clear()
        self.tiled.clear()


class FakeProjector:
    """Reads an "image" for the fake model: any bytes that begin with b"IMG" (b"fail" too: its encoding fails;
    anything else is a ValueError), as a marker token on each side of one media chunk of `length` positions."""

    def __init__(self, *, length: int = 6, causal: bool = False) -> None:
        self.length = length
        self.causal = causal
        self.kept_bytes_max = 0  # it keeps no embeddings

    def read(self, data: bytes) -> list[tuple[int, ...] | MediaChunk]:
        if not data.startswith((b"IMG", b"fail")):
            raise ValueError("not an image the fake projector reads")
        return [(OPEN_IMAGE,), MediaChunk(data, 0, self.length, self.causal), (CLOSE_IMAGE,)]


class FakeEmbedder:
    """A deterministic embedding model for fast tests of batching and the HTTP layer.

    Text: BOS, then one token per character (as FakeRunner spells it). The vector of an input depends on
    its tokens only, never on what shares its pass: component j is 1 + the mean of cos((j + 1) * t) over
    its tokens t. Every pass is recorded (`passes`), and checked against the model's limits.

    As a `cross_encoder` (a reranker) an input is BOS, the query, SEP and the document, and its one score is the
    logit 8 × (the share of the document's tokens found in the query) - 4.
    """

    BOS = 1
    SEP = 0

    def __init__(
        self,
        *,
        dim: int = 8,
        vocab_size: int = 64,
        context_window: int = 32,
        max_batch_tokens: int = 64,
        max_batch_seqs: int = 4,
        delay: float = 0.0,
        cross_encoder: bool = False,
    ) -> None:
        self.cross_encoder = cross_encoder
        dim = 1 if cross_encoder else dim
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

    def tokenize_pair(self, query: str, document: str) -> list[int]:
        return self.tokenize(query) + [self.SEP] + self.tokenize(document)[1:]

    @classmethod
    def score_of(cls, tokens: list[int]) -> float:
        """A cross-encoder input's logit."""
        sep = tokens.index(cls.SEP)
        query, document = set(tokens[1:sep]), tokens[sep + 1:]
        return 8.0 * sum(t in query for t in document) / max(len(document), 1) - 4.0

    @staticmethod
    def vector_of(tokens: list[int], dim: int) -> np.ndarray:
        t = np.asarray(tokens, dtype=np.float64)[:, None]
        return np.asarray(1.0 + np.cos(t * np.arange(1, dim + 1)).mean(axis=0), dtype=np.float32)

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
        if self.cross_encoder:
            return np.array([[self.score_of(ids)] for ids in inputs], dtype=np.float32)
        return np.stack([self.vector_of(ids, self.dim) for ids in inputs])

    def close(self) -> None:
        pass
