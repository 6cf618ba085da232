"""MeteredEngine: an Engine that times what another engine yields (first output, the gaps between a choice's
outputs, the last one) and counts tokens, for a meter that knows nothing of the engine (servelm/metrics.py's
GenerationMeter is one). The service layer sees an ordinary Engine and imports no Prometheus."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator
from contextlib import aclosing
from typing import Protocol

from servelm.engine.base import Engine, EngineWrapper
from servelm.engine.types import GenerationOutput, GenerationRequest


class Meter(Protocol):
    def first_output(self, seconds: float, prompt_tokens: int, queued: float, priority: int) -> None: ...

    def inter_token(self, seconds: float) -> None: ...

    def finished(self, seconds: float, completion_tokens: int, outcome: str) -> None: ...


class MeteredEngine(EngineWrapper):
    def __init__(self, inner: Engine, meter: Meter) -> None:
        super().__init__(inner)
        self.meter = meter

    async def generate(self, request: GenerationRequest) -> AsyncGenerator[GenerationOutput, None]:
        clock = time.perf_counter
        start = clock()
        last: dict[int, float] = {}  # choice index → when its latest output came
        completion: dict[int, int] = {}  # choice index → its tokens so far
        outcome = "aborted"
        try:
            async with aclosing(self.inner.generate(request)) as outputs:
                async for out in outputs:
                    now = clock()
                    if not last:
                        self.meter.first_output(now - start, len(request.prompt_token_ids), out.queued_seconds,
                                                request.priority)
                    elif out.index in last and out.token_ids:
                        self.meter.inter_token((now - last[out.index]) / len(out.token_ids))
                    last[out.index] = now
                    completion[out.index] = out.completion_tokens
                    yield out
            outcome = "completed"
        except (asyncio.CancelledError, GeneratorExit):
            raise
        except BaseException:
            outcome = "failed"
            raise
        finally:
            self.meter.finished(clock() - start, sum(completion.values()), outcome)
