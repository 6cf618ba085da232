"""A streamed answer's framing: server-sent events (a `data:` frame per chunk, then `data: [DONE]`), named
server-sent events (`event: <type>` before each frame: the Responses and Messages APIs), or DJL's jsonlines (a
line per chunk). All are made from the same chunks. A client that goes away cancels the stream's task; the
cancellation closes the generators down to the engine, which aborts the request."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from servelm.errors import ApiError, ServerError
from servelm.http.errors import error_json
from servelm.metrics import STREAM_CPU_SAMPLE, STREAM_CPU_SECONDS
from servelm.protocol.common import NamedEvent

log = logging.getLogger("servelm.http")


@dataclass(frozen=True)
class Framing:
    media_type: str
    frame: Callable[[bytes], bytes]  # one chunk's JSON → its bytes on the wire
    done: bytes = b""  # written after the last chunk
    named: bool = False  # each frame says its event's type (`event: <type>`)
    error_event: Callable[[ApiError, int], dict[str, Any]] | None = None  # an error's event (by its position)


def _sse(data: bytes) -> bytes:
    return b"data: " + data + b"\n\n"


SSE = Framing("text/event-stream", _sse, b"data: [DONE]\n\n")
JSONLINES = Framing("application/jsonlines", lambda data: data + b"\n")


def named_sse(error_event: Callable[[ApiError, int], dict[str, Any]]) -> Framing:
    return Framing("text/event-stream", _sse, named=True, error_event=error_event)


async def frames(chunks: AsyncIterator[BaseModel | bytes], framing: Framing) -> AsyncGenerator[bytes, None]:
    """The chunks (models, or JSON a service wrote itself) framed; an error once the answer has begun travels in the
    stream, in the error envelope (or the framing's own error event)."""
    sent = raw = 0  # chunks, and of them those that came as JSON already (the hot path: one in a sample is timed)
    cpu = STREAM_CPU_SECONDS
    try:
        async for chunk in chunks:
            if isinstance(chunk, bytes):
                raw += 1
                weight = STREAM_CPU_SAMPLE if raw % STREAM_CPU_SAMPLE == 0 else 0
            else:
                weight = 1
            start = time.thread_time() if weight else 0.0
            data = chunk if isinstance(chunk, bytes) else chunk.model_dump_json(exclude_unset=True).encode()
            if framing.named and isinstance(chunk, NamedEvent):
                data = f"event: {chunk.type}\n".encode() + b"data: " + data + b"\n\n"
            else:
                data = framing.frame(data)
            if weight:
                framed = time.thread_time()
                cpu["serialize"] += (framed - start) * weight
                yield data  # resumed once the server's send has written it
                cpu["write"] += (time.thread_time() - framed) * weight
            else:
                yield data
            sent += 1
    except Exception as exc:  # the response has started: the error can only travel in the stream
        if not isinstance(exc, ApiError):
            log.exception("stream failed")
            exc = ServerError(f"The server had an error while streaming: {exc}")
        if framing.error_event is not None:
            yield b"event: error\ndata: " + json.dumps(framing.error_event(exc, sent)).encode() + b"\n\n"
        else:
            yield framing.frame(error_json(exc))
    if framing.done:
        yield framing.done
