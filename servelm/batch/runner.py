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
from collections.abc import Callable, Container
from typing import Any, BinaryIO, Protocol

from servelm.batch.lines import BatchLine, MalformedFile, answered, batch_error, request_body, requests, unanswered, validate
from servelm.batch.objects import Batch, BatchError, BatchErrors, RequestCounts, Status
from servelm.batch.store import BatchStore, FileDamaged, LineResult, StoreDamaged

log = logging.getLogger("servelm.batch")
POLL_S = 1.0  # how often the runner looks at the clock for expiry while nothing wakes it
RETRY_S = 1.0  # a line answered "not now" (429 queue full, 503 busy or shutting down) is sent again after this
NOT_NOW = frozenset({429, 503})
VALIDATING = 2  # batch files checked at once (each on a thread of its own)
UNFINISHED_AT_WORK: tuple[Status, ...] = ("validating", "in_progress", "finalizing")


class LineCaller(Protocol):
    async def __call__(self, endpoint: str, body: dict[str, Any], owner: str) -> tuple[int, str, object]:
        """POST `body` to `endpoint` as `owner`: (status, request id, the answer's JSON body)."""
        ...


class Turn(Protocol):
    """A line's turn at its owner's rate limits: the line's call runs inside it; end() lets the owner's next line
    wait for its budget (once this line's tokens are charged, or it goes no further)."""

    def __enter__(self) -> None: ...
    def __exit__(self, *exc: object) -> None: ...
    def end(self) -> None: ...


class Pacer(Protocol):
    async def turn(self, owner: str) -> Turn:
        """Wait until `owner`'s rate limits let one more line go (http/ratelimit.py BatchPacer)."""
        ...


class _Free:
    """The turn of a line that nothing paces (a runner without a pacer: `servelm batch`, tests)."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None

    def end(self) -> None:
        return None


_FREE = _Free()


async def answer(caller: LineCaller, line: BatchLine, endpoint: str, owner: str, priority: int) -> LineResult:
    """One line's answer as its output line (a streamed request is the line's own 400: a batch answers whole). A
    "not now" (429 queue full, 503 busy or shutting down) is no answer: the line goes again after RETRY_S (a
    shutdown cancels it there). A caller that fails (no HTTP answer at all) is the line's own 500."""
    if line.body.get("stream"):
        return answered(line, 400, "", {"error": {
            "message": "stream is not supported in a batch: each line is answered whole.",
            "type": "invalid_request_error", "param": "stream", "code": "invalid_value"}})
    while True:
        try:
            status, request_id, body = await caller(endpoint, request_body(line, endpoint, priority), owner)
        except Exception as exc:
            log.exception("batch line %s (%s) got no answer", line.number, line.custom_id)
            return answered(line, 500, "", {"error": {
                "message": f"The server failed on this line ({type(exc).__name__}).", "type": "server_error",
                "param": None, "code": "internal_error"}})
        if status not in NOT_NOW:
            return answered(line, status, request_id, body)
        await asyncio.sleep(RETRY_S)


class LineSource:
    """A batch's requests, read from its input file a line at a time, off the event loop, for whichever line task
    asks next. The file is opened for each read, from where the last one ended: a waiting batch holds no file open
    and no line."""

    def __init__(self, open_file: Callable[[], BinaryIO], endpoint: str, max_bytes: int,
                 skip: Container[int] = ()) -> None:
        self._open = open_file
        self._endpoint, self._max_bytes, self._skip = endpoint, max_bytes, skip
        self._offset = self._number = 0  # where the next read begins, and the number of the line before it
        self._lock = asyncio.Lock()

    def read(self) -> BatchLine | LineResult | None:
        """The next request (or the error line of a line that is none); None at the end of the file."""
        with self._open() as f:
            f.seek(self._offset)
            for number, item in requests(f, self._endpoint, self._max_bytes, self._skip, self._number + 1):
                self._offset, self._number = f.tell(), number
                return item
        return None

    async def next(self) -> BatchLine | LineResult | None:
        async with self._lock:
            return await asyncio.to_thread(self.read)


class BatchRunner:
    def __init__(self, store: BatchStore, caller: LineCaller, *, priority: int, max_lines: int,
                 in_flight: Callable[[], int], max_line_bytes: int = 8 << 20) -> None:
        self.store = store
        self.caller = caller
        self.priority = priority
        self.max_lines = max_lines
        self.max_line_bytes = max_line_bytes  # a longer line fails its batch (--max-body-bytes)
        self._in_flight = in_flight  # asked once the engines are up
        self.pacer: Pacer | None = None  # each owner's rate limits (set by http/app.py once they exist)
        self.width = 1  # lines under way at once, over every batch
        self._slots: asyncio.Semaphore | None = None
        self._validating = asyncio.Semaphore(VALIDATING)
        self._wake = asyncio.Event()
        self._loop_task: asyncio.Task[None] | None = None
        self._batches: dict[str, asyncio.Task[None]] = {}
        self._stop: dict[str, asyncio.Event] = {}  # a batch's lines stop (cancelled, or past its window)
        self._stuck: set[str] = set()  # batches whose failure could not be recorded: left alone until a restart

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
            try:
                unfinished = await asyncio.to_thread(self.store.unfinished)
            except StoreDamaged:  # (logged by the store, told by /health): nothing runs until it is repaired
                unfinished = []
            for batch_id in unfinished:
                if batch_id not in self._batches and batch_id not in self._stuck:
                    self._stop[batch_id] = asyncio.Event()
                    self._batches[batch_id] = asyncio.create_task(self._guarded(batch_id))
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), POLL_S)

    async def _guarded(self, batch_id: str) -> None:
        """Run a batch to its end, whatever happens: a malformed or damaged input file fails it with its errors;
        any other error fails it too, logged once, with what it answered kept in its files."""
        try:
            await self.run(batch_id)
        except asyncio.CancelledError:
            raise
        except MalformedFile as exc:
            await self._fail(batch_id, exc.errors)
        except Exception as exc:
            log.exception("batch %s stopped on an error: it ends failed", batch_id)
            await self._fail(batch_id, [batch_error("server_error", f"The batch stopped on an error of the server "
                                                    f"({type(exc).__name__}); the lines it answered are in its "
                                                    "output and error files.")])
        finally:
            self._batches.pop(batch_id, None)
            self._stop.pop(batch_id, None)

    async def _fail(self, batch_id: str, errors: list[BatchError]) -> None:
        try:
            await asyncio.to_thread(self._end_failed, batch_id, errors)
        except Exception:
            log.exception("batch %s: its failure could not be recorded; it is left as it is until the next start",
                          batch_id)
            self._stuck.add(batch_id)

    def _end_failed(self, batch_id: str, errors: list[BatchError]) -> None:
        """End a batch failed with these errors (cancelled, if it was being cancelled), its answered lines in its
        output and error files. It is failed (its status, errors and failed_at, at once: no line is recorded after)
        before those files are written."""
        store = self.store
        if store.update(batch_id, UNFINISHED_AT_WORK, status="failed", errors=BatchErrors(data=errors),
                        failed_at=int(time.time())):
            store.finish(batch_id, "failed")
        elif (batch := store.batch(None, batch_id)) is not None and batch.status == "cancelling":
            store.finish(batch_id, "cancelled")

    def _opener(self, owner: str, file_id: str) -> Callable[[], BinaryIO]:
        """How a batch opens its input file, once for each line it reads: its row looked up the first time, then the
        file checked against the size recorded there at each open; MalformedFile when it is gone or damaged."""
        size: list[int] = []

        def open_input() -> BinaryIO:
            if not size:
                record = self.store.file(owner, file_id)
                if record is None:
                    raise MalformedFile([batch_error("file_not_found", f"the input file {file_id} is gone.",
                                                     param="input_file_id")])
                size.append(record.bytes)
            try:
                return self.store.open_stored(file_id, size[0])
            except FileDamaged as exc:
                raise MalformedFile([batch_error("file_damaged", f"The input file {file_id} is damaged on the "
                                                 f"server ({exc.found or 0} of its {exc.recorded} bytes are there).",
                                                 param="input_file_id")]) from None
        return open_input

    async def run(self, batch_id: str) -> None:
        store = self.store
        batch = await asyncio.to_thread(store.batch, None, batch_id)
        if batch is None:
            return
        owner = await asyncio.to_thread(store.owner_of, batch_id)
        open_input = self._opener(owner, batch.input_file_id)
        if batch.status == "validating":
            batch = await self._validate(batch, open_input)
        stop = self._stop.setdefault(batch_id, asyncio.Event())
        if batch.status == "in_progress":
            done = await asyncio.to_thread(store.answered, batch_id)
            source = LineSource(open_input, batch.endpoint, self.max_line_bytes, done)
            feeding = asyncio.create_task(self._feed(batch, owner, source))
            stopped = asyncio.create_task(self._until_stopped(batch, stop))
            await asyncio.wait({feeding, stopped}, return_when=asyncio.FIRST_COMPLETED)
            for task in (feeding, stopped):
                task.cancel()
            for task in (feeding, stopped):
                with contextlib.suppress(asyncio.CancelledError):
                    await task  # (an error of either is the batch's)
        await self._finish(batch_id, open_input)

    async def _validate(self, batch: Batch, open_input: Callable[[], BinaryIO]) -> Batch:
        """A batch still validating, its file checked a line at a time on a thread (VALIDATING files at once), then
        under way (MalformedFile: it is not a batch)."""
        def check() -> int:
            with open_input() as f:
                return validate(f, batch.endpoint, self.max_lines, self.max_line_bytes)

        async with self._validating:
            total = await asyncio.to_thread(check)
        updated = await asyncio.to_thread(
            self.store.update, batch.id, ("validating",), status="in_progress", in_progress_at=int(time.time()),
            request_counts=RequestCounts(total=total))
        return updated or await asyncio.to_thread(self.store.batch, None, batch.id) or batch

    async def _feed(self, batch: Batch, owner: str, source: LineSource) -> None:
        """Every line of the batch, each read once a slot is free (so the lines held are those under way), and
        answered and recorded by a task of its own that frees the slot as it ends."""
        assert self._slots is not None
        slots = self._slots
        under_way: set[asyncio.Task[None]] = set()
        try:
            while True:
                turn = await self.pacer.turn(owner) if self.pacer else _FREE  # its key's rate limits, before a
                item: BatchLine | LineResult | None = None  # place: a batch waiting for its key's budget holds none
                try:
                    await slots.acquire()
                    try:
                        item = await source.next()
                    finally:
                        if item is None:
                            slots.release()
                finally:
                    if item is None:
                        turn.end()
                if item is None:
                    break
                task = asyncio.create_task(self._line(batch, owner, item, turn))
                under_way.add(task)
                task.add_done_callback(under_way.discard)
                task.add_done_callback(lambda _: slots.release())
            if under_way:
                await asyncio.wait(under_way)
        finally:
            for task in under_way:
                task.cancel()

    async def _line(self, batch: Batch, owner: str, item: BatchLine | LineResult, turn: Turn) -> None:
        with turn:  # (ended once the line's tokens are charged, at the latest when it is answered)
            result = item if isinstance(item, LineResult) else await answer(self.caller, item, batch.endpoint,
                                                                            owner, self.priority)
        await asyncio.to_thread(self.store.record, batch.id, result)

    async def _until_stopped(self, batch: Batch, stop: asyncio.Event) -> None:
        """Returns when the batch is cancelled or its window ends."""
        while not stop.is_set():
            left = batch.expires_at - time.time()
            if left <= 0:
                return
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), min(left, POLL_S * 5))
            current = await asyncio.to_thread(self.store.batch, None, batch.id)
            if current is None or current.status == "cancelling":
                return

    async def _finish(self, batch_id: str, open_input: Callable[[], BinaryIO]) -> None:
        """End the batch: cancelled (it was being cancelled), expired (its window is over with lines unanswered:
        those go to the error file) or completed; its output and error files are written with the end."""
        store = self.store
        batch = await asyncio.to_thread(store.batch, None, batch_id)
        if batch is None or batch.status not in ("in_progress", "finalizing", "cancelling"):
            return
        counts = batch.request_counts
        status: Status = "cancelled" if batch.status == "cancelling" else "completed"
        if status == "completed" and counts.completed + counts.failed < counts.total:
            if time.time() < batch.expires_at:
                return  # stopped early (a shutdown): taken up again
            status = "expired"
            await asyncio.to_thread(self._expire_rest, batch, open_input)
        if status == "completed" and batch.status == "in_progress":
            await asyncio.to_thread(store.update, batch_id, ("in_progress",), status="finalizing",
                                    finalizing_at=int(time.time()))
        await asyncio.to_thread(store.finish, batch_id, status)
        log.info("batch %s %s", batch_id, status)

    def _expire_rest(self, batch: Batch, open_input: Callable[[], BinaryIO]) -> None:
        """Each line not answered goes to the error file as `batch_expired`."""
        source = LineSource(open_input, batch.endpoint, self.max_line_bytes, self.store.answered(batch.id))
        while (item := source.read()) is not None:
            self.store.record(batch.id, item if isinstance(item, LineResult) else unanswered(
                item, "batch_expired", "This request could not be executed before the completion window expired."))
