"""A streamed answer's framing: server-sent events (a `data:` frame per chunk, then `data: [DONE]`), or DJL's
jsonlines (a line per chunk). Both are made from the same chunks. A client that goes away cancels the stream's
task; the cancellation closes the generators down to the engine, which aborts the request."""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass

from pydantic import BaseModel

from servelm.errors import ApiError, ServerError
from servelm.http.errors import error_json

log = logging.getLogger("servelm.http")


@dataclass(frozen=True)
class Framing:
    media_type: str
    frame: Callable[[bytes], bytes]  # one chunk's JSON → its bytes on the wire
    done: bytes = b""  # written after the last chunk


SSE = Framing("text/event-stream", lambda data: b"data: " + data + b"\n\n", b"data: [DONE]\n\n")
JSONLINES = Framing("application/jsonlines", lambda data: data + b"\n")


async def frames(chunks: AsyncIterator[BaseModel], framing: Framing) -> AsyncGenerator[bytes, None]:
    """The chunks framed; an error once the answer has begun travels in the stream, in the error envelope."""
    try:
        async for chunk in chunks:
            yield framing.frame(chunk.model_dump_json(exclude_unset=True).encode())
    except ApiError as exc:
        yield framing.frame(error_json(exc))
    except Exception as exc:  # the response has started: the error can only travel in the stream
        log.exception("stream failed")
        yield framing.frame(error_json(ServerError(f"The server had an error while streaming: {exc}")))
    if framing.done:
        yield framing.done
