"""OpenTelemetry traces end to end (issue 37): a server with --otlp-traces-endpoint sends each request's span to a
real OTLP receiver (tests/otlp_receiver.py decodes the wire protobuf), over HTTP and over gRPC. The caller is the
official openai client on an OpenTelemetry-instrumented httpx client: its span must be the server span's parent.
The span carries the GenAI semantic conventions' attributes and servelm's own; the JSON access log carries the
trace id; prompts and answers appear only with --otlp-capture-content."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import openai
import pytest
from opentelemetry.instrumentation.httpx import HTTPXClientInstrumentor
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from tests.otlp_receiver import OtlpReceiver

from . import ray_mode
from .conftest import own_server
from .helpers import MODEL

pytestmark = [pytest.mark.e2e, pytest.mark.skipif(ray_mode.ENABLED, reason="under --ray: tests/ray/test_tracing.py")]
SERVER_KIND = 2  # OTLP's SPAN_KIND_SERVER
QUESTION = [{"role": "user", "content": "Name a colour of the sky."}]


@pytest.fixture(autouse=True)
def _quick_export(monkeypatch):
    """The servers send their spans every 0.2 s instead of the SDK's 5 (OTEL_BSP_SCHEDULE_DELAY, read by the SDK)."""
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "200")


@pytest.fixture(scope="module")
def receiver() -> Iterator[OtlpReceiver]:
    r = OtlpReceiver()
    yield r
    r.stop()


@contextmanager
def traced_client(base_url: str) -> Iterator[tuple[openai.OpenAI, InMemorySpanExporter]]:
    """The openai client over an httpx client whose requests are OpenTelemetry client spans (W3C traceparent sent);
    closed (its connections with it) at the end of the block."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    http = httpx.Client(timeout=120)
    HTTPXClientInstrumentor().instrument_client(http, tracer_provider=provider)
    with openai.OpenAI(base_url=base_url + "/v1", api_key="none", max_retries=0, http_client=http) as client:
        yield client, exporter


def test_a_traced_request_joins_the_callers_trace_with_the_genai_attributes(receiver, tmp_path_factory):
    endpoint = receiver.start_http()
    with own_server(tmp_path_factory, "--otlp-traces-endpoint", endpoint, "--log-format", "json") as srv, \
            traced_client(srv.base_url) as (client, exporter):
        reply = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=8, temperature=0, seed=3)
        (client_span,) = [s for s in exporter.get_finished_spans() if s.kind == SpanKind.CLIENT]
        trace_id = f"{client_span.context.trace_id:032x}"
        span = receiver.wait_for(lambda s: s.trace_id == trace_id and s.kind == SERVER_KIND)
        assert span.parent_span_id == f"{client_span.context.span_id:016x}", "the caller's span is the parent"
        assert span.name == f"chat {MODEL}" and span.resource["service.name"] == "servelm"
        a = span.attributes
        assert a["gen_ai.operation.name"] == "chat" and a["gen_ai.request.model"] == MODEL
        assert a["gen_ai.request.temperature"] == 0.0 and a["gen_ai.request.max_tokens"] == 8
        assert a["gen_ai.request.seed"] == 3 and a["gen_ai.request.stream"] is False
        assert a["gen_ai.response.id"] == reply.id
        assert a["gen_ai.response.finish_reasons"] == [reply.choices[0].finish_reason]
        assert a["gen_ai.usage.input_tokens"] == reply.usage.prompt_tokens
        assert a["gen_ai.usage.output_tokens"] == reply.usage.completion_tokens
        assert a["servelm.time_to_first_token_seconds"] > 0 and a["servelm.queue_seconds"] >= 0
        assert a["servelm.priority"] == 0 and a["http.response.status_code"] == 200
        assert "gen_ai.input.messages" not in a and "gen_ai.output.messages" not in a, "content only when asked for"
        for name in ("servelm.admitted", "servelm.prompt_read", "servelm.first_token"):
            assert span.event(name) is not None, name
        assert span.event("servelm.prompt_read")["servelm.prompt_tokens"] == reply.usage.prompt_tokens

        streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
            model=MODEL, messages=QUESTION, max_tokens=8, temperature=0, stream=True) if c.choices)
        assert streamed == reply.choices[0].message.content
        stream_trace = [s for s in exporter.get_finished_spans() if s.kind == SpanKind.CLIENT][-1].context.trace_id
        stream_span = receiver.wait_for(lambda s: s.trace_id == f"{stream_trace:032x}" and s.kind == SERVER_KIND)
        assert stream_span.attributes["gen_ai.request.stream"] is True
        assert stream_span.attributes["gen_ai.usage.output_tokens"] == reply.usage.completion_tokens

        schema = {"type": "object", "properties": {"colour": {"type": "string"}}, "required": ["colour"]}
        client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=16, temperature=0, response_format={
            "type": "json_schema", "json_schema": {"name": "c", "schema": schema}})
        grammar_trace = [s for s in exporter.get_finished_spans() if s.kind == SpanKind.CLIENT][-1].context.trace_id
        grammar_span = receiver.wait_for(lambda s: s.trace_id == f"{grammar_trace:032x}" and s.kind == SERVER_KIND)
        assert grammar_span.event("servelm.grammar_compiled")["servelm.grammar_kind"] == "json_schema"

        embedding_span_name = "POST /v1/embeddings"
        httpx.post(srv.base_url + "/v1/embeddings", json={"model": "all-minilm-l6-v2", "input": "hi"}, timeout=30)
        receiver.wait_for(lambda s: s.name in (embedding_span_name, "embeddings all-minilm-l6-v2"))

    lines = [json.loads(line) for line in srv.log_path.read_text().splitlines() if line.startswith("{")]
    access = [line for line in lines if line["logger"] == "servelm.access" and line.get("trace_id") == trace_id]
    assert access and access[0]["path"] == "/v1/chat/completions" and access[0]["status"] == 200
    assert access[0]["request_id"] and access[0]["duration_ms"] > 0


def test_grpc_and_captured_content(receiver, tmp_path_factory):
    endpoint = receiver.start_grpc()
    with own_server(tmp_path_factory, "--otlp-traces-endpoint", endpoint, "--otlp-protocol", "grpc",
                    "--otlp-capture-content", "--no-embedding-model") as srv, traced_client(srv.base_url) as (client, exporter):
        reply = client.completions.create(model=MODEL, prompt="The sky is", max_tokens=6, temperature=0)
        trace_id = f"{exporter.get_finished_spans()[-1].context.trace_id:032x}"
        span = receiver.wait_for(lambda s: s.trace_id == trace_id and s.kind == SERVER_KIND)
        assert span.name == f"text_completion {MODEL}"
        assert json.loads(span.attributes["gen_ai.input.messages"])[0]["parts"][0]["content"] == "The sky is"
        output = json.loads(span.attributes["gen_ai.output.messages"])
        assert output[0]["parts"][0]["content"] == reply.choices[0].text


def test_an_untraced_server_logs_the_callers_trace_id(tmp_path_factory):
    """Tracing off: nothing is exported, but the access line still carries the caller's trace id."""
    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    with own_server(tmp_path_factory, "--log-format", "json", "--no-embedding-model") as srv:
        r = httpx.get(srv.base_url + "/v1/models", headers={"traceparent": f"00-{trace_id}-00f067aa0ba902b7-01"})
        assert r.status_code == 200
    lines = [json.loads(line) for line in srv.log_path.read_text().splitlines() if line.startswith("{")]
    assert any(line.get("trace_id") == trace_id and line["path"] == "/v1/models" for line in lines)
