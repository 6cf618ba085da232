"""OpenTelemetry traces (`--otlp-traces-endpoint`): a tracer provider exporting over OTLP, and each request's
RequestTrace, which the layers below HTTP reach through a context variable to add what they know (the engine's
outputs, admission, guard checks, grammar compilation) without a span handed down to them.

Attribute names follow the OpenTelemetry GenAI semantic conventions (`gen_ai.*`); servelm's own are `servelm.*`.
Prompt and answer text go into a trace only with `--otlp-capture-content` (the conventions' opt-in).

Off by default, and free when off: no provider exists, `current()` is None, and every hook returns at once.
"""

from __future__ import annotations

import contextvars
import json
import logging
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SpanExporter
    from opentelemetry.trace import Span, Tracer


log = logging.getLogger("servelm.tracing")

OtlpProtocol = Literal["http/protobuf", "grpc"]
PROVIDER = "servelm"  # gen_ai.provider.name
FLUSH_TIMEOUT = 5.0  # seconds the last spans may take at a stop with no timeout of its own
_current: contextvars.ContextVar[RequestTrace | None] = contextvars.ContextVar("servelm_trace", default=None)


@dataclass(frozen=True)
class TraceSettings:
    """Where spans go: an OTLP endpoint (HTTP: a URL, `/v1/traces` added when it has no path; gRPC: host:port or a
    URL), and whether prompts and answers are recorded."""

    endpoint: str
    protocol: OtlpProtocol = "http/protobuf"
    capture_content: bool = False
    service_name: str = "servelm"


class Tracing:
    """A tracer provider of our own (the process's global one is left alone) exporting in batches over OTLP."""

    def __init__(self, settings: TraceSettings) -> None:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        from servelm import __version__

        self.settings = settings
        # shutdown_on_exit=False: the SDK's own exit hook would flush again, unbounded, after the server's shutdown
        self.provider: TracerProvider = TracerProvider(resource=Resource.create({"service.name": settings.service_name,
                                                                                 "service.version": __version__}),
                                                       shutdown_on_exit=False)
        self.provider.add_span_processor(BatchSpanProcessor(_exporter(settings)))
        self.tracer: Tracer = self.provider.get_tracer("servelm", __version__)

    def shutdown(self, timeout: float = FLUSH_TIMEOUT) -> None:
        """Send what is buffered, then stop (at the server's shutdown), for at most `timeout` seconds: an endpoint
        that does not answer (the exporter retries for up to a minute) never holds the process past its shutdown
        timeout. The flush goes on in a daemon thread, which the process's exit does not wait for."""
        flush = threading.Thread(target=self.provider.shutdown, name="servelm-otlp-flush", daemon=True)
        flush.start()
        flush.join(max(0.0, timeout))
        if flush.is_alive():
            log.warning("tracing: the OTLP endpoint %s did not take the last spans within %.1f s; they are dropped",
                        self.settings.endpoint, timeout)


def _exporter(settings: TraceSettings) -> SpanExporter:
    endpoint = settings.endpoint
    if settings.protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter

        plain = endpoint.startswith("http://") or "://" not in endpoint
        return GrpcExporter(endpoint=endpoint.split("://", 1)[-1], insecure=plain)
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter

    if "://" not in endpoint:
        endpoint = "http://" + endpoint
    if endpoint.split("://", 1)[1].count("/") == 0:
        endpoint += "/v1/traces"
    return HttpExporter(endpoint=endpoint)


@dataclass(eq=False)
class RequestTrace:
    """One request's span, and what its generations add up to (written onto the span when it ends)."""

    span: Span
    capture_content: bool = False
    started: float = field(default_factory=time.perf_counter)
    named: bool = False  # given its GenAI name (`chat MODEL`), else the route's
    requests: set[str] = field(default_factory=set)  # its own generations' ids (not a guard's it waits for)
    response_id: str | None = None
    finish_reasons: list[str] = field(default_factory=list)
    input_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    reasoning_tokens: int = 0
    draft_tokens: int = 0
    draft_accepted: int = 0
    queued_seconds: float | None = None
    first_token_seconds: float | None = None
    answers: dict[tuple[str, int], list[str]] = field(default_factory=dict)  # (request, choice) → text, when captured
    outputs: int = 0

    def rename(self, name: str) -> None:
        self.span.update_name(name)
        self.named = True

    def traceparent(self) -> str:
        """The span as a W3C traceparent, for work it hands to another process (a Ray replica)."""
        c = self.span.get_span_context()
        return f"00-{c.trace_id:032x}-{c.span_id:016x}-{int(c.trace_flags):02x}"

    def set(self, **attributes: Any) -> None:
        """Attributes by keyword: `gen_ai__request__model` is `gen_ai.request.model` (None values left out)."""
        self.span.set_attributes({k.replace("__", "."): _value(v) for k, v in attributes.items() if v is not None})

    def event(self, name: str, **attributes: Any) -> None:
        self.span.add_event(name, {k.replace("__", "."): _value(v) for k, v in attributes.items() if v is not None})

    def output(self, request_id: str, out: Any, prompt_tokens: int) -> None:
        """One GenerationOutput of one of the request's generations (engine/types.py)."""
        if self.response_id is None:
            self.response_id = request_id
        key = (request_id, out.index)
        first = key not in self.answers
        if first:
            self.answers[key] = []
            if self.outputs == 0:
                self.first_token_seconds = time.perf_counter() - self.started
                self.queued_seconds = out.queued_seconds
                self.event("servelm.prompt_read", servelm__prompt_tokens=prompt_tokens,
                           servelm__cached_tokens=out.cached_tokens, servelm__queued_seconds=out.queued_seconds,
                           servelm__prompt_seconds=out.prompt_seconds)
                self.event("servelm.first_token", servelm__time_to_first_token_seconds=self.first_token_seconds)
        self.outputs += 1
        if self.capture_content and out.text:
            self.answers[key].append(out.text)
        if out.finish_reason is not None:
            self.finish_reasons.append(str(getattr(out.finish_reason, "value", out.finish_reason)))
            self.input_tokens += out.prompt_tokens
            self.output_tokens += out.completion_tokens
            self.cached_tokens += out.cached_tokens
            self.reasoning_tokens += out.reasoning_tokens
            self.draft_tokens += out.draft_tokens
            self.draft_accepted += out.draft_accepted

    def finish(self) -> None:
        """The totals onto the span (once, as it ends)."""
        if not self.outputs:
            return
        self.set(gen_ai__response__id=self.response_id, gen_ai__response__finish_reasons=self.finish_reasons,
                 gen_ai__usage__input_tokens=self.input_tokens, gen_ai__usage__output_tokens=self.output_tokens,
                 gen_ai__usage__cache_read__input_tokens=self.cached_tokens,
                 gen_ai__usage__reasoning__output_tokens=self.reasoning_tokens or None,
                 gen_ai__response__time_to_first_chunk=self.first_token_seconds,
                 servelm__queue_seconds=self.queued_seconds, servelm__time_to_first_token_seconds=self.first_token_seconds,
                 servelm__cached_tokens=self.cached_tokens, servelm__draft_tokens=self.draft_tokens,
                 servelm__draft_accepted_tokens=self.draft_accepted)
        if self.capture_content:
            self.set(gen_ai__output__messages=json.dumps([
                {"role": "assistant", "parts": [{"type": "text", "content": "".join(parts)}]}
                for parts in self.answers.values()]))


def _value(v: Any) -> Any:
    """An attribute value OpenTelemetry takes: a scalar, or a homogeneous sequence of them."""
    if isinstance(v, str | bool | int | float):
        return v
    if isinstance(v, Sequence):
        return [str(x) for x in v]
    return str(v)


def current() -> RequestTrace | None:
    """The request being traced in this context (None when tracing is off or outside a request)."""
    return _current.get()


@contextmanager
def bound(trace: RequestTrace) -> Iterator[None]:
    token = _current.set(trace)
    try:
        yield
    finally:
        _current.reset(token)


def event(name: str, **attributes: Any) -> None:
    """An event on the current request's span, if it is traced (names with `__` for dots, as RequestTrace.set)."""
    t = _current.get()
    if t is not None:
        t.event(name, **attributes)


def annotate(**attributes: Any) -> None:
    """Attributes on the current request's span, if it is traced."""
    t = _current.get()
    if t is not None:
        t.set(**attributes)
