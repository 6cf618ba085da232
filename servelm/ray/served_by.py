"""`x-servelm-replica`: which model replica served a request, as a response header (pure ASGI).

RemoteEngine notes the replica (the first item of a replica's stream names it) in the request's ServedBy,
found through a context variable this middleware sets. A whole answer is sent after generation, so its
header is known by then; a stream's headers would leave before the replica is chosen (the role chunk comes
first), so the start of a response and its first body parts are held until a replica is named or the body
ends (an error before any replica was asked): the client sees the role chunk together with the first
token instead of a moment before it.
"""

from __future__ import annotations

import contextvars
from dataclasses import dataclass, field
from typing import Any

REPLICA_HEADER = "x-servelm-replica"


@dataclass(eq=False)
class ServedBy:
    replicas: list[str] = field(default_factory=list)

    def add(self, replica: str) -> None:
        if replica not in self.replicas:
            self.replicas.append(replica)


SERVED_BY: contextvars.ContextVar[ServedBy | None] = contextvars.ContextVar("servelm_served_by", default=None)


def note_replica(replica: str) -> None:
    """Record that `replica` serves (part of) the request being handled, if a ReplicaHeader watches it."""
    served = SERVED_BY.get()
    if served is not None:
        served.add(replica)


class ReplicaHeader:
    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        served = ServedBy()
        SERVED_BY.set(served)  # this request's context (and the tasks it starts) see it
        held: list[dict] | None = []

        async def send_when_known(message: dict) -> None:
            nonlocal held
            if held is None:
                await send(message)
                return
            held.append(message)
            ended = message["type"] == "http.response.body" and not message.get("more_body", False)
            if not served.replicas and not ended:
                return
            start, rest = held[0], held[1:]
            held = None
            if served.replicas and start["type"] == "http.response.start":
                value = ",".join(served.replicas).encode()
                start = {**start, "headers": [*start.get("headers", []), (REPLICA_HEADER.encode(), value)]}
            for m in (start, *rest):
                await send(m)

        await self.app(scope, receive, send_when_known)
        if held:  # the app returned without ending its body: send what it wrote
            for m in held:
                await send(m)
