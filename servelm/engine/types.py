"""Engine-neutral value types that cross the service ↔ engine boundary.

Nothing here knows HTTP, pydantic or llama.cpp: the service layer builds a GenerationRequest from a
protocol request, and the engine answers with GenerationOutput values.
"""

from __future__ import annotations

import enum
import hashlib
from dataclasses import dataclass, field

from servelm.constrain.constraint import Constraint

GREEDY_BELOW = 1e-5  # a temperature below this draws as 0 does


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How one choice's tokens are picked and when it stops. Validated by the service layer."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 means no limit
    min_p: float = 0.0
    seed: int | None = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    n: int = 1  # choices returned
    best_of: int | None = None  # sequences run (>= n); the n with the highest cumulative logprob are returned
    skip_special_tokens: bool = True  # control tokens add no text
    include_stop_str_in_output: bool = False
    logprobs: int | None = None  # None: no logprobs; k: each generated token's logprob and its k most likely
    prompt_logprobs: int | None = None  # the same for every prompt token after the first (raw distribution)
    beam: BeamParams | None = None  # beam search instead of sampling; best_of is the beam width

    @property
    def greedy(self) -> bool:
        """Temperature 0, or one so near it that a row divided by it would overflow into inf and NaN (as vLLM: below
        1e-5 the draw is the argmax)."""
        return self.temperature < GREEDY_BELOW

    @property
    def num_seqs(self) -> int:
        """Sequences the engine runs for the request: best_of when given, else n."""
        return self.best_of or self.n

    @property
    def wants_cumulative(self) -> bool:
        """Each sequence's cumulative logprob is needed (to rank best_of samples, or to report)."""
        return self.logprobs is not None or self.num_seqs > self.n


@dataclass(frozen=True, slots=True)
class BeamParams:
    """Beam search as OpenVINO Model Server documents it (Hugging Face's semantics).

    A hypothesis' score is its cumulative logprob divided by (generated length ** length_penalty). With
    groups > 1 the beams are split into that many groups (diverse beam search): a group's candidate loses
    diversity_penalty for every earlier group that picked the same token at the same step.
    """

    length_penalty: float = 1.0
    diversity_penalty: float = 0.0
    groups: int = 1
    early_stopping: bool = False  # stop as soon as best_of hypotheses have finished


@dataclass(frozen=True, slots=True)
class Thinking:
    """A choice that may think first, between two markers: the engine counts its reasoning tokens and, given a
    budget, closes the thought itself after that many (writing `close_ids`), as SGLang's strict budget does."""

    open: bytes
    close: bytes
    close_ids: tuple[int, ...]
    opened: bool = False  # the prompt opened the thought: the output begins inside it
    budget: int | None = None


@dataclass(frozen=True, slots=True)
class MediaChunk:
    """An image in a prompt (or one piece of an image a tiling model cuts up): `length` positions whose inputs are
    embeddings the runner makes from the image file's bytes (libmtmd's chunk `index` of them), not tokens."""

    data: bytes = field(repr=False)  # the image file as sent (png, jpeg, ...), checked by the runner's reader
    index: int  # which of the image's media chunks this is
    length: int  # the positions it takes in the prompt (and KV cells)
    causal: bool = True  # False: its positions attend to each other both ways, so it is read in one forward pass
    key: str = ""  # what makes it the same image for the prefix cache: set from data and index when empty

    def __post_init__(self) -> None:
        if not self.key:
            object.__setattr__(self, "key", hashlib.sha256(self.data).hexdigest() + f":{self.index}")

    @property
    def placeholder(self) -> int:
        """The token id its positions carry in the prompt: negative (no vocabulary id), the same for the same image,
        so that the prefix cache matches an image only where the same image was read."""
        return -1 - int(hashlib.sha256(self.key.encode()).hexdigest()[:14], 16)


@dataclass(frozen=True, slots=True)
class MediaSpan:
    """Where a MediaChunk sits in a prompt: positions start .. start + chunk.length."""

    start: int
    chunk: MediaChunk

    @property
    def end(self) -> int:
        return self.start + self.chunk.length


@dataclass(frozen=True, slots=True)
class Tenant:
    """Who a request counts against when slots are shared out (engine/fairness.py): an API key, or a client's
    address on a server without keys. "" is the server's own work (a guard model's question)."""

    id: str = ""  # "key:<the key's digest>", "addr:<the client's address>"
    label: str = ""  # how /metrics names it: the key's name (or key-<8 hex digits>), or the address
    weight: float = 1.0  # its share of the tokens against other tenants' (2: twice a weight-1 tenant's)
    max_share: float = 1.0  # the fraction of a deployment's slots its sequences may hold at once


@dataclass(frozen=True, slots=True)
class TenantStats:
    """One tenant's part of an engine now: the slots its sequences hold, its requests waiting, and the tokens the
    engine computed for it since start (prompt tokens read, tokens drawn)."""

    label: str
    slots: int
    waiting: int
    tokens: int


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    constraint: Constraint | None = None
    # Prefix-cache scope: a request reads only cache entries written under the same scope (service/params.py:
    # cache_scope derives it from the API key and cache_salt). "" is an open server's one scope.
    cache_scope: str = ""
    # OpenAI's prompt_cache_key, within the scope: the Ray router sends requests of one key to one replica
    cache_hint: str = ""
    # Anthropic's cache_control: for this long after the request ends its cells are given up only after others
    pin_seconds: float = 0.0
    thinking: Thinking | None = None  # reasoning to count, and to bound
    media: tuple[MediaSpan, ...] = ()  # images in the prompt, in order; their positions hold their placeholders
    priority: int = 0  # vLLM's: lower runs first, and may preempt a running request ranked below it
    # LoRA adapters (name, scale) applied while its rows are computed; its prefix cache is theirs alone
    adapters: tuple[tuple[str, float], ...] = ()
    # the request's trace span as a W3C traceparent ("" untraced): a Ray replica's span of it joins the trace
    traceparent: str = ""
    tenant: Tenant = Tenant()  # who it counts against for the engine's fair share of slots


class FinishReason(str, enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    CONTENT_FILTER = "content_filter"  # never the engine's: a content filter withheld the rest (service layer)


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """One position's logprobs: the token taken there, and the most likely tokens (most likely first).

    Values come from the distribution the token was drawn from after logit_bias, penalties, banned
    tokens and grammar masks, before temperature and top-k/top-p/min-p (see docs). Prompt positions use the
    raw model distribution. A logprob of -inf (a token the grammar forbids) is never listed in `top`.
    """

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()
    rank: int = 1  # the token's rank in the distribution (1 = most likely)


@dataclass(slots=True)
class GenerationOutput:
    """One step's news for one choice of a request: the new text, and whether the choice is done."""

    request_id: str
    index: int
    text: str
    token_ids: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens read from the prefix cache rather than computed
    # one entry per token of token_ids, when the request asked for logprobs
    logprobs: list[TokenLogprob] | None = None
    # the prompt's logprobs (None for its first token), once, on the request's first output
    prompt_logprobs: list[TokenLogprob | None] | None = None
    cumulative_logprob: float = 0.0  # of the whole choice so far, when params.wants_cumulative
    reasoning_tokens: int = 0  # of completion_tokens, those of the thought (markers excluded), when thinking is set
    # where the time went, for llama-server's timings: from the engine's receipt to the first step that read the
    # prompt, and from then to the first token
    queued_seconds: float = 0.0
    prompt_seconds: float = 0.0
    # speculative decoding so far: the choice's guesses read, and how many held (each held one is a token it
    # made without a step of its own)
    draft_tokens: int = 0
    draft_accepted: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True, slots=True)
class EngineStats:
    """A snapshot of the engine for /health and tests: what runs, what waits, what the KV holds."""

    running: int
    waiting: int
    kv_cells_used: int  # held by running requests
    kv_cells_cached: int  # held by slots at rest: the prefix cache (a slot's cells go when a request needs it)
    kv_cells_total: int  # slots x context window
    kv_cell_bytes: int  # one cell's size: the KV cache takes kv_cells_total x this
    free_slots: int
    total_slots: int
    cache_hits: int = 0  # requests that started from cached cells, since start
    cached_tokens: int = 0  # prompt tokens they did not read
    step_seconds: float = 0.0  # engine-thread time in steps that had work, since start
    forward_seconds: float = 0.0  # of which inside the model's forward pass (llama_decode)
    steps: int = 0  # steps that had work, since start
    forward_calls: int = 0  # llama_decode calls they made (a step's rows go in as few as keep them exact)
    # the engine thread's wall seconds by phase of its steps (engine/clock.py PHASES), since start
    phase_seconds: dict[str, float] = field(default_factory=dict)
    draft_tokens: int = 0  # speculative guesses read since start (engine/speculate.py), and how many held
    draft_accepted: int = 0
    # the prefix cache's spilled entries (engine/spill.py): their bytes in host RAM and on disk, how many, and
    # how many were read back into a slot since start
    spill_ram_bytes: int = 0
    spill_disk_bytes: int = 0
    spill_entries: int = 0
    spill_restored: int = 0
    spill_restore_failures: int = 0  # spilled entries the model refused (dropped; their requests read their prompts)
    preemptions: int = 0  # running requests that gave their slot up to one ranked above them, since start
    resumed_tokens: int = 0  # of their tokens, those they found cached again (a slot or the spill) on resuming
    tenants: tuple[TenantStats, ...] = ()  # each tenant's slots, waiting requests and tokens (engine/fairness.py)


def adapter_scope(scope: str, adapters: tuple[tuple[str, float], ...]) -> str:
    """A prefix-cache scope divided by the LoRA adapters a request runs with: cells computed under one adapter set
    are never read under another (the base model's scope is the request's own)."""
    if not adapters:
        return scope
    return scope + "\x00lora:" + ",".join(f"{name}*{scale!r}" for name, scale in adapters)
