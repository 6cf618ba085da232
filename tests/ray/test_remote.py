"""RemoteEngine and the replica header without a cluster: a stand-in handle whose streams lose their replica
where a test says, and a tiny ASGI app."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest

from servelm.engine.types import EngineStats, FinishReason, GenerationOutput, GenerationRequest, SamplingParams
from servelm.errors import QueueFull, ServiceUnavailable
from servelm.ray.served_by import REPLICA_HEADER, SERVED_BY, ReplicaHeader, ServedBy

pytestmark = pytest.mark.ray
REQUEST = GenerationRequest("req-1", (1, 2, 3), SamplingParams(max_tokens=2))


def out(text: str, last: bool = False) -> GenerationOutput:
    return GenerationOutput("req-1", 0, text, [7], finish_reason=FinishReason.LENGTH if last else None)


class FakeStream:
    """A replica's stream: its id, then output lists; `die_after` items in, the replica is gone."""

    def __init__(self, replica: str, items: list, die_after: int | None) -> None:
        self.items = [replica, *items]
        self.die_after = die_after
        self.cancelled = False

    def __aiter__(self) -> AsyncIterator:
        return self._run()

    async def _run(self) -> AsyncIterator:
        from ray.exceptions import ActorDiedError

        for n, item in enumerate(self.items):
            if self.die_after is not None and n >= self.die_after:
                raise ActorDiedError()
            yield item

    def cancel(self) -> None:
        self.cancelled = True


class FakeHandle:
    """Hands out the scripted streams in order, one per call."""

    def __init__(self, streams: list[FakeStream]) -> None:
        self.streams = streams
        self.calls = 0

    def options(self, **_: Any) -> FakeHandle:
        return self

    def remote(self, _request: Any) -> FakeStream:
        self.calls += 1
        return self.streams[self.calls - 1]


def engine(*streams: FakeStream):
    from servelm.ray.remote import RemoteEngine, ReplicaSet

    return RemoteEngine(ReplicaSet("model", FakeHandle(list(streams)), slots_per_replica=2))


async def collect(eng) -> tuple[list[str], list[str]]:
    served = ServedBy()
    SERVED_BY.set(served)
    texts = [o.text async for o in eng.generate(REQUEST)]
    return texts, served.replicas


async def test_a_request_lost_before_any_output_is_sent_again() -> None:
    first = FakeStream("a", [[out("x")]], die_after=1)  # the id came, then the replica died
    second = FakeStream("b", [[out("he")], [out("llo", last=True)]], die_after=None)
    texts, replicas = await collect(engine(first, second))
    assert texts == ["he", "llo"] and replicas == ["a", "b"]
    assert first.cancelled and second.cancelled  # each stream closed (a no-op for one that ended)


async def test_a_request_lost_after_output_is_a_503() -> None:
    eng = engine(FakeStream("a", [[out("x")], [out("y")]], die_after=2))
    with pytest.raises(ServiceUnavailable) as caught:
        await collect(eng)
    assert caught.value.status == 503 and caught.value.code == "replica_unavailable"


async def test_every_try_lost_is_a_503() -> None:
    eng = engine(*(FakeStream(r, [[out("x")]], die_after=0) for r in "abc"))
    with pytest.raises(ServiceUnavailable):
        await collect(eng)


async def test_the_replicas_own_error_keeps_its_status() -> None:
    from ray.exceptions import RayTaskError

    class Failing(FakeStream):
        async def _run(self) -> AsyncIterator:
            yield "a"
            raise RayTaskError("generate", "traceback", QueueFull(3))

    with pytest.raises(QueueFull):
        await collect(engine(Failing("a", [], None)))


def test_stats_add_up() -> None:
    from servelm.ray.replica import ReplicaStats

    eng = engine()
    one = EngineStats(1, 2, 10, 5, 100, 23040, 1, 2)
    eng.replicas.latest = [ReplicaStats("a", one, None), ReplicaStats("b", one, None)]
    assert (eng.stats().running, eng.stats().waiting, eng.stats().total_slots) == (2, 4, 4)


async def run_app(app) -> list[dict]:
    sent: list[dict] = []

    async def send(message: dict) -> None:
        sent.append(message)

    async def receive() -> dict:
        return {"type": "http.request", "body": b"", "more_body": False}

    await ReplicaHeader(app)({"type": "http", "path": "/"}, receive, send)
    return sent


async def test_a_stream_waits_for_its_replica_before_its_headers() -> None:
    from servelm.ray.served_by import note_replica

    async def app(scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"role", "more_body": True})
        note_replica("r1")
        await send({"type": "http.response.body", "body": b"token", "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    sent = await run_app(app)
    assert [m["type"] for m in sent] == ["http.response.start"] + ["http.response.body"] * 3
    assert (REPLICA_HEADER.encode(), b"r1") in sent[0]["headers"]


async def test_an_answer_without_a_replica_goes_out_unchanged() -> None:
    async def app(scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": 404, "headers": [(b"a", b"b")]})
        await send({"type": "http.response.body", "body": b"{}", "more_body": False})

    sent = await run_app(app)
    assert sent[0]["headers"] == [(b"a", b"b")] and sent[1]["body"] == b"{}"


async def test_the_apps_request_id_header_is_left_to_ray_serve() -> None:
    """Ray Serve's HTTP layer adds x-request-id to every response: the app's own would make two."""
    from servelm.ray.served_by import note_replica

    async def app(scope, receive, send) -> None:
        note_replica("r1")
        await send({"type": "http.response.start", "status": 200, "headers": [(b"x-request-id", b"id-1"), (b"a", b"b")]})
        await send({"type": "http.response.body", "body": b"{}", "more_body": False})

    sent = await run_app(app)
    assert sent[0]["headers"] == [(b"a", b"b"), (REPLICA_HEADER.encode(), b"r1")]


def test_a_call_is_a_request_of_its_own_within_the_http_request() -> None:
    """Ray Serve's router indexes waiting calls by the internal request id: two calls of one HTTP request must
    not share it (a completions batch of two prompts), and they keep the HTTP request's id."""
    import contextvars

    from ray.serve.context import _get_serve_request_context, _set_request_context

    from servelm.ray.remote import own_request

    class Seen:
        def remote(self, *_: Any):
            return _get_serve_request_context()

    def in_request() -> tuple:
        _set_request_context(request_id="http-1", _internal_request_id="internal-1")
        return own_request(Seen()), own_request(Seen()), _get_serve_request_context()

    first, second, after = contextvars.Context().run(in_request)
    assert first.request_id == second.request_id == "http-1"
    assert len({first._internal_request_id, second._internal_request_id, "internal-1"}) == 3
    assert after._internal_request_id == "internal-1"  # the HTTP request's own context is unchanged


async def test_health_and_metrics_ask_the_replicas_first() -> None:
    from servelm.ray.ingress import FreshStats

    class Replicas:
        refreshed = 0

        async def refresh(self, timeout_s: float) -> None:
            self.refreshed += 1

    async def app(scope, receive, send) -> None:
        pass

    replicas = Replicas()
    fresh = FreshStats(app, [replicas])  # type: ignore[list-item]
    for method, path in (("GET", "/health"), ("GET", "/metrics"), ("POST", "/v1/chat/completions"), ("GET", "/v1/models")):
        await fresh({"type": "http", "method": method, "path": path}, None, None)
    assert replicas.refreshed == 2


async def test_calls_still_open_when_the_request_ends_are_cancelled() -> None:
    """Ray Serve cancels the ingress's request when its client goes away: its generations must stop with it."""
    import asyncio

    from servelm.ray.served_by import end_call, note_call

    class Call:
        cancelled = False

        def cancel(self) -> None:
            self.cancelled = True

    still_open, over = Call(), Call()

    async def app(scope, receive, send) -> None:
        note_call(still_open)
        note_call(over)
        end_call(over)
        raise asyncio.CancelledError

    with pytest.raises(asyncio.CancelledError):
        await run_app(app)
    assert still_open.cancelled and not over.cancelled


class Broadcasts:
    """A handle's broadcast over stand-in replicas, each a dict of its adapters (name -> path); records the calls."""

    def __init__(self, replicas: list[dict[str, str]], fail: Exception | None = None) -> None:
        self.replicas = replicas
        self.fail = fail
        self.calls: list[tuple] = []

    def broadcast(self, method: str, *args: Any) -> Any:
        self.calls.append((method, *args))
        answers: list[Any] = []
        for held in self.replicas:
            if method == "add_adapter" and self.fail is not None:
                answers.append(self.fail)
                continue
            if method == "add_adapter":
                held[args[0]] = args[1]
            elif method == "remove_adapter":
                held.pop(args[0], None)
            elif method == "ensure_adapters":
                held.update({name: path for name, path, _ in args[0]})
            answers.append(None)
        return _Answers(answers)


class _Answers:
    def __init__(self, answers: list[Any]) -> None:
        self.answers = answers

    async def results_async(self, **_: Any) -> list[Any]:
        return self.answers


def _replica_set(handle: Broadcasts) -> Any:
    from servelm.ray.remote import ReplicaSet
    from servelm.ray.replica import ReplicaStats

    replicas = ReplicaSet("m", handle, 2)

    async def refresh(timeout_s: float = 5.0) -> None:  # the replicas' counts, as their stats() would say
        replicas.latest = [ReplicaStats(f"r{i}", EngineStats(0, 0, 0, 0, 8, 1, 2, 2), None, tuple((n, True, 0) for n in held))
                           for i, held in enumerate(handle.replicas)]

    replicas.refresh = refresh  # type: ignore[method-assign]
    return replicas


async def test_adapters_loaded_by_route_reach_every_replica_and_a_new_one_gets_them() -> None:
    from servelm.config import LoraSpec
    from servelm.ray.remote import ReplicaAdapters

    handle = Broadcasts([{"two": "/a/two.gguf"}, {"two": "/a/two.gguf"}])
    replicas = _replica_set(handle)
    adapters = ReplicaAdapters(replicas, [LoraSpec.parse("two=/a/two.gguf")], max_loaded=8)
    await adapters.add("three", "/a/three.gguf", 0.5)
    assert handle.replicas == [{"two": "/a/two.gguf", "three": "/a/three.gguf"}] * 2
    assert [(a.name, a.loaded) for a in adapters.all()] == [("two", True), ("three", True)]
    assert adapters.select("three", None) == (("three", 0.5),)

    handle.replicas.append({"two": "/a/two.gguf"})  # a replica started since (a replacement, a scale-up)
    await replicas.refresh()
    await adapters.sync()
    assert handle.replicas[2] == {"two": "/a/two.gguf", "three": "/a/three.gguf"}
    handle.calls.clear()
    await replicas.refresh()
    await adapters.sync()
    assert handle.calls == [], "nothing is sent while every replica has them all"

    await adapters.remove("three")
    assert handle.replicas == [{"two": "/a/two.gguf"}] * 3 and "three" not in adapters


async def test_an_adapter_a_replica_refuses_is_taken_back_everywhere_with_its_error() -> None:
    from servelm.errors import NotFound
    from servelm.ray.remote import ReplicaAdapters

    handle = Broadcasts([{}, {}], fail=NotFound("The LoRA adapter file '/x' does not exist.", code="lora_path_not_found"))
    adapters = ReplicaAdapters(_replica_set(handle), [], max_loaded=8)
    with pytest.raises(NotFound):
        await adapters.add("x", "/x")
    assert "x" not in adapters and handle.calls[-1] == ("remove_adapter", "x")
