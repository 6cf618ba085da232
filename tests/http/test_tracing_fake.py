"""Tracing on the fake model (a real uvicorn server), its spans read from an in-memory exporter beside the OTLP one:
one span per request and none for /health; the caller's traceparent as the parent; a streamed answer's usage and
finish reasons; n choices; the content filter's verdict; a grammar's event; a guard's checks as events, its own
generation kept out of the request's counts."""

from __future__ import annotations

import time

import httpx
import openai
import pytest
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from servelm.service.safety.blocklist import Blocklist
from servelm.service.safety.content_filter import ContentFilter
from servelm.service.safety.guard import Guard, GuardLabel
from servelm.tracing import TraceSettings, Tracing
from tests.otlp_receiver import OtlpReceiver

HI = [{"role": "user", "content": "hi"}]  # the fake model answers "bcdef..."
CALLER_TRACE, CALLER_SPAN = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"


@pytest.fixture(scope="module")
def receiver():
    r = OtlpReceiver()
    yield r
    r.stop()


@pytest.fixture
def traced(fake_server_factory, receiver):
    """A fake server with tracing on (to a receiver) and the spans it ends, as the SDK hands them over."""
    endpoint = receiver.start_http()

    def start(**kw):
        tracing = Tracing(TraceSettings(endpoint))
        spans = InMemorySpanExporter()
        tracing.provider.add_span_processor(SimpleSpanProcessor(spans))
        return fake_server_factory(tracing=tracing, **kw), spans

    return start


def server_spans(spans: InMemorySpanExporter, count: int) -> list:
    """The spans ended, once there are `count`: a span ends after its answer's last byte is sent, so just after the
    client has read it."""
    deadline = time.monotonic() + 5
    while len(spans.get_finished_spans()) < count and time.monotonic() < deadline:
        time.sleep(0.01)
    return list(spans.get_finished_spans())


def test_one_span_per_request_joined_to_the_callers_trace(traced):
    server, spans = traced()
    r = httpx.post(server.base_url + "/v1/chat/completions", timeout=10,
                   headers={"traceparent": f"00-{CALLER_TRACE}-{CALLER_SPAN}-01"},
                   json={"model": server.model, "messages": HI, "max_tokens": 5, "temperature": 0, "n": 2})
    assert r.status_code == 200
    httpx.get(server.base_url + "/health")
    (span,) = server_spans(spans, 1)
    assert span.name == f"chat {server.model}"
    assert f"{span.context.trace_id:032x}" == CALLER_TRACE and f"{span.parent.span_id:016x}" == CALLER_SPAN
    a = span.attributes
    body = r.json()
    assert a["gen_ai.response.id"] == body["id"] and a["gen_ai.request.choice.count"] == 2
    assert list(a["gen_ai.response.finish_reasons"]) == ["length", "length"]
    assert a["gen_ai.usage.output_tokens"] == body["usage"]["completion_tokens"] == 10
    assert a["gen_ai.usage.input_tokens"] == body["usage"]["prompt_tokens"] * 2  # each choice reads the prompt
    assert [e.name for e in span.events] == ["servelm.admitted", "servelm.prompt_read", "servelm.first_token"]


def test_a_streamed_answer_and_a_grammar(traced):
    server, spans = traced()
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0)
    text = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=server.model, messages=HI, max_tokens=6, stream=True) if c.choices)
    (span,) = server_spans(spans, 1)
    assert span.attributes["gen_ai.request.stream"] is True and span.attributes["gen_ai.usage.output_tokens"] == 6
    assert text and "gen_ai.output.messages" not in span.attributes
    client.chat.completions.create(model=server.model, messages=HI, max_tokens=3, extra_body={"guided_regex": "[a-z]+"})
    client.completions.create(model=server.model, prompt="hi", max_tokens=3)
    grammar, completion = server_spans(spans, 3)[-2:]
    assert completion.name == f"text_completion {server.model}"
    compiled = next(e for e in grammar.events if e.name == "servelm.grammar_compiled")
    assert compiled.attributes["servelm.grammar_kind"] == "regex"


def test_the_content_filters_verdict(traced):
    server, spans = traced(content_filter=ContentFilter(lists=[Blocklist(["forbidden", "re:fgh"], "words")]))
    ok = httpx.post(server.base_url + "/v1/chat/completions", timeout=10,
                    json={"model": server.model, "messages": HI, "max_tokens": 3})
    blocked = httpx.post(server.base_url + "/v1/chat/completions", timeout=10,
                         json={"model": server.model, "messages": [{"role": "user", "content": "forbidden"}]})
    cut = httpx.post(server.base_url + "/v1/chat/completions", timeout=10,
                     json={"model": server.model, "messages": HI, "max_tokens": 10})
    assert (ok.status_code, blocked.status_code, cut.json()["choices"][0]["finish_reason"]) == (200, 400, "content_filter")
    verdicts = [s.attributes.get("servelm.content_filter") for s in server_spans(spans, 3)]
    assert verdicts == ["passed", "filtered input:blocklist", "filtered output:blocklist"]
    assert server_spans(spans, 3)[1].attributes["http.response.status_code"] == 400



def test_a_guards_checks_are_events_and_its_tokens_are_not_the_requests(traced):
    guard = Guard("guard", "{{ messages[-1].content }}", (GuardLabel("S1", "Bad", "violence"),), timeout=5.0)
    server, spans = traced(content_filter=ContentFilter(guard=guard, window=4), extra_deployments=("guard",))
    body = httpx.post(server.base_url + "/v1/chat/completions", timeout=30,
                      json={"model": server.model, "messages": HI, "max_tokens": 6}).json()
    (span,) = server_spans(spans, 1)
    checks = [e for e in span.events if e.name == "servelm.guard_check"]
    assert len(checks) >= 2 and {e.attributes["servelm.role"] for e in checks} == {"User", "Agent"}
    assert all(e.attributes["servelm.guard"] == "guard" for e in checks)
    assert span.attributes["gen_ai.usage.output_tokens"] == body["usage"]["completion_tokens"] == 6
    assert list(span.attributes["gen_ai.response.finish_reasons"]) == ["length"]


def test_the_attributes_are_the_parameters_that_run_whatever_the_api_calls_them(traced):
    server, spans = traced()
    httpx.post(server.base_url + "/v1/responses", timeout=10,
               json={"model": server.model, "input": "hi", "max_output_tokens": 4, "temperature": 0.5})
    httpx.post(server.base_url + "/v1/messages", timeout=10,
               json={"model": server.model, "messages": HI, "max_tokens": 5, "stop_sequences": ["zz"], "top_k": 3})
    httpx.post(server.base_url + "/v1/completions", timeout=10, json={"model": server.model, "prompt": "hi"})
    responses, messages, completion = (s.attributes for s in server_spans(spans, 3))
    assert responses["gen_ai.request.max_tokens"] == 4 and responses["gen_ai.request.temperature"] == 0.5
    assert messages["gen_ai.request.max_tokens"] == 5 and messages["gen_ai.request.top_k"] == 3
    # left out: the defaults that ran (legacy completions' max_tokens is 16, as OpenAI's)
    assert completion["gen_ai.request.max_tokens"] == 16 and completion["gen_ai.request.temperature"] == 1.0
    assert completion["gen_ai.request.choice.count"] == 1


@pytest.mark.parametrize("capture", [False, True])
def test_stop_strings_are_request_text_in_a_trace_only_with_content(fake_server_factory, receiver, capture):
    tracing = Tracing(TraceSettings(receiver.start_http(), capture_content=capture))
    spans = InMemorySpanExporter()
    tracing.provider.add_span_processor(SimpleSpanProcessor(spans))
    server = fake_server_factory(tracing=tracing)
    r = httpx.post(server.base_url + "/v1/messages", timeout=10,
                   json={"model": server.model, "messages": HI, "max_tokens": 3, "stop_sequences": ["my stop"]})
    assert r.status_code == 200
    stops = server_spans(spans, 1)[0].attributes.get("gen_ai.request.stop_sequences")
    assert (stops is not None and "my stop" in stops) if capture else stops is None
