"""Traced: a pure-ASGI middleware that gives every request one OpenTelemetry SERVER span (GET /health and /metrics,
polled all the time, get none), a child of the caller's W3C `traceparent` when it sends one, current while the
app answers (so the access log writes its trace id, and the layers below add to it through servelm.tracing), and
ended when the last byte of the answer (a stream's too) is sent.

`describe_generation` names a generating request's span and adds its request attributes by the GenAI semantic
conventions, read from the engine's parameters the service prepared (whatever the API called them); the
answer's (id, finish reasons, usage) come from the engine's outputs (engine/wrappers/traced.py)."""

from __future__ import annotations

import json
from typing import Any

from opentelemetry import context, trace
from opentelemetry.trace import SpanKind, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from servelm.http.middleware import FILTERED_NOTE, route_template
from servelm.service.base import Prepared
from servelm.tracing import PROVIDER, RequestTrace, Tracing, bound

UNTRACED = frozenset({"/health", "/metrics"})


class Traced:
    def __init__(self, app: ASGIApp, tracing: Tracing) -> None:
        self.app = app
        self.tracing = tracing
        self.propagator = TraceContextTextMapPropagator()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("path") in UNTRACED:
            await self.app(scope, receive, send)
            return
        carrier = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        parent = self.propagator.extract(carrier)
        method, path = scope.get("method", ""), scope.get("path", "")
        span = self.tracing.tracer.start_span(f"{method} {path}", context=parent, kind=SpanKind.SERVER,
                                              attributes={"http.request.method": method, "url.path": path})
        request = RequestTrace(span, self.tracing.settings.capture_content)
        token = context.attach(trace.set_span_in_context(span, parent))
        status = 0

        async def traced_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            with bound(request):
                await self.app(scope, receive, traced_send)
        except BaseException as exc:
            span.record_exception(exc)
            status = status or 500
            raise
        finally:
            request.finish()
            if not request.named:
                span.update_name(f"{method} {route_template(scope)}")
            filtered = scope.get("state", {}).get(FILTERED_NOTE)
            if filtered:
                span.set_attribute("servelm.content_filter", f"filtered {filtered}")
            span.set_attribute("http.response.status_code", status or 499)
            if status >= 500:
                span.set_status(StatusCode.ERROR)
            span.end()
            context.detach(token)


# the sampling parameters that GenAI attributes name (gen_ai.request.*), as SamplingParams calls them
_SAMPLING = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "frequency_penalty": "frequency_penalty",
             "presence_penalty": "presence_penalty", "seed": "seed", "n": "choice.count", "max_tokens": "max_tokens"}


def describe_generation(trace: RequestTrace, req: Any, operation: str, prepared: Prepared) -> None:
    """Name the span `{operation} {model}` (the model the request named, else its deployment) and add the
    attributes of what runs: the engine's parameters of its first generation (a request's generations share
    them), its stream flag, priority and adapters. `req` gives the model named, and the prompt when content is
    captured."""
    gens, deployment = prepared.generations, prepared.deployment.name
    model = getattr(req, "model", None) or deployment
    trace.rename(f"{operation} {model}")
    trace.requests.update(g.request_id for g in gens)
    params = gens[0].params
    attributes: dict[str, Any] = {f"gen_ai.request.{name}": getattr(params, field) for field, name in _SAMPLING.items()}
    attributes.update({
        "gen_ai.operation.name": operation, "gen_ai.provider.name": PROVIDER, "gen_ai.request.model": model,
        "gen_ai.response.model": deployment,
        "gen_ai.request.stream": prepared.stream, "servelm.priority": gens[0].priority,
        "servelm.lora": [name for name, _ in gens[0].adapters] or None,
    })
    trace.span.set_attributes({k: _plain(v) for k, v in attributes.items() if v is not None})
    if trace.capture_content:  # request text: the prompt, and the stop strings
        trace.span.set_attribute("gen_ai.input.messages", _input_messages(req))
        if params.stop:
            trace.span.set_attribute("gen_ai.request.stop_sequences", _plain(list(params.stop)))


def _plain(v: Any) -> Any:
    return [str(x) for x in v] if isinstance(v, list | tuple) else v


def _input_messages(req: Any) -> str:
    """The prompt as the conventions' `gen_ai.input.messages`: each message's role and its text parts."""
    messages = getattr(req, "messages", None)
    if messages is None:
        prompt = getattr(req, "prompt", "")
        texts = [prompt] if isinstance(prompt, str) else [p for p in prompt if isinstance(p, str)]
        return json.dumps([{"role": "user", "parts": [{"type": "text", "content": t}]} for t in texts])
    out = []
    for m in messages:
        raw = m if isinstance(m, dict) else m.model_dump(exclude_none=True)
        content = raw.get("content")
        parts = [content] if isinstance(content, str) else [p.get("text") for p in content or [] if isinstance(p, dict)]
        out.append({"role": raw.get("role"), "parts": [{"type": "text", "content": p} for p in parts if p]})
    return json.dumps(out)
