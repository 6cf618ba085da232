"""Where the engine thread's time goes: wall seconds per phase of the step, each counted once (exclusive).

The engine thread enters a phase around each part of its step; a phase entered inside another pauses the outer one,
so that grammar masks computed while sampling count as `grammar`, not `sample`. `/metrics` shows the totals as
`servelm_engine_phase_seconds_total{phase}`, and the comparison harness turns them into the per-step breakdown of
docs/performance.md. A leaf: it imports nothing of servelm.
"""

from __future__ import annotations

import ctypes
import time
from types import TracebackType

# decode: inside llama_decode (the pass, and the wait for the GIL as it returns), timed around the call; runner: the
# rest of the runner's step (batches, KV operations, logits copies); sample: logits to tokens (bias,
# penalties, temperature, top-k/p, the draw); logprobs: the drawn tokens' logprobs and alternatives, prompt scores;
# grammar: masks and matcher advances; detokenize: tokens to text and stop strings; output: the output stage's own
# work (stop rules, GenerationOutputs); send: handing the outputs to the event loop; loop: the rest of the engine's
# step (the scheduler and its update); idle: waiting with requests unfinished
PHASES = ("decode", "runner", "sample", "logprobs", "grammar", "detokenize", "output", "send", "loop", "idle")
ENGINE_THREAD = "servelm-engine"  # the engine thread's name in /proc (top -H, /metrics' thread CPU)


class PhaseClock:
    """Exclusive wall time per phase, for one thread. Others may read `seconds` at any time (a copy: its keys never
    change)."""

    def __init__(self) -> None:
        self._seconds = dict.fromkeys(PHASES, 0.0)
        self._stack: list[str] = []
        self._since = time.perf_counter()
        self._phases = {p: _Phase(self, p) for p in PHASES}  # made once: phase() runs a few times a token

    @property
    def seconds(self) -> dict[str, float]:
        return dict(self._seconds)

    def enter(self, phase: str) -> None:
        now = time.perf_counter()
        if self._stack:
            self._seconds[self._stack[-1]] += now - self._since
        self._stack.append(phase)
        self._since = now

    def leave(self) -> None:
        now = time.perf_counter()
        self._seconds[self._stack.pop()] += now - self._since
        self._since = now

    def phase(self, phase: str) -> _Phase:
        """`with clock.phase(name):` times the block under that phase."""
        return self._phases[phase]

    def move(self, seconds: float, source: str, target: str) -> None:
        """Count `seconds` already counted under `source` (a phase that has ended) under `target` instead: a part
        timed by someone else, inside it."""
        self._seconds[source] -= seconds
        self._seconds[target] += seconds


class _Phase:
    def __init__(self, clock: PhaseClock, name: str) -> None:
        self._clock, self._name = clock, name

    def __enter__(self) -> None:
        self._clock.enter(self._name)

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self._clock.leave()


def name_thread(name: str) -> None:
    """Give the calling thread its name in /proc/self/task/<tid>/comm (at most 15 bytes), where `top -H` and /metrics'
    per-thread CPU find it; a no-op where the C library has no prctl."""
    try:
        ctypes.CDLL(None).prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):
        pass
