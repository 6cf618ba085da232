"""TracedEngine: hands each output of a traced request's own generations to its RequestTrace (servelm/tracing.py),
which adds them up onto its span: the answer's id, finish reasons and usage, the time to the first token, cached and
drafted tokens, and the text when content is captured. Wrapped around every engine only while tracing is on."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncGenerator
from contextlib import aclosing

from servelm import tracing
from servelm.engine.base import EngineWrapper
from servelm.engine.types import GenerationOutput, GenerationRequest


class TracedEngine(EngineWrapper):
    async def generate(self, request: GenerationRequest) -> AsyncGenerator[GenerationOutput, None]:
        trace = tracing.current()
        if trace is not None and request.request_id not in trace.requests:
            trace = None  # a guard's request, run for this one: its tokens are not this request's
        if trace is not None:
            request = dataclasses.replace(request, traceparent=trace.traceparent())  # a Ray replica's span joins it
        prompt_tokens = len(request.prompt_token_ids)
        async with aclosing(self.inner.generate(request)) as outputs:
            async for out in outputs:
                if trace is not None:
                    trace.output(request.request_id, out, prompt_tokens)
                yield out
