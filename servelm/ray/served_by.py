"""`x-servelm-replica`: which model replica served a request, as a response header (pure ASGI).

RemoteEngine notes the replica (the first item of a replica's stream names it) in the request's ServedBy,
found through a context variable this middleware sets. A whole answer is sent after generation, so its
header is known by then; a stream's headers would leave before the replica is chosen (the role chunk comes
first), so the start of a response and its first body parts are held until a replica is named or the body
ends (an error before any replica was asked): the client sees the role chunk together with the first
token instead of a moment before it.

It also drops the app's own `x-request-id` response header: Ray Serve's HTTP layer adds one to every response
(the caller's id, or the one it gave the request, which the app read and logged), and two would be sent.

And it ends the request's calls to replicas that are still open when the request ends (RemoteEngine notes
them): Ray Serve cancels the ingress's request when its client goes away, and an answer or stream being
computed then (a generation the app runs in a task of its own, a generator left suspended) must not keep
its replica's sequence running.
"""

from __future__ import annotations

import contextvars
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from servelm.http.asgi import ASGIApp, Message, Receive, Scope, Send

REPLICA_HEADER = "x-servelm-replica"
REQUEST_ID_HEADER = b"x-request-id"  # Ray Serve sets it


class Call(Protocol):
    """A call to a replica (a Ray Serve response or response stream)."""

    def cancel(self) -> None: ...


@dataclass(eq=False)
class ServedBy:
    """What the ingress knows of the request it handles: the replicas that served it, its calls still open."""

    replicas: list[str] = field(default_factory=list)
    calls: dict[int, Call] = field(default_factory=dict)  # id → a call still open

    def add(self, replica: str) -> None:
        if replica not in self.replicas:
            self.replicas.append(replica)

    def cancel_calls(self) -> None:
        calls, self.calls = list(self.calls.values()), {}
        for call in calls:
            call.cancel()


SERVED_BY: contextvars.ContextVar[ServedBy | None] = contextvars.ContextVar("servelm_served_by", default=None)


def note_replica(replica: str) -> None:
    """Record that `replica` serves (part of) the request being handled, if a ReplicaHeader watches it."""
    served = SERVED_BY.get()
    if served is not None:
        served.add(replica)


def note_call(call: Call) -> None:
    """`call` (a replica's response) belongs to the request being handled: cancelled if the request ends first."""
    served = SERVED_BY.get()
    if served is not None:
        served.calls[id(call)] = call


def end_call(call: Call) -> None:
    served = SERVED_BY.get()
    if served is not None:
        served.calls.pop(id(call), None)


class ReplicaHeader:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        served = ServedBy()
        SERVED_BY.set(served)  # this request's context (and the tasks it starts) see it
        held: list[Message] | None = []

        async def flush() -> None:
            nonlocal held
            messages, held = held or [], None
            for m in messages:
                await send(_with_headers(m, served) if m["type"] == "http.response.start" else m)

        async def send_when_known(message: Message) -> None:
            if held is None:
                await send(message)
                return
            held.append(message)
            ended = message["type"] == "http.response.body" and not message.get("more_body", False)
            if served.replicas or ended:
                await flush()

        try:
            await self.app(scope, receive, send_when_known)
        finally:
            served.cancel_calls()  # none, unless the request ended before its answer (its client went away)
        if held:  # the app returned without ending its body: send what it wrote
            await flush()


def _with_headers(start: Message, served: ServedBy) -> Message:
    """The response's start, its x-request-id left to Ray Serve, with the replicas that served it."""
    headers = [(k, v) for k, v in start.get("headers", []) if k.lower() != REQUEST_ID_HEADER]
    if served.replicas:
        headers.append((REPLICA_HEADER.encode(), ",".join(served.replicas).encode()))
    return {**start, "headers": headers}
