"""Beam search over one request's beams: logprob rows in, the next beams (or the finished hypotheses) out.

Pure bookkeeping, no model and no KV: the engine hands each step's processed logits rows (one per beam,
after logit_bias, penalties and banned tokens) to `step`, which returns each new beam's parent and token.
The scheduler then moves KV cells to match (`Scheduler.update`, by `beam_hosts`): a parent's first child stays in its
slot, further children get the slots of beams that left no child, sharing the parent's cells.

Scores follow Hugging Face's (which OpenVINO Model Server documents): a hypothesis scores its cumulative
logprob divided by (generated length ** length_penalty). Among the 2 × group-size best candidates of a
group, one that ends (EOS, a stop token or string) becomes a finished hypothesis if it ranks within the
group size; the rest continue as beams. With several groups (diverse beam search), a candidate token loses
diversity_penalty for every beam of an earlier group that took the same token at this step.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from servelm.engine.detokenizer import Detokenizer
from servelm.engine.sampling import log_softmax, logprob_entry
from servelm.engine.types import FinishReason, GenerationOutput, SamplingParams, TokenLogprob

NEG_INF = float("-inf")


@dataclass
class Beam:
    tokens: list[int] = field(default_factory=list)  # generated so far
    cumulative: float = 0.0
    logprobs: list[TokenLogprob] = field(default_factory=list)
    tail: bytes = b""  # the last bytes of its text, to find stop strings

    def extend(self, token: int, logprob: float, entry: TokenLogprob | None, data: bytes, keep: int) -> Beam:
        return Beam([*self.tokens, token], self.cumulative + logprob,
                    [*self.logprobs, entry] if entry is not None else self.logprobs, (self.tail + data)[-keep:])


@dataclass
class Hypothesis:
    beam: Beam
    score: float
    reason: str  # "stop" or "length"
    stop_reason: str | int | None = None


@dataclass(frozen=True)
class Move:
    parent: int  # index of the beam this one continues
    token: int


class BeamSearch:
    def __init__(self, params: SamplingParams, width: int, eog_ids: frozenset[int],
                 token_bytes: Callable[[int], bytes]) -> None:
        assert params.beam is not None
        self.params = params
        self.cfg = params.beam
        self.width = width
        self.eog = eog_ids
        self.token_bytes = token_bytes
        # every beam starts as the same empty text: only the first of each group may extend it at first
        size = width // self.cfg.groups
        self.beams = [Beam(cumulative=0.0 if i % size == 0 else NEG_INF) for i in range(width)]
        self.finished: list[Hypothesis] = []
        stops = [s.encode() for s in params.stop]
        self._tail_keep = 4 * max((len(s) for s in stops), default=0) + 64
        self.rows: dict[int, np.ndarray] = {}  # this step's processed rows so far, by beam
        self.done = False  # the search has its hypotheses
        self.closed = False  # and the engine has sent them

    # -- one step ---------------------------------------------------------------------------------
    def step(self, rows: np.ndarray) -> list[Move]:
        """rows: (width × vocab) processed logits, row i for beam i. Returns the new beams' moves; when
        the search is over, sets `done` and returns []."""
        logp = log_softmax(rows)
        length = len(self.beams[0].tokens) + 1
        groups = self.cfg.groups
        size = self.width // groups
        taken: Counter[int] = Counter()
        moves: list[Move] = []
        new_beams: list[Beam] = []
        for g in range(groups):
            lo = g * size
            scores = logp[lo : lo + size].copy()
            if self.cfg.diversity_penalty and taken:
                ids = np.fromiter(taken.keys(), dtype=np.int64)
                scores[:, ids] -= self.cfg.diversity_penalty * np.fromiter(taken.values(), dtype=np.float64)
            scores += np.array([b.cumulative for b in self.beams[lo : lo + size]])[:, None]
            chosen = self._choose(scores, logp, lo, size, length)
            for parent, token, beam in chosen:
                taken[token] += 1
                moves.append(Move(parent, token))
                new_beams.append(beam)
        if length >= self.params.max_tokens or len(moves) < self.width:
            for beam in new_beams:
                self._add(beam, "length")
            self.done = True
            return []
        self.beams = new_beams
        if self._settled(length):
            self.done = True
            return []
        return moves

    def _choose(self, scores: np.ndarray, logp: np.ndarray, lo: int, size: int,
                length: int) -> list[tuple[int, int, Beam]]:
        """The group's next beams: the best candidates that do not end; ending ones become hypotheses."""
        vocab = scores.shape[1]
        flat = scores.ravel()
        k = min(2 * size, flat.size)
        chosen: list[tuple[int, int, Beam]] = []
        seen = 0
        while True:
            cand = np.argpartition(-flat, k - 1)[:k]
            cand = cand[np.argsort(-flat[cand], kind="stable")]
            for rank, c in enumerate(cand[seen:], start=seen):
                if flat[c] == NEG_INF:
                    return chosen
                parent, token = lo + int(c) // vocab, int(c) % vocab
                beam = self._extend(parent, token, logp)
                end = self._ends(beam, token)
                if end is not None:
                    if rank < size:  # an ending candidate counts only among the group's best
                        self._add(beam, "stop", end[1])
                    continue
                chosen.append((parent, token, beam))
                if len(chosen) == size:
                    return chosen
            seen = k
            if k == flat.size:
                return chosen
            k = min(2 * k, flat.size)

    def _extend(self, parent: int, token: int, logp: np.ndarray) -> Beam:
        row = logp[parent]
        lp = float(row[token])
        entry = None
        if self.params.logprobs is not None:
            entry = logprob_entry(row, token, self.params.logprobs)
        return self.beams[parent].extend(token, lp, entry, self.token_bytes(token), self._tail_keep)

    def _ends(self, beam: Beam, token: int) -> tuple[str, str | int | None] | None:
        p = self.params
        if token in p.stop_token_ids:
            return ("stop", token)
        if token in self.eog and not p.ignore_eos:
            return ("stop", None)
        if p.stop:
            text = beam.tail.decode("utf-8", errors="ignore")
            for s in p.stop:
                if s in text:
                    return ("stop", s)
        return None

    def _add(self, beam: Beam, reason: str, stop_reason: str | int | None = None) -> None:
        score = beam.cumulative / (max(len(beam.tokens), 1) ** self.cfg.length_penalty)
        self.finished.append(Hypothesis(beam, score, reason, stop_reason))
        self.finished.sort(key=lambda h: -h.score)
        del self.finished[self.width :]

    def _settled(self, length: int) -> bool:
        """No running beam can still beat the worst kept hypothesis (Hugging Face's heuristic)."""
        if len(self.finished) < self.width:
            return False
        if self.cfg.early_stopping:
            return True
        best_running = max(b.cumulative for b in self.beams) / (length ** self.cfg.length_penalty)
        return bool(best_running <= self.finished[-1].score)

    def add_running(self, beam: Beam) -> None:
        """The search is cut short (out of KV cells): a running beam counts as a hypothesis cut for length."""
        self._add(beam, "length")

    def outputs(self, request_id: str, prompt_len: int, cached: int,
                detokenizer: Callable[[], Detokenizer]) -> list[GenerationOutput]:
        """The n best hypotheses as the request's final outputs, each text cut at its stop string."""
        params = self.params
        outs = []
        for i, hyp in enumerate(self.best(params.n)):
            detok = detokenizer()
            text = ""
            for token in hyp.beam.tokens:
                piece, hit = detok.push(token)
                text += piece
                if hit is not None:
                    break
            else:
                text += detok.flush()
            tokens, entries = list(hyp.beam.tokens), list(hyp.beam.logprobs)
            if hyp.reason == "stop" and (hyp.stop_reason is None or isinstance(hyp.stop_reason, int)):
                tokens, entries = tokens[:-1], entries[:-1]  # the EOS or stop token is not part of the text
            outs.append(GenerationOutput(
                request_id, i, text, tokens,
                finish_reason=FinishReason.STOP if hyp.reason == "stop" else FinishReason.LENGTH,
                stop_reason=hyp.stop_reason, prompt_tokens=prompt_len, completion_tokens=len(hyp.beam.tokens),
                cached_tokens=cached, logprobs=entries if params.logprobs is not None else None,
                cumulative_logprob=hyp.beam.cumulative,
            ))
        return outs

    def best(self, n: int) -> list[Hypothesis]:
        """The n best hypotheses; should the search have ended with fewer (a tiny vocabulary, every
        candidate ending), running beams fill the rest as cut for length."""
        best = self.finished[:n]
        for beam in self.beams[: n - len(best)] if len(best) < n else ():
            best.append(Hypothesis(beam, NEG_INF, "length"))
        return best


def beam_hosts(parents: list[int], width: int) -> list[int]:
    """Which of a request's `width` sequences holds each new beam (new beam i continues beam parents[i]): a
    parent's first child stays in the parent's sequence (and slot); each further child takes the sequence of a
    beam that left no child (and gets a copy of the parent's cells: Scheduler.update)."""
    children: dict[int, list[int]] = {}
    for i, p in enumerate(parents):
        children.setdefault(p, []).append(i)
    spare = [j for j in range(width) if j not in children]
    host = [0] * len(parents)
    for p, kids in children.items():
        host[kids[0]] = p
        for k in kids[1:]:
            host[k] = spare.pop()
    return host
