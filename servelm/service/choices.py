"""Folding a request's engine outputs into its choices, shared by every generating endpoint.

With best_of > n the engine runs best_of sequences and the n with the highest cumulative logprob become
the choices; with beam search the engine itself sends only the n chosen hypotheses, at the end. In both
cases a stream can send a choice only once it is chosen (see `streams_live`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from servelm.engine.types import FinishReason, GenerationOutput, SamplingParams, TokenLogprob


def streams_live(params: SamplingParams) -> bool:
    """Whether outputs can be streamed as they arrive: every sequence run is a choice returned."""
    return params.beam is None and params.num_seqs == params.n


@dataclass
class SeqResult:
    """Everything one sequence produced."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    final: GenerationOutput | None = None

    def add(self, out: GenerationOutput) -> None:
        self.text += out.text
        self.token_ids += out.token_ids
        if out.logprobs:
            self.logprobs += out.logprobs
        if out.finished:
            self.final = out


class Collector:
    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        count = params.n if params.beam is not None else params.num_seqs
        self.seqs = [SeqResult() for _ in range(count)]
        self.prompt_logprobs: list[TokenLogprob | None] | None = None
        self.completion_tokens = 0
        self.cached_tokens = 0
        self.prompt_tokens = 0
        # for llama-server's timings: when it was asked for (perf_counter), its first and latest output
        self.started = time.perf_counter()
        self.first: GenerationOutput | None = None
        self.first_at = self.last_at = 0.0

    def add(self, out: GenerationOutput) -> None:
        self.last_at = time.perf_counter()
        if self.first is None:
            self.first, self.first_at = out, self.last_at
        self.seqs[out.index].add(out)
        self.cached_tokens = out.cached_tokens
        self.prompt_tokens = out.prompt_tokens
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        if out.finished:
            self.completion_tokens += out.completion_tokens

    @property
    def reasoning_tokens(self) -> int:
        return sum(s.final.reasoning_tokens for s in self.seqs if s.final is not None)

    def timings(self) -> dict[str, Any]:
        """llama-server's `timings`, with the time the request waited (queue_ms: from its arrival here to the
        engine's first step for it)."""
        first = self.first
        prompt_s = first.prompt_seconds if first is not None else 0.0
        waited = max(0.0, self.first_at - self.started - prompt_s) if first is not None else 0.0
        prompt_n = max(0, self.prompt_tokens - self.cached_tokens)
        predicted_ms = max(0.0, self.last_at - self.first_at) * 1000
        out: dict[str, Any] = {"cache_n": self.cached_tokens, "prompt_n": prompt_n, "prompt_ms": prompt_s * 1000}
        out.update(_rates("prompt", prompt_n, prompt_s * 1000))
        out.update(predicted_n=self.completion_tokens, predicted_ms=predicted_ms)
        out.update(_rates("predicted", self.completion_tokens, predicted_ms))
        out["queue_ms"] = waited * 1000
        # llama-server's names: speculative guesses read, and those that held
        finals = [s.final for s in self.seqs if s.final is not None]
        out.update(draft_n=sum(f.draft_tokens for f in finals), draft_n_accepted=sum(f.draft_accepted for f in finals))
        return out

    def stop(self, index: int) -> None:
        """The caller ended a sequence early (the engine's request is aborted): it counts as stopped there."""
        seq = self.seqs[index]
        seq.final = GenerationOutput("", index, "", finish_reason=FinishReason.STOP, completion_tokens=len(seq.token_ids))
        self.completion_tokens += len(seq.token_ids)

    def chosen(self) -> list[SeqResult]:
        """The choices, in the order returned: by cumulative logprob when best_of ran more than n."""
        if len(self.seqs) == self.params.n:
            return list(self.seqs)
        ranked = sorted(self.seqs, key=lambda s: -(s.final.cumulative_logprob if s.final else float("-inf")))
        return ranked[: self.params.n]


def _rates(kind: str, n: int, ms: float) -> dict[str, float]:
    return {f"{kind}_per_token_ms": ms / n if n else 0.0, f"{kind}_per_second": n * 1000 / ms if ms > 0 else 0.0}
