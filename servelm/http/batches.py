"""OpenAI's Files and Batches API (servelm/batch/ keeps the state and runs the lines), and the in-process caller
through which a batch's lines reach this same app as their owner: every route, check, error and metric is the one a
client's request gets, without the HTTP round trip. A line's call carries its owner in the scope
(BATCH_OWNER, which no client can set): auth trusts it as that key, and its tokens are charged to that key's
tokens per minute. The runner waits for the key's budget before it sends a line (http/ratelimit.py BatchPacer), so
a key's rate limits pace its batch rather than refuse it; the request deadline does not apply (a batch is bounded
by its completion window)."""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import MethodType
from typing import Any, BinaryIO, Protocol

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse

from servelm.batch.lines import ENDPOINTS, MAX_WINDOW_S, count_requests, shown, window_seconds
from servelm.batch.objects import Batch
from servelm.batch.runner import BatchRunner
from servelm.batch.store import CHUNK, BatchStore, FileDamaged, FileRecord, StoreFull, new_id
from servelm.errors import ClientError, InvalidParameter, NotFound, PayloadTooLarge, ServerError
from servelm.http.asgi import ASGIApp, Message
from servelm.http.auth import BATCH_OWNER
from servelm.http.routes import Route, request_context, router_of
from servelm.service.registry.deployments import Deployments


@dataclass(frozen=True)
class BatchConfig:
    """The Batch API's settings (ServerSettings' state_dir and batch_*)."""

    state_dir: str
    max_file_bytes: int = 200 << 20
    max_lines: int = 50_000
    max_disk_bytes: int = 10 << 30
    priority: int = 10
    max_in_flight: int = 0  # 0: every sequence slot of the generating deployments
    max_line_bytes: int = 8 << 20  # a batch file's longest line (--max-body-bytes): a longer one fails its batch

    @classmethod
    def from_settings(cls, settings: Any) -> BatchConfig | None:
        if not settings.state_dir:
            return None
        return cls(str(settings.state_dir), settings.batch_max_file_mib << 20, settings.batch_max_lines,
                   settings.batch_disk_mib << 20, settings.batch_priority, settings.batch_max_in_flight,
                   settings.max_body_bytes)

    def open(self) -> BatchStore:
        """The state directory's store, checked (StoreDamaged, or an OSError naming what is wrong)."""
        return BatchStore(Path(self.state_dir), self.max_disk_bytes)


class AppCaller:
    """A batch line's request, sent to the ASGI app in this process as its owner; the answer's status, request id
    and JSON body."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, endpoint: str, body: dict[str, Any], owner: str) -> tuple[int, str, Any]:
        data = json.dumps(body).encode()
        scope = {
            "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
            "path": endpoint, "raw_path": endpoint.encode(), "query_string": b"", "root_path": "",
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode()),
                        (b"host", b"batch")],
            "client": ("batch", 0), "server": ("batch", 0), "state": {}, BATCH_OWNER: owner,
        }
        sent, answered = False, asyncio.Event()
        status, headers, chunks = 500, {}, []

        async def receive() -> Message:
            nonlocal sent
            if sent:  # the caller stays until the answer is whole (a disconnect would stop the request)
                await answered.wait()
                return {"type": "http.disconnect"}
            sent = True
            return {"type": "http.request", "body": data, "more_body": False}

        async def send(message: Message) -> None:
            nonlocal status, headers
            if message["type"] == "http.response.start":
                status = message["status"]
                headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in message.get("headers", [])}
            elif message["type"] == "http.response.body":
                chunks.append(message.get("body", b""))
                if not message.get("more_body"):
                    answered.set()

        try:
            await self.app(scope, receive, send)
        finally:
            answered.set()
        raw = b"".join(chunks)
        try:
            answer = json.loads(raw) if raw else None
        except ValueError:
            answer = raw.decode("utf-8", "replace")
        return status, headers.get("x-request-id", ""), answer


def _file_or_404(store: BatchStore, owner: str, file_id: str) -> FileRecord:
    record = store.file(owner, file_id)
    if record is None:
        raise NotFound(f"No such File object: {file_id}", param="file_id", code="not_found")
    return record


def _batch_or_404(store: BatchStore, owner: str, batch_id: str) -> Batch:
    batch = store.batch(owner, batch_id)
    if batch is None:
        raise NotFound(f"No batch found with id '{batch_id}'.", param="batch_id", code="not_found")
    return batch


class Listed(Protocol):
    """An object of a list page: a Batch or a File object."""

    @property
    def id(self) -> str: ...
    def wire(self) -> dict[str, Any]: ...


def _page(items: Sequence[Listed], after: str | None, limit: int) -> dict[str, Any]:
    """A list page in OpenAI's shape: the items after the one named `after` (newest first), at most `limit`."""
    if not 1 <= limit <= 10_000:
        raise InvalidParameter(f"limit must be between 1 and 10000; got {limit}.", "limit")
    if after is not None:
        ids = [i.id for i in items]
        items = items[ids.index(after) + 1:] if after in ids else []
    page = items[:limit]
    return {"object": "list", "data": [i.wire() for i in page], "first_id": page[0].id if page else None,
            "last_id": page[-1].id if page else None, "has_more": len(items) > limit}


def new_batch(endpoint: str, input_file_id: str, window: str, seconds: int, metadata: dict[str, str] | None) -> Batch:
    now = int(time.time())
    return Batch(id=new_id("batch_"), endpoint=endpoint, input_file_id=input_file_id, completion_window=window,
                 status="validating", created_at=now, expires_at=now + seconds, metadata=metadata)


_BATCH_FIELDS = frozenset({"input_file_id", "endpoint", "completion_window", "metadata", "output_expires_after"})


def _batch_request(body: object) -> tuple[str, str, int, str, dict[str, str] | None]:
    """A create-batch body checked: its endpoint, completion window (and its seconds), input file id and metadata."""
    if not isinstance(body, dict):
        raise ClientError("The body must be a JSON object.", code="invalid_value")
    unknown = set(body) - _BATCH_FIELDS
    if unknown:
        raise InvalidParameter(f"Unrecognized request argument supplied: {', '.join(sorted(unknown))}",
                               sorted(unknown)[0], "unknown_parameter")
    endpoint, window, file_id = body.get("endpoint"), body.get("completion_window"), body.get("input_file_id")
    if endpoint not in ENDPOINTS:
        raise InvalidParameter(f"endpoint must be one of {', '.join(ENDPOINTS)}; got {shown(endpoint)}.", "endpoint")
    seconds = window_seconds(window) if isinstance(window, str) else None
    if seconds is None or not isinstance(window, str):
        raise InvalidParameter(f"completion_window must be '24h' (or any '<n>s', '<n>m', '<n>h', '<n>d', <n> in "
                               f"ASCII digits, up to {MAX_WINDOW_S // 86400} days); got {shown(window)}.",
                               "completion_window")
    metadata = body.get("metadata")
    if metadata is not None and (not isinstance(metadata, dict) or len(metadata) > 16 or any(
            not isinstance(v, str) or len(k) > 64 or len(v) > 512 for k, v in metadata.items())):
        raise InvalidParameter("metadata is at most 16 string pairs (keys up to 64 characters, values up to "
                               "512).", "metadata")
    if not isinstance(file_id, str):
        raise InvalidParameter("input_file_id must be a file id.", "input_file_id")
    return endpoint, window, seconds, file_id, metadata


def _store_upload(store: BatchStore, owner: str, filename: str, f: BinaryIO, size: int, max_lines: int) -> FileRecord:
    """An upload spooled to disk, its requests counted (up to one past the bound), then copied to the store a chunk at
    a time (on a thread: never on the event loop, never whole in memory)."""
    f.seek(0)
    if count_requests(f, max_lines) > max_lines:
        raise InvalidParameter(f"a batch file may hold at most {max_lines} requests (--batch-max-lines); this one "
                               "holds more.", "file")
    f.seek(0)
    return store.add_file_from(owner, filename, "batch", iter(lambda: f.read(CHUNK), b""), size)


async def _chunks(f: BinaryIO) -> AsyncIterator[bytes]:
    """A stored file's bytes, a chunk at a time, each read on a thread."""
    try:
        while chunk := await asyncio.to_thread(f.read, CHUNK):
            yield chunk
    finally:
        f.close()


def _open_or_404(store: BatchStore, owner: str, file_id: str) -> tuple[BinaryIO, int]:
    """A stored file open for reading, and its size (a 404 if it is not the owner's; a 500 saying so if its bytes on disk are not
    the ones written: the log says what was found)."""
    try:
        f = store.open_file(owner, file_id)
    except FileDamaged as exc:
        raise ServerError(f"File {file_id} is damaged on the server: {exc.found or 0} of its {exc.recorded} bytes are "
                          "there. It cannot be served; the server's log names it.", code="file_damaged") from None
    if f is None:
        raise NotFound(f"No such File object: {file_id}", param="file_id", code="not_found")
    return f, os.fstat(f.fileno()).st_size


def batch_runner(app: ASGIApp, deployments: Deployments, config: BatchConfig,
                 store: BatchStore | None = None) -> BatchRunner:
    """The runner of the batches under config.state_dir (`store`, when it was opened already), its lines sent to
    `app` in process."""
    def in_flight() -> int:
        return config.max_in_flight or sum(d.engine.stats().total_slots for d in deployments.generators())

    store = store or config.open()
    return BatchRunner(store, AppCaller(app), priority=config.priority, max_lines=config.max_lines,
                       in_flight=in_flight, max_line_bytes=config.max_line_bytes)


async def needs_state_dir() -> None:
    raise NotFound("The Files and Batches API needs a state directory: start the server with --state-dir DIR "
                   "(its batches survive a restart there).", code="not_found")


_PATHS = ("/files", "/files/{file_id}", "/files/{file_id}/content", "/batches", "/batches/{batch_id}",
          "/batches/{batch_id}/cancel")
# without --state-dir the Files and Batches API's paths say what it needs (nothing would survive a restart)
NO_BATCH_ROUTES = tuple(Route(("GET", "POST", "DELETE"), prefix + path, needs_state_dir, schema=False)
                        for prefix in ("/v1", "") for path in _PATHS)


def build_no_batch_router() -> APIRouter:
    return router_of(NO_BATCH_ROUTES)


def _owner(request: Request) -> str:
    return request_context(request.scope).owner


class BatchRoutes:
    """The Files and Batches API's handlers over one store and runner (methods, bound by build_batch_router). The
    store's reads and writes wait on its lock and on the disk: the handlers that only read or write it are plain
    functions (FastAPI runs them on its thread pool), the others hand it to a thread, never the event loop."""

    def __init__(self, store: BatchStore, runner: BatchRunner, config: BatchConfig) -> None:
        self.store, self.runner, self.config = store, runner, config

    async def upload(self, request: Request) -> JSONResponse:
        store, config = self.store, self.config
        content_type = request.headers.get("content-type", "")
        if not content_type.lower().startswith("multipart/form-data"):
            raise ClientError("A file is uploaded as multipart/form-data with the fields file and purpose.",
                              param="file", code="invalid_value")
        async with request.form(max_files=1, max_fields=8, max_part_size=config.max_file_bytes) as form:
            purpose, upload = form.get("purpose"), form.get("file")
            if purpose != "batch":
                raise InvalidParameter(f"purpose must be 'batch' here (the Batch API's files); got {shown(purpose)}.",
                                       "purpose")
            if upload is None or isinstance(upload, str):
                raise InvalidParameter("file must be an uploaded file (multipart/form-data).", "file")
            if upload.size is None or upload.size > config.max_file_bytes:
                raise PayloadTooLarge(config.max_file_bytes)
            try:  # (the form's files are closed as it ends)
                record = await asyncio.to_thread(_store_upload, store, _owner(request), upload.filename or "upload.jsonl",
                                                 upload.file, upload.size, config.max_lines)
            except StoreFull:
                raise ClientError(f"The server's files would take more than {config.max_disk_bytes >> 20} MiB "
                                  "(--batch-disk-mib): delete files you no longer need.", param="file",
                                  code="storage_limit_exceeded") from None
        return JSONResponse(record.file_object().wire())

    def list_files(self, request: Request, purpose: str | None = None, limit: int = 10_000, after: str | None = None,
                   order: str = "desc") -> JSONResponse:
        if order not in ("asc", "desc"):
            raise InvalidParameter(f"order must be asc or desc; got {shown(order)}.", "order")
        files = [f.file_object() for f in self.store.files(_owner(request), purpose)]
        return JSONResponse(_page(files if order == "desc" else files[::-1], after, limit))

    def get_file(self, request: Request, file_id: str) -> JSONResponse:
        return JSONResponse(_file_or_404(self.store, _owner(request), file_id).file_object().wire())

    async def file_content(self, request: Request, file_id: str) -> Response:
        f, size = await asyncio.to_thread(_open_or_404, self.store, _owner(request), file_id)
        return StreamingResponse(_chunks(f), media_type="application/octet-stream",
                                 headers={"content-length": str(size)})

    def delete_file(self, request: Request, file_id: str) -> JSONResponse:
        store = self.store
        _file_or_404(store, _owner(request), file_id)
        if store.in_use(file_id):
            raise ClientError(f"File {file_id} is the input of a batch still running; cancel it first.",
                              param="file_id", code="file_in_use")
        store.delete_file(_owner(request), file_id)
        return JSONResponse({"id": file_id, "object": "file", "deleted": True})

    async def create_batch(self, request: Request) -> JSONResponse:
        try:
            body = await request.json()
        except ValueError:
            raise ClientError("The body is not valid JSON.", code="invalid_json") from None
        endpoint, window, seconds, file_id, metadata = _batch_request(body)
        record = await asyncio.to_thread(self.store.file, _owner(request), file_id)
        if record is None:
            raise NotFound(f"No such File object: {file_id}", param="input_file_id", code="not_found")
        if record.purpose != "batch":
            raise InvalidParameter(f"File {file_id} has purpose {record.purpose!r}; a batch reads one uploaded with "
                                   "purpose 'batch'.", "input_file_id")
        batch = new_batch(endpoint, file_id, window, seconds, metadata)
        await asyncio.to_thread(self.store.add_batch, _owner(request), batch)
        self.runner.wake()
        return JSONResponse(batch.wire())

    def list_batches(self, request: Request, limit: int = 20, after: str | None = None) -> JSONResponse:
        return JSONResponse(_page(self.store.batches(_owner(request)), after, limit))

    def get_batch(self, request: Request, batch_id: str) -> JSONResponse:
        return JSONResponse(_batch_or_404(self.store, _owner(request), batch_id).wire())

    async def cancel_batch(self, request: Request, batch_id: str) -> JSONResponse:
        store = self.store
        batch = await asyncio.to_thread(_batch_or_404, store, _owner(request), batch_id)
        updated = await asyncio.to_thread(store.update, batch_id, ("validating", "in_progress"), status="cancelling",
                                          cancelling_at=int(time.time()))
        if updated is None and batch.status not in ("cancelling", "cancelled"):
            raise ClientError(f"Cannot cancel a batch with status '{batch.status}'.", param="batch_id",
                              code="invalid_state")
        self.runner.cancel(batch_id)  # (on the event loop: it sets the runner's asyncio events)
        if updated is None:
            updated = await asyncio.to_thread(_batch_or_404, store, _owner(request), batch_id)
        return JSONResponse(updated.wire())


# (method, path under /v1 and under the root, BatchRoutes' handler)
BATCH_ROUTES = (
    ("POST", "/files", BatchRoutes.upload),
    ("GET", "/files", BatchRoutes.list_files),
    ("GET", "/files/{file_id}", BatchRoutes.get_file),
    ("GET", "/files/{file_id}/content", BatchRoutes.file_content),
    ("DELETE", "/files/{file_id}", BatchRoutes.delete_file),
    ("POST", "/batches", BatchRoutes.create_batch),
    ("GET", "/batches", BatchRoutes.list_batches),
    ("GET", "/batches/{batch_id}", BatchRoutes.get_batch),
    ("POST", "/batches/{batch_id}/cancel", BatchRoutes.cancel_batch),
)


def build_batch_router(store: BatchStore, runner: BatchRunner, config: BatchConfig) -> APIRouter:
    routes = BatchRoutes(store, runner, config)
    return router_of(Route(method, prefix + path, MethodType(handler, routes))
                     for prefix in ("/v1", "") for method, path, handler in BATCH_ROUTES)
