"""The seam between the engine loop and a model: LocalEngine drives any ModelRunner the same way."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

from servelm.engine.plan import MediaChunk, StepPlan


@dataclass(frozen=True)
class Exactness:
    """What the self-check found: exact or not, why not, and the fences it took (runners/llamacpp.py)."""

    exact: bool
    reason: str = ""  # the first shape whose logits differed (empty when exact)
    fences: tuple[str, ...] = ()
    checked: bool = True  # False: no check ran (a runner that does not compute, such as a vocabulary-only one)

    def describe(self) -> str:
        if not self.checked:
            return "not checked"
        if self.exact:
            return "exact" + (f" (fences: {', '.join(self.fences)})" if self.fences else "")
        return f"NOT exact: {self.reason}"


class ModelVocabulary(Protocol):
    """What any text model's tokenizer gives the wiring, whichever engine runs it: its chat template, BOS and EOS,
    and token texts. LlamaModel and FakeModel (runners/) implement it, and so does engine/hf_vocab's HfTokenizer
    (vLLM's)."""

    chat_template: str | None
    bos_token: str
    eos_token: str

    @property
    def bos_id(self) -> int | None:
        """The BOS token the tokenizer puts first (None when the model asks for none)."""
        ...

    def token_bytes(self, token: int) -> bytes:
        """The token's text as raw bytes; special (control) tokens render as nothing."""
        ...


class ModelInfo(ModelVocabulary, Protocol):
    """A loaded model as the wiring reads it (compose.py, ray/ingress.py): its vocabulary, templates and metadata,
    apart from any executor (a vocabulary-only load has no context at all). A runner exposes its own as
    `runner.model`; the engine never reads it."""

    vocab_size: int
    eog_ids: np.ndarray  # end-of-generation tokens
    description: str
    fim_tokens: tuple[int, int, int] | None  # fill-in-the-middle (prefix, suffix, middle) tokens, if any
    trained_context: int  # the context the model was trained for
    weights_bytes: int  # the model's weights in memory

    @property
    def quantization(self) -> str:
        """The model file's type (Q4_K_M, F16, …)."""
        ...

    def tokenize(self, text: str, *, add_special: bool, parse_special: bool) -> list[int]: ...

    def builtin_template(self) -> str | None:
        """llama.cpp's built-in chat template for the model's architecture, by name (None: it has none)."""
        ...

    def apply_builtin_template(self, name: str, messages: list[tuple[str, str]], add_generation_prompt: bool) -> str:
        """(role, text) messages rendered by a built-in template."""
        ...

    def tokenize_text(self, data: bytes) -> list[int]:
        """Plain UTF-8 text (no special tokens, no BOS) → token ids; used by grammar masks."""
        ...

    def control_tokens(self) -> list[tuple[str, int, bool, bool]] | None:
        """(text, id, lstrip, rstrip) of every token that parsing special tokens reads from text as itself and plain
        tokenizing does not; None for a model that makes no such distinction (the fake one)."""
        ...

    def token_table(self) -> list[bytes]:
        """Every token's bytes, for grammar masks; control tokens as b"\\xff" followed by their text."""
        ...


class ModelRunner(Protocol):
    """The executor as the engine drives it (engine/local.py, output.py): the forward pass over a StepPlan, its
    shape limits, the KV cells' save, images, LoRA adapters and the counters the engine reports. Nothing else: a
    model's vocabulary and metadata are ModelInfo's (runner.model), read by the wiring."""

    vocab_size: int
    context_window: int  # the most positions one sequence may use: each slot's KV stream holds that many
    num_slots: int  # sequences that may hold KV at once; ids 0..num_slots-1, a stream each
    max_step_tokens: int  # tokens one step may carry
    max_rows: int  # tokens one sequence may read in one step
    # a chunk of this many rows of a stream or more takes another kernel, whose rows do not depend on the chunk's
    # size either: a prompt's leading whole tiles are read in multiples of it (0: no such kernel)
    tile_rows: int
    # one tile's forward pass, as the start-up self-check timed it (0.0: not timed): a step reading a tile takes that
    tile_seconds: float
    call_cost_rows: float  # a forward call's own cost in rows' time (engine/speculate.py weighs drafts by it)
    lone_row_from: int | None  # from here on a lone single row is read with its previous position (two rows' cost)
    kv_cell_bytes: int  # one KV cell's size
    forward_calls: int  # forward passes (llama_decode calls) made since start
    eog_ids: np.ndarray  # end-of-generation tokens

    @property
    def decode_seconds(self) -> float:
        """Wall time in the forward passes since start (the runner's own Python around them excluded)."""
        ...

    def token_bytes(self, token: int) -> bytes:
        """The token's text as raw bytes (the model's, for detokenizing); special (control) tokens render as nothing."""
        ...

    def encode_media(self, media: MediaChunk) -> None:
        """Make an image chunk's embeddings ahead of the step that reads it (kept until the step reads them); raises
        for a runner without a projector or an image its projector cannot encode."""
        ...

    def load_adapter(self, name: str, path: str) -> None:
        """A LoRA adapter of this model loaded under `name` (a ValueError with the reason when it is not one)."""
        ...

    def free_adapter(self, name: str) -> None:
        """The adapter freed; no sequence may still run with it."""
        ...

    def step(self, plan: StepPlan) -> np.ndarray:
        """Apply the plan's KV operations in order, then the forward pass over all its chunks.

        Returns logits rows (vocab_size wide) in the order StepPlan.rows() gives them: every row of an
        all-logits chunk, the last row of a chunk with samplers. The array may be a view into the runner's
        memory, valid until the next step.
        """
        ...

    def save_seq(self, slot: int) -> bytes:
        """The slot's cells as bytes a Restore op takes back (a Save op, or the prefix cache written at a stop)."""
        ...


class ServedRunner(ModelRunner, Protocol):
    """A runner as the wiring builds and serves it (compose.py): the engine's protocol, and its model, what its
    start-up self-check found, what its saved states depend on, its KV cells, and its close."""

    kv_cells: int  # num_slots * context_window
    exactness: Exactness  # what the start-up self-check found (runners/selfcheck.py)

    @property
    def model(self) -> ModelInfo:
        """The model it computes with (its vocabulary, templates and metadata)."""
        ...

    @property
    def state_fingerprint(self) -> str:
        """What save_seq's states depend on (the model file, the cache type, the build, the fences)."""
        ...

    def close(self) -> None: ...


class KVCacheFull(RuntimeError):
    """The forward pass found no room in the KV cache for the batch."""


class RestoreFailed(RuntimeError):
    """Restore ops the model refused (a state of another model, or one that holds fewer positions than promised):
    these slots are empty now, and so is any slot a later op of the step copied from them. The step's other KV
    operations are done; none of its chunks were read."""

    def __init__(self, slots: set[int]) -> None:
        super().__init__(f"the model refused the saved state restored into slot(s) {sorted(slots)}")
        self.slots = slots
