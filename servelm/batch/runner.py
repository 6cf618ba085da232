"""BatchRunner: the server's batches, run on its own event loop beside live traffic.

Every unfinished batch is taken up (at start, what a restart left: its answered lines stay answered, the rest run).
Its lines go to their endpoint through a LineCaller (the server's own app, in process, as the batch's owner) at the
batch priority, with at most `in_flight` lines of all batches under way at once, so a batch fills the engine's
idle slots and the scheduler puts any interactive request first (and preempts a line for it). Each answer is
committed with the batch's counts as it comes (engine/store.py). A cancelled batch stops taking lines and its
lines under way are stopped; an expired one likewise, its unanswered lines going to the error file as
`batch_expired`. Then the output and error files are written and the batch ends."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any, Protocol

from servelm.batch.lines import BatchLine, MalformedFile, answered, parse_lines, request_body, unanswered
from servelm.batch.store import BatchStore, LineResult

log = logging.getLogger("servelm.batch")
POLL_S = 1.0  # how often the runner looks at the clock for expiry while nothing wakes it
RETRY_S = 1.0  # a line answered "not now" (429 queue full, 503 busy or shutting down) is sent again after this
NOT_NOW = frozenset({429, 503})


class LineCaller(Protocol):
    async def __call__(self, endpoint: str, body: dict[str, Any], owner: str) -> tuple[int, str, Any]:
        """POST `body` to `endpoint` as `owner`: (status, request id, the answer's JSON body)."""
        ...


async def answer(caller: LineCaller, line: BatchLine, endpoint: str, owner: str, priority: int) -> LineResult:
    """One line's answer as its output line (a streamed request is the line's own 400: a batch answers whole). A
    "not now" (429 queue full, 503 busy or shutting down) is no answer: the line goes again after RETRY_S (a
    shutdown cancels it there)."""
    if line.body.get("stream"):
        body = {"error": {"message": "stream is not supported in a batch: each line is answered whole.",
                          "type": "invalid_request_error", "param": "stream", "code": "invalid_value"}}
        return answered(line, 400, "", body)
    while True:
        status, request_id, body = await caller(endpoint, request_body(line, endpoint, priority), owner)
        if status not in NOT_NOW:
            return answered(line, status, request_id, body)
        await asyncio.sleep(RETRY_S)


class BatchRunner:
    def __init__(self, store: BatchStore, caller: LineCaller, *, priority: int, max_lines: int,
                 in_flight: Callable[[], int]) -> None:
        self.store = store
        self.caller = caller
        self.priority = priority
        self.max_lines = max_lines
        self._in_flight = in_flight  # asked once the engines are up
        self.width = 1  # lines under way at once, over every batch
        self._slots: asyncio.Semaphore | None = None
        self._wake = asyncio.Event()
        self._loop_task: asyncio.Task[None] | None = None
        self._batches: dict[str, asyncio.Task[None]] = {}
        self._stop: dict[str, asyncio.Event] = {}  # a batch's lines stop (cancelled, or past its window)

    def start(self) -> None:
        self.width = max(1, self._in_flight())
        self._slots = asyncio.Semaphore(self.width)
        self._loop_task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        """Stop every batch where it is (what was answered is committed; a restart goes on from there)."""
        tasks = [t for t in (self._loop_task, *self._batches.values()) if t is not None]
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t

    def wake(self) -> None:
        """A batch was created or cancelled."""
        self._wake.set()

    def cancel(self, batch_id: str) -> None:
        if batch_id in self._stop:
            self._stop[batch_id].set()
        self.wake()

    async def _loop(self) -> None:
        while True:
            self._wake.clear()
            for batch_id in await asyncio.to_thread(self.store.unfinished):
                if batch_id not in self._batches:
                    self._stop[batch_id] = asyncio.Event()
                    self._batches[batch_id] = asyncio.create_task(self._guarded(batch_id))
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), POLL_S)

    async def _guarded(self, batch_id: str) -> None:
        try:
            await self.run(batch_id)
        except asyncio.CancelledError:
            raise
        except Exception:  # the batch stays unfinished; the next start takes it up again
            log.exception("batch %s stopped", batch_id)
        finally:
            self._batches.pop(batch_id, None)
            self._stop.pop(batch_id, None)

    async def run(self, batch_id: str) -> None:
        store = self.store
        batch = await asyncio.to_thread(store.batch, None, batch_id)
        if batch is None:
            return
        owner = await asyncio.to_thread(store.owner_of, batch_id)
        lines = await self._lines(batch, owner)
        if lines is None:
            return
        stop = self._stop.setdefault(batch_id, asyncio.Event())
        if batch["status"] == "in_progress":
            done = await asyncio.to_thread(store.answered, batch_id)
            todo = iter([line for line in lines if line.number not in done])
            workers = [asyncio.create_task(self._work(batch, owner, todo)) for _ in range(self.width)]
            stopped = asyncio.create_task(self._until_stopped(batch, stop))
            busy: set[asyncio.Task[None]] = set(workers)
            while busy and not stopped.done():  # until every line is answered, or the batch stops
                _, left = await asyncio.wait({*busy, stopped}, return_when=asyncio.FIRST_COMPLETED)
                busy &= left
            for task in (*workers, stopped):
                task.cancel()
            for task in (*workers, stopped):
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        await self._finish(batch_id, lines)

    async def _lines(self, batch: dict[str, Any], owner: str) -> list[BatchLine] | None:
        """The batch's requests; a batch still validating is checked first (failed with its errors, or under
        way). None: it failed."""
        data = await asyncio.to_thread(self.store.content, owner, batch["input_file_id"])
        try:
            if data is None:
                raise MalformedFile([{"code": "file_not_found", "message": f"the input file "
                                      f"{batch['input_file_id']} is gone.", "param": "input_file_id", "line": None}])
            lines = parse_lines(data, batch["endpoint"], self.max_lines)
        except MalformedFile as exc:
            now = int(time.time())
            failed = await asyncio.to_thread(self.store.update, batch["id"], ("validating", "in_progress"),
                                             status="failed", failed_at=now,
                                             errors={"object": "list", "data": exc.errors})
            if failed is None:  # it was being cancelled: it ends so, with nothing answered
                await asyncio.to_thread(self.store.finish, batch["id"], "cancelled")
            return None
        if batch["status"] == "validating":
            updated = await asyncio.to_thread(
                self.store.update, batch["id"], ("validating",), status="in_progress", in_progress_at=int(time.time()),
                request_counts={"total": len(lines), "completed": 0, "failed": 0})
            batch.update(updated or await asyncio.to_thread(self.store.batch, None, batch["id"]) or {})
        return lines

    async def _work(self, batch: dict[str, Any], owner: str, todo: Iterator[BatchLine]) -> None:
        assert self._slots is not None
        for line in todo:
            async with self._slots:
                result = await answer(self.caller, line, batch["endpoint"], owner, self.priority)
            await asyncio.to_thread(self.store.record, batch["id"], result)

    async def _until_stopped(self, batch: dict[str, Any], stop: asyncio.Event) -> None:
        """Returns when the batch is cancelled or its window ends."""
        while not stop.is_set():
            left = batch["expires_at"] - time.time()
            if left <= 0:
                return
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), min(left, POLL_S * 5))
            current = await asyncio.to_thread(self.store.batch, None, batch["id"])
            if current is None or current["status"] == "cancelling":
                return

    async def _finish(self, batch_id: str, lines: list[BatchLine]) -> None:
        """End the batch: cancelled (it was being cancelled), expired (its window is over with lines unanswered:
        those go to the error file) or completed; its output and error files are written with the end."""
        store = self.store
        batch = await asyncio.to_thread(store.batch, None, batch_id)
        if batch is None or batch["status"] not in ("in_progress", "finalizing", "cancelling"):
            return
        done = await asyncio.to_thread(store.answered, batch_id)
        status = "cancelled" if batch["status"] == "cancelling" else "completed"
        if status == "completed" and len(done) < len(lines):
            if time.time() < batch["expires_at"]:
                return  # stopped early (a shutdown): taken up again
            status = "expired"
            for line in lines:
                if line.number not in done:
                    await asyncio.to_thread(store.record, batch_id, unanswered(
                        line, "batch_expired", "This request could not be executed before the completion window "
                        "expired."))
        if status == "completed" and batch["status"] == "in_progress":
            await asyncio.to_thread(store.update, batch_id, ("in_progress",), status="finalizing",
                                    finalizing_at=int(time.time()))
        await asyncio.to_thread(store.finish, batch_id, status)
        log.info("batch %s %s", batch_id, status)
