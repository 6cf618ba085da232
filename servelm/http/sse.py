"""Server-sent events: one `data:` frame per chunk, then `data: [DONE]`. A client that goes away cancels
the stream's task; the cancellation closes the generators down to the engine, which aborts the request."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator

from pydantic import BaseModel

from servelm.errors import ApiError

log = logging.getLogger("servelm.http")

DONE = b"data: [DONE]\n\n"


async def sse_frames(chunks: AsyncIterator[BaseModel]) -> AsyncIterator[bytes]:
    try:
        async for chunk in chunks:
            yield b"data: " + chunk.model_dump_json(exclude_unset=True).encode() + b"\n\n"
    except ApiError as exc:
        yield b"data: " + json.dumps(exc.body()).encode() + b"\n\n"
    except Exception as exc:  # the response has started: the error can only travel in the stream
        log.exception("stream failed")
        body = ApiError(f"The server had an error while streaming: {exc}").body()
        yield b"data: " + json.dumps(body).encode() + b"\n\n"
    yield DONE
