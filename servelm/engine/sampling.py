"""Logits → tokens for a whole step at once.

Logprobs (when asked for, or to rank best_of samples) are the log-softmax of the processed row: after
logit_bias, penalties, bans and masks, before temperature and the top-k/top-p/min-p filters.

Order (the same for every row): logit_bias, repetition penalty (prompt and output tokens), frequency
and presence penalties (output tokens), banned tokens (EOS before min_tokens), the grammar's mask for a
constrained row (tokens it does not allow become -inf), then greedy argmax when
temperature is 0 (or below 1e-5: types.GREEDY_BELOW), else temperature, top-k, top-p, min-p and a draw from the
row's own RNG. Work is vectorized over rows where it can be; the per-row parts are O(vocab), never a full vocabulary sort
unless top-p needs more than the first candidates.

A step's whole-row passes over many large rows (greedy's argmax, the logprobs' normalizers) are shared with helper
threads (`by_rows`): llama.cpp's threads wait between two calls, and numpy releases the GIL in its loops. Each row is
computed by the same code whichever thread takes it, so the results are the same bit for bit.
"""

from __future__ import annotations

import itertools
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import numpy as np

from servelm.engine.clock import name_thread
from servelm.engine.types import SamplingParams, TokenLogprob

_TOP_P_CANDIDATES = 1024
# a step's work worth sharing with helper threads, in row elements read (4 MB of float32 logits: 16 rows of a 65k
# vocabulary, 4 of 262k); below it the hand-off (tens of microseconds) costs about what it could save
SHARE_ELEMENTS = 1 << 20
EXP_PASSES = 8  # a row's exact logprobs (a float64 exp of every value, its sum, the rank) cost about 8 argmax passes
MAX_HELPERS = 3  # helper threads at most (fewer on a machine with fewer cores: one core is the engine thread's)
HELPER_THREAD = "servelm-sample"  # the helpers' name in /proc (/metrics' servelm_thread_cpu_seconds_total)

T = TypeVar("T")
_helpers: tuple[ThreadPoolExecutor | None, int] | None = None  # the helper threads (None on one core), how many
_helpers_lock = threading.Lock()
_local = threading.local()  # each thread's float64 scratch row (token_logprobs)
_pending = 0  # helper tasks handed out and not ended: they may still read a step's rows (settle)
_pending_changed = threading.Condition()


def _pool() -> tuple[ThreadPoolExecutor | None, int]:
    """The helper threads, made on first use, and how many there are: a core each besides the engine thread's."""
    global _helpers
    with _helpers_lock:
        if _helpers is None:
            cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
            count = min(MAX_HELPERS, cores - 1)
            pool = ThreadPoolExecutor(count, thread_name_prefix=HELPER_THREAD, initializer=name_thread,
                                      initargs=(HELPER_THREAD,)) if count > 0 else None
            _helpers = (pool, count)
        return _helpers


_MISSING: Any = object()  # a row no thread has finished


class _Rows(Generic[T]):
    """One call of by_rows: its rows, taken one at a time by whichever thread asks next."""

    def __init__(self, n: int, fn: Callable[[int], T]) -> None:
        self.n, self.fn = n, fn
        self.out: list[T] = [_MISSING] * n
        self.next = itertools.count()  # next() is atomic: each row goes to one thread

    def take(self) -> None:
        for i in self.next:
            if i >= self.n:
                return
            self.out[i] = self.fn(i)

    def help(self) -> None:
        """On a helper thread. Its exception is dropped: the caller computes that row again, and raises it."""
        try:
            self.take()
        except Exception:  # noqa: BLE001 - the caller's to raise, from its own computation of the row
            pass
        finally:
            _ended()


def _handed_out() -> None:
    global _pending
    with _pending_changed:
        _pending += 1


def _ended() -> None:
    global _pending
    with _pending_changed:
        _pending -= 1
        _pending_changed.notify_all()


def settle() -> None:
    """Wait until no helper task handed out by by_rows may still read its rows: a caller about to free the memory
    they lie in (runners/llamacpp.py: llama.cpp's logits buffer, given up for a larger one) calls this first."""
    with _pending_changed:
        _pending_changed.wait_for(lambda: _pending == 0)


def by_rows(n: int, work: int, fn: Callable[[int], T]) -> list[T]:
    """[fn(i) for i in range(n)]; when the work (in row elements read) is at least SHARE_ELEMENTS, helper threads
    take rows too, as they wake. The caller never waits for them: once no row is left to take, it computes again any
    row a helper has not finished (the same result, bit for bit), so a helper that wakes late or is preempted costs
    at most the rows it holds. fn must only read what it shares (a late helper may still read the rows; its result
    goes nowhere; settle() waits until none may still read them)."""
    pool, helpers = _pool() if n > 1 and work >= SHARE_ELEMENTS else (None, 0)
    if pool is None:  # little work, or one core
        return [fn(i) for i in range(n)]
    rows = _Rows(n, fn)
    try:
        for _ in range(min(helpers, n - 1)):
            _handed_out()
            pool.submit(rows.help)
    except RuntimeError:  # the interpreter is shutting down: the caller takes every row
        _ended()
    rows.take()
    out = list(rows.out)  # a copy: a late helper writes into rows.out only
    for i, value in enumerate(out):
        if value is _MISSING:
            out[i] = fn(i)
    return out


def argmax_rows(rows: np.ndarray) -> np.ndarray:
    """np.argmax(rows, axis=1), shared with helper threads when the rows are many and large."""
    n, width = rows.shape
    if n < 2 or n * width < SHARE_ELEMENTS:
        return np.asarray(np.argmax(rows, axis=1))
    return np.asarray(by_rows(n, n * width, lambda i: np.argmax(rows[i])), dtype=np.intp)


@dataclass(eq=False)
class SamplerState:
    """What sampling remembers about one sequence: its RNG and the tokens it has seen."""

    params: SamplingParams
    rng: np.random.Generator
    vocab_size: int
    prompt_mask: np.ndarray | None = None  # tokens of the prompt (for repetition_penalty)
    output_counts: np.ndarray | None = None  # how often each token was generated
    num_generated: int = 0
    _penalized: bool = field(init=False, default=False)
    bias_ids: np.ndarray | None = field(init=False, default=None)  # logit_bias as arrays, made once
    bias_values: np.ndarray | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        p = self.params
        self._penalized = p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0
        if self._penalized:
            self.output_counts = np.zeros(self.vocab_size, dtype=np.int32)
        if p.logit_bias:
            self.bias_ids = np.fromiter((t for t, _ in p.logit_bias), dtype=np.int64, count=len(p.logit_bias))
            self.bias_values = np.fromiter((b for _, b in p.logit_bias), dtype=np.float32, count=len(p.logit_bias))

    @classmethod
    def create(cls, params: SamplingParams, index: int, vocab_size: int, prompt: tuple[int, ...]) -> SamplerState:
        rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed_entropy(params.seed), index])))
        state = cls(params, rng, vocab_size)
        if params.repetition_penalty != 1.0:
            state.prompt_mask = np.zeros(vocab_size, dtype=bool)
            ids = np.asarray(prompt, dtype=np.int64)
            state.prompt_mask[ids[(ids >= 0) & (ids < vocab_size)]] = True
        return state

    def fork(self) -> SamplerState:
        """A copy for a beam that continues this one (its counts copied, its RNG shared: beams draw nothing)."""
        counts = None if self.output_counts is None else self.output_counts.copy()
        twin = SamplerState(self.params, self.rng, self.vocab_size, self.prompt_mask, counts, self.num_generated)
        return twin

    def record(self, token: int) -> None:
        self.num_generated += 1
        if self.output_counts is not None and 0 <= token < self.vocab_size:
            self.output_counts[token] += 1

    @property
    def penalized(self) -> bool:
        return self._penalized

    def apply_penalties(self, row: np.ndarray) -> None:
        p = self.params
        if not self._penalized or self.output_counts is None:
            return
        counts = self.output_counts
        if p.repetition_penalty != 1.0:
            seen = counts > 0
            if self.prompt_mask is not None:
                seen |= self.prompt_mask
            vals = row[seen]
            row[seen] = np.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
        if p.frequency_penalty != 0.0 or p.presence_penalty != 0.0:
            row -= counts * np.float32(p.frequency_penalty) + (counts > 0) * np.float32(p.presence_penalty)


def seed_entropy(seed: int | None) -> int:
    """A request's seed as the non-negative entropy NumPy takes: any 64-bit integer, a negative one as its two's
    complement (so -1 and 2**64 - 1 draw alike); no seed, fresh entropy."""
    if seed is None:
        entropy: int = np.random.SeedSequence().entropy  # type: ignore[assignment]  # an int when no entropy is given
        return entropy
    return seed & (2**64 - 1)


def sample_rows(
    logits: np.ndarray,
    states: list[SamplerState],
    eog_ids: np.ndarray,
    masks: tuple[np.ndarray, np.ndarray] | None = None,
) -> np.ndarray:
    """Pick one token per row; logits is (rows × vocab) and is modified in place (left processed)."""
    process_rows(logits, states, eog_ids, masks)
    return pick_rows(logits, states)


# What process_rows changed, to put back: (row, token ids or None for the whole row, the values before)
Undo = list[tuple[int, np.ndarray | None, np.ndarray]]


def process_rows(
    logits: np.ndarray,
    states: list[SamplerState],
    eog_ids: np.ndarray,
    masks: tuple[np.ndarray, np.ndarray] | None = None,
    undo: Undo | None = None,
) -> None:
    """Everything before the draw, in place: logit_bias, penalties, banned tokens, grammar masks. The
    rows then hold the distribution that logprobs report and beam search scores.

    masks, when given, is (row indices, allowed): allowed[i] is the boolean row of tokens the grammar of
    row indices[i] allows. undo, when given, gets what each change overwrote (before it is made), for `restore`.
    """
    for r, st in enumerate(states):
        p = st.params
        row = logits[r]
        if st.bias_ids is not None:
            if undo is not None:
                undo.append((r, st.bias_ids, row[st.bias_ids]))
            row[st.bias_ids] += st.bias_values
        if st.penalized:
            if undo is not None:
                undo.append((r, None, row.copy()))
            st.apply_penalties(row)
        if eog_ids.size and (p.ignore_eos or st.num_generated < p.min_tokens):
            if undo is not None:
                undo.append((r, eog_ids, row[eog_ids]))
            row[eog_ids] = -np.inf
    if masks is not None:
        if undo is not None:
            undo += [(int(r), None, logits[r].copy()) for r in masks[0]]
        _apply_masks(logits, masks[0], masks[1], eog_ids)


def restore(logits: np.ndarray, undo: Undo) -> None:
    """The rows as they were before process_rows changed them."""
    for r, ids, values in reversed(undo):
        if ids is None:
            logits[r] = values
        else:
            logits[r, ids] = values


def pick_rows(logits: np.ndarray, states: list[SamplerState]) -> np.ndarray:
    """Greedy argmax, or temperature, top-k, top-p and min-p and a draw, for processed rows."""
    if all(st.params.greedy for st in states):  # the common case: no second copy of the rows
        return argmax_rows(logits)
    rows = logits.shape[0]
    out = np.empty(rows, dtype=np.int64)
    greedy = np.fromiter((st.params.greedy for st in states), dtype=bool, count=rows)
    if greedy.any():
        out[greedy] = argmax_rows(logits[greedy])
    plain = np.fromiter((_plain(st) for st in states), dtype=bool, count=rows) & ~greedy
    if plain.any():
        which = np.flatnonzero(plain)
        out[which] = _sample_plain(logits, which, [states[r] for r in which])
    filtered = np.flatnonzero(~greedy & ~plain).tolist()
    if filtered:
        # each row's draw first (one a step, from its own RNG), so that a row is the same whichever thread takes it
        draws = [states[r].rng.random() for r in filtered]
        out[filtered] = by_rows(len(filtered), len(filtered) * logits.shape[1] * EXP_PASSES,
                                lambda i: _sample_one(logits[filtered[i]], states[filtered[i]], draws[i]))
    return out


def log_softmax(rows: np.ndarray) -> np.ndarray:
    """Row-wise log-softmax in float64 (rows may hold -inf for forbidden tokens)."""
    x = rows.astype(np.float64)
    m = x.max(axis=1, keepdims=True)
    m[~np.isfinite(m)] = 0.0
    with np.errstate(divide="ignore", invalid="ignore"):  # a row with every token forbidden: log(0), then NaN, as meant
        return np.asarray(x - (m + np.log(np.exp(x - m).sum(axis=1, keepdims=True))))


def logprob_entry(logp_row: np.ndarray, token: int, k: int) -> TokenLogprob:
    """The token's logprob, its rank, and the k most likely tokens (no forbidden ones), from a log-softmaxed row."""
    lp = float(logp_row[token])
    rank = int((logp_row > lp).sum()) + 1
    top: tuple[tuple[int, float], ...] = ()
    if k > 0:
        k = min(k, logp_row.shape[0])
        ids = np.argpartition(-logp_row, k - 1)[:k]
        ids = ids[np.argsort(-logp_row[ids], kind="stable")]
        top = tuple((int(t), float(logp_row[t])) for t in ids if np.isfinite(logp_row[t]))
    return TokenLogprob(token, lp, top, rank)


def token_logprobs(rows: np.ndarray, which: list[int], tokens: list[int], ks: list[int | None]) -> list[TokenLogprob]:
    """Logprob entries for the token taken in rows[which[i]] (processed logits, not yet softmaxed), each row read
    where it is (no copy of the step's rows).

    ks[i] is how many alternatives row i reports; None: the row only ranks best_of samples, so its entry
    holds the token's logprob alone (float32, no rank, no copy of the row in float64).
    """
    width = rows.shape[1]

    def entry(i: int) -> TokenLogprob:
        row, token, k = rows[which[i]], tokens[i], ks[i]
        if k is None:
            m = row.max(keepdims=True)
            lse = m + np.log(np.exp(row - m).sum(keepdims=True))
            return TokenLogprob(token, float(row[token] - lse[0]))
        return _entry(row, token, k, _scratch(width))

    full = sum(k is not None for k in ks)
    return by_rows(len(which), full * width * EXP_PASSES, entry)


def _scratch(width: int) -> np.ndarray:
    """The calling thread's float64 scratch row of `width` values, kept from step to step (a fresh one would fault in
    its pages every step: 2 MB for 262k values)."""
    scratch: np.ndarray | None = getattr(_local, "scratch", None)
    if scratch is None or scratch.shape[0] != width:
        scratch = _local.scratch = np.empty(width, dtype=np.float64)
    return scratch


def _entry(row: np.ndarray, token: int, k: int, scratch: np.ndarray) -> TokenLogprob:
    """logprob_entry(log_softmax(row), token, k), bit for bit, without the row's float64 log-softmax: the
    normalizer is summed in `scratch` (the row in float64: the same pairwise sum), and only the token, the tokens
    above it (its rank) and the k best are taken out of it. A float32 row keeps the float64 order of its values
    (x - c is monotone in x), so the k best are found on the row itself. Where equal values make their order (which
    of them, in which order) the whole row's partition's choice, that row takes the general path.
    """
    m = row.max()
    if not np.isfinite(m):  # every token forbidden (or an infinite logit): the general path
        return _whole_row_entry(row, token, k)
    m64 = np.float64(m)
    np.subtract(row, m64, out=scratch)  # in float64, as the row's float64 copy less its max
    np.exp(scratch, out=scratch)
    c = m64 + np.log(scratch.sum(keepdims=True))[0]
    x = row[token]
    lp = np.float64(x) - c
    if np.float64(np.nextafter(x, np.float32(np.inf))) - c == lp:  # a float64 rounding ties the values just above
        return _whole_row_entry(row, token, k)
    rank = int(np.count_nonzero(row > x)) + 1
    top: tuple[tuple[int, float], ...] = ()
    if k > 0:
        ids = _best(row, m, min(k, row.shape[0]))
        values = row[ids].astype(np.float64) - c
        order = np.argsort(-values, kind="stable")
        if len(ids) > k or (np.diff(values[order]) == 0).any():  # ties: their order is the partition's
            return _whole_row_entry(row, token, k)
        top = tuple((int(ids[j]), float(values[j])) for j in order if np.isfinite(values[j]))
    return TokenLogprob(token, float(lp), top, rank)


def _best(row: np.ndarray, m: np.floating, k: int) -> np.ndarray:
    """The ids of the row's k best values and of any equal to the k-th, in id order: looked for among the values
    near the max first (a few passes over the row at most, no sort of it)."""
    gap = np.float32(2.0)
    ids = np.flatnonzero(row >= m - gap)
    while len(ids) < k and gap < 256:
        gap *= 4
        ids = np.flatnonzero(row >= m - gap)
    if len(ids) < k:
        ids = np.arange(row.shape[0])
    values = row[ids]
    return np.asarray(ids[values >= np.partition(values, len(values) - k)[len(values) - k]])


def _whole_row_entry(row: np.ndarray, token: int, k: int) -> TokenLogprob:
    return logprob_entry(log_softmax(row[None, :])[0], token, k)


def _apply_masks(logits: np.ndarray, rows: np.ndarray, allowed: np.ndarray, eog_ids: np.ndarray) -> None:
    for i, r in enumerate(rows):
        row = logits[r]
        row[~allowed[i]] = -np.inf
        if not np.isfinite(row).any():
            # the grammar allows only what was banned (EOS before min_tokens, or a -inf bias): the
            # grammar wins, since any other token would break it; end the choice as it allows
            ok = np.flatnonzero(allowed[i])
            row[ok if ok.size else eog_ids] = 0.0


def _plain(st: SamplerState) -> bool:
    """Temperature alone: no top-k, top-p or min-p filter (a top-k of the whole vocabulary or more filters nothing,
    and draws as none does)."""
    p = st.params
    return (p.top_k <= 0 or p.top_k >= st.vocab_size) and p.top_p >= 1.0 and p.min_p <= 0.0


def _sample_plain(logits: np.ndarray, which: np.ndarray, states: list[SamplerState]) -> np.ndarray:
    """Draw for the temperature-only rows logits[which] (states[i] is row which[i]'s): each row's softmax and
    cumulative sum in float32 (`_running_sum`), shared with helper threads when they are many and large. The rows
    stay as they are: logprobs read them."""
    width = logits.shape[1]
    sums = by_rows(len(states), len(states) * width * EXP_PASSES,
                   lambda i: _running_sum(logits[which[i]], states[i].params.temperature))
    # each row's own RNG, drawn once its row is ready (not before: a step that raises here draws nothing)
    u = np.array([st.rng.random() for st in states]) * np.array([c[-1] for _, c in sums], dtype=np.float32)
    picks = [_pick(ids, c, u[i], width) for i, (ids, c) in enumerate(sums)]
    return np.asarray(np.minimum(np.asarray(picks, dtype=np.int64), width - 1))


def _pick(ids: np.ndarray | None, cdf: np.ndarray, u: np.float64, width: int) -> int:
    """The drawn token: the first place where the running sum passes u (ids: the places cdf holds, None for all)."""
    j = _search(cdf, u)
    if ids is None:
        return j
    return int(ids[j]) if j < len(ids) else width


_SUM_CHUNK = 1024  # a row's values are judged in chunks of this many (Gemma 3's 262,144: 256 chunks)
_SUM_SHORTCUT_AT_MOST = 0.35  # the values kept, as a share of the row, for the shortcut to be worth its passes
_SUM_FLOOR = 2.0**-100  # below this the sum skips no weight by its size (far from float32's subnormals) ...
_ZERO_WEIGHT_BELOW = -110.0  # ... only weights of 0: float32's exp(d) is 0 below about -103.97


def _running_sum(row: np.ndarray, temperature: float) -> tuple[np.ndarray | None, np.ndarray]:
    """np.cumsum(np.exp(row / t - max(row / t))) in float32, the draw's cdf, bit for bit, as (ids, sums): the sum
    at the ids of the values that may move it, in id order (None: every id). A draw only needs the sum where it
    moves: the first place past u is always one of those.

    A float32 running sum S is unchanged by adding v >= 0 with v < half of S's unit in the last place (it rounds
    back to S), and S never falls. Each chunk's largest value is in the sum before the next chunk starts, so from
    there S is at least its weight, and a value whose weight lies below half an ulp of that is skipped: it is left
    out of the exp and the sum alike. Margins cover exp's and the division's rounding many times over. Over a real
    model's row at temperature 1 or below, most values are hundreds of times smaller than the largest and are
    skipped (Gemma 3: about 1-8% kept, 3-4 times faster); where more than about a third would be kept, the whole row."""
    t = np.float32(temperature)
    width = row.shape[0]
    chunks, rest = divmod(width, _SUM_CHUNK)
    body = row[: chunks * _SUM_CHUNK].reshape(chunks, _SUM_CHUNK)
    tops = np.empty(chunks + (rest > 0), dtype=np.float32)
    tops[:chunks] = body.max(axis=1)
    if rest:
        tops[chunks] = row[chunks * _SUM_CHUNK:].max()
    m = tops.max() / t  # the max of row / t: dividing by t > 0 keeps the order
    if chunks < 8 or not np.isfinite(m):  # a small row, or an infinite or NaN max: the whole row
        return None, _weights_summed(row, t, m)
    tops /= t
    tops -= m  # each chunk's largest value as the whole row's pass makes it
    with np.errstate(divide="ignore", over="ignore", under="ignore"):
        # the sum at a chunk's start is at least its earlier chunks' largest weights summed, less float32's
        # rounding of a running sum of nonnegative values (at most (n-1) units in the last place of each) and exp's
        tops64 = np.exp(tops.astype(np.float64))
        floor = np.empty_like(tops64)
        floor[0] = 0.0
        np.cumsum(tops64[:-1], out=floor[1:])
        floor *= (1 - 1.1 * width * 2.0**-24) * (1 - 1e-3)
        half_ulp = np.floor(np.log2(floor)) - 24  # log2 of half an ulp of the floor
    skip_below = half_ulp * np.log(2.0) - 0.005  # a weight exp(d) below half an ulp: d below this
    np.maximum(skip_below, _ZERO_WEIGHT_BELOW, out=skip_below)  # a weight of 0 adds nothing to any sum
    skip_below[floor < _SUM_FLOOR] = _ZERO_WEIGHT_BELOW
    # d = (x / t) - m as float32 rounds them, so the cut on x leaves room for both roundings
    cut = (float(m) + skip_below - 1e-6 * (abs(float(m)) + 2 * np.abs(skip_below) + 1)) * np.float64(t)
    cut_f32 = cut.astype(np.float32)
    cut_f32 = np.where(cut_f32.astype(np.float64) > cut, np.nextafter(cut_f32, np.float32(-np.inf)), cut_f32)
    keep = body >= cut_f32[:chunks, None]
    kept = int(np.count_nonzero(keep))
    tail = np.flatnonzero(row[chunks * _SUM_CHUNK:] >= cut_f32[chunks]) + chunks * _SUM_CHUNK if rest else None
    if kept + (len(tail) if tail is not None else 0) > _SUM_SHORTCUT_AT_MOST * width:
        return None, _weights_summed(row, t, m)
    ids = np.flatnonzero(keep)
    if tail is not None:
        ids = np.concatenate([ids, tail])
    return ids, _weights_summed(row[ids], t, m)


def _weights_summed(values: np.ndarray, t: np.float32, m: np.float32) -> np.ndarray:
    """np.cumsum(np.exp(values / t - m)) in float32, in one new buffer (m: the row's max(row / t)). At temperature 1,
    OpenAI's default, without the division, which leaves every float32 as it is."""
    weights: np.ndarray = values - m if t == 1 else values / t
    if t != 1:
        weights -= m
    np.exp(weights, out=weights)
    return np.asarray(np.cumsum(weights, out=weights))


def _search(cdf: np.ndarray, u: np.float64) -> int:
    """np.searchsorted(cdf, u, side="right") for a float32 cdf and a float64 u, without numpy's float64 copy of the
    row (88 us for 262k values): against float32 values, "at most u" is "at most the largest float32 at most u"."""
    with np.errstate(over="ignore"):  # past float32's range: infinity, then its largest value
        below = np.float32(u)  # the nearest float32: one step down when it lies above u
    if np.float64(below) > u:
        below = np.nextafter(below, np.float32(-np.inf))
    return int(np.searchsorted(cdf, below, side="right"))


def _sample_one(row: np.ndarray, st: SamplerState, draw: float) -> int:
    """A filtered row's token; `draw`, uniform in [0, 1), is its RNG's for the step."""
    p = st.params
    vocab = row.shape[0]
    ids: np.ndarray | None = None
    if 0 < p.top_k < vocab:  # top-k first; top-p then works on the renormalized k candidates
        ids = _top_k(row, p.temperature, p.top_k)
        probs = _softmax(row[ids].astype(np.float64) / p.temperature)
    elif p.top_p < 1.0:
        scaled = row.astype(np.float64) / p.temperature
        ids = np.argpartition(-scaled, _TOP_P_CANDIDATES - 1)[:_TOP_P_CANDIDATES] if vocab > _TOP_P_CANDIDATES else np.arange(vocab)
        ids = ids[np.argsort(-scaled[ids], kind="stable")]
        probs = _softmax_partial(scaled, ids)
        if probs.sum() < p.top_p:  # the candidates hold too little mass: the whole row, by probability
            ids, probs = _by_probability(scaled, p.top_p)
    else:
        probs = _softmax(row.astype(np.float64) / p.temperature)
    if p.top_p < 1.0 and ids is not None:  # ids is sorted by probability here (top_p < 1 always sets it)
        keep = int(np.searchsorted(np.cumsum(probs), p.top_p)) + 1
        ids, probs = ids[:keep], probs[:keep]
    if p.min_p > 0.0:
        keep_mask = probs >= p.min_p * probs.max()
        probs = probs[keep_mask]
        ids = np.flatnonzero(keep_mask) if ids is None else ids[keep_mask]
    cdf = np.cumsum(probs)
    u = draw * cdf[-1]
    k = min(int(np.searchsorted(cdf, u, side="right")), cdf.shape[0] - 1)
    return int(k if ids is None else ids[k])


def _by_probability(scaled: np.ndarray, top_p: float) -> tuple[np.ndarray, np.ndarray]:
    """ids = np.argsort(-scaled, kind="stable") and probs = _softmax(scaled[ids]), bit for bit, as far as top_p's
    cut reaches (the rest is never read). The probabilities' normalizer is summed in that order, so the values are
    sorted; but a sort of the values alone is several times cheaper than the stable sort of the ids (about 7 against
    44 ms for 262,144), and only the ids before the cut are ordered: those above the last value kept, by value, then
    the ties of that value, by id. The values' order is the ids' but for equal values, whose weights are equal."""
    if np.isnan(scaled).any():  # NaN sorts last both ways, but keep the first way's every detail
        ids = np.argsort(-scaled, kind="stable")
        return ids, _softmax(scaled[ids])
    values = -np.sort(-scaled)  # as scaled[ids]: descending, each value its own bits (the negations are exact)
    probs = _softmax(values)
    keep = min(int(np.searchsorted(np.cumsum(probs), top_p)) + 1, len(values))
    last = values[keep - 1]
    above = np.flatnonzero(scaled > last)
    above = above[np.argsort(-scaled[above], kind="stable")]
    ties = np.flatnonzero(scaled == last)[: keep - len(above)]
    return np.concatenate([above, ties]), probs[:keep]


def _top_k(row: np.ndarray, temperature: float, k: int) -> np.ndarray:
    """The ids of the k best values of the row in float64 divided by the temperature, best first, as a partition of
    the whole row and a stable sort of its k would give them. Looked for among the row's best values first (no float64
    copy of the row, no partition of it: 4.3 ms of a 262k row): where the k best and the next are all distinct after
    the division, they are the only answer; where equal values make the partition's order the answer, the whole row."""
    m = row.max()
    if np.isfinite(m):
        near = _best(row, m, k + 1)
        if len(near) == k + 1:
            scaled = row[near].astype(np.float64) / temperature
            order = np.argsort(-scaled, kind="stable")
            if (np.diff(scaled[order]) < 0).all():  # every value beyond `near` is at most its last
                return np.asarray(near[order[:k]])
    scaled = row.astype(np.float64) / temperature
    ids = np.argpartition(-scaled, k - 1)[:k]
    return np.asarray(ids[np.argsort(-scaled[ids], kind="stable")])


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - np.max(x))
    return np.asarray(e / e.sum())


def _softmax_partial(x: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """Probabilities of ids under the softmax of the whole row x (not renormalized to ids)."""
    m = np.max(x)
    total = np.exp(x - m).sum()
    return np.asarray(np.exp(x[ids] - m) / total)
