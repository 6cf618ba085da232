"""EmbeddingEngine: inputs of every request queue up together; a worker thread packs them into forward
passes (one sequence per input, up to a token budget and a sequence count) and hands each request its
vectors once the last of its inputs has been computed.

A pass takes one input from each caller in turn (an API key, or a client's address: the service says which), and a
caller's own requests in arrival order, so that a small request waits a pass or two, not behind every input of
another caller's large ones (eight 1,024-document reranks kept a 2-document one waiting 161 s).

The worker lives while there is work: it ends when the queue is empty, and the next input starts another. ggml
computes with OpenMP, whose runtime keeps a team of spinning workers for each thread that ever computed, for as
long as that thread lives; a second team on the cores makes every pass of the chat engine's wake its workers
(docs/performance.md: a lone decoding row took 15 ms instead of 10 once an embedding request had been answered).

Engine-neutral: any EmbeddingModel works (LlamaCppEmbedder, FakeEmbedder). Vectors come back as the
model pools them, not normalized; normalizing and truncating to `dimensions` is the service's job.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

log = logging.getLogger("servelm.embedding")


class EmbeddingModel(Protocol):
    dim: int  # width of one vector
    vocab_size: int
    context_window: int  # most tokens one input may have
    max_batch_tokens: int  # most tokens one forward pass may carry
    max_batch_seqs: int  # most inputs one forward pass may carry
    cross_encoder: bool  # rank pooling: an input is a query and a document, its row the classifier's scores

    def tokenize(self, text: str) -> list[int]:
        """Text → token ids, with the special tokens the model expects around one input."""
        ...

    def tokenize_pair(self, query: str, document: str) -> list[int]:
        """A query and a document as one cross-encoder input."""
        ...

    def embed(self, inputs: list[list[int]]) -> np.ndarray:
        """One forward pass; one pooled vector (a row, `dim` wide) per input, in order."""
        ...

    def close(self) -> None: ...


class EmbeddingError(RuntimeError):
    """The model could not compute a request's vectors for a reason of its own (not the client's)."""


@dataclass(frozen=True, slots=True)
class EmbeddingStats:
    running: int  # inputs in the forward pass now
    waiting: int  # inputs queued for a later pass
    passes: int  # forward passes since start
    inputs: int  # inputs embedded since start


@dataclass(eq=False)
class _Job:
    inputs: list[list[int]]
    vectors: np.ndarray
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[np.ndarray]
    left: int
    taken: int = 0  # its inputs handed to a pass so far (they are taken in order)
    done: bool = False  # answered, failed or abandoned: its queued inputs are skipped


@dataclass(eq=False)
class _Queue:
    # each caller's requests in arrival order; the callers in the order their turn comes (one input a turn)
    callers: OrderedDict[str, deque[_Job]] = field(default_factory=OrderedDict)
    waiting: int = 0  # inputs not yet handed to a pass
    cond: threading.Condition = field(default_factory=threading.Condition)

    def jobs(self) -> list[_Job]:
        return [job for jobs in self.callers.values() for job in jobs]


class EmbeddingEngine:
    def __init__(self, model: EmbeddingModel) -> None:
        self.model = model
        self.dim = model.dim
        self.vocab_size = model.vocab_size
        self.cross_encoder = model.cross_encoder
        self.context_window = min(model.context_window, model.max_batch_tokens)
        self._q = _Queue()
        self._thread: threading.Thread | None = None  # the worker, while there is work
        self._started = False
        self._stopping = False
        self._running = 0
        self.passes = 0
        self.embedded = 0

    # -- lifecycle --------------------------------------------------------------------------------
    def start(self) -> None:
        with self._q.cond:
            self._started, self._stopping = True, False
            if self._q.callers:
                self._wake_worker()

    def _wake_worker(self) -> None:
        """A worker for the queued inputs, unless one runs (called with the queue's lock held)."""
        if self._thread is None and self._started and not self._stopping:
            self._thread = threading.Thread(target=self._run, name="servelm-embedding", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        with self._q.cond:
            self._stopping = True
            self._started = False
            self._q.cond.notify_all()
            worker = self._thread
        if worker is not None:
            worker.join(timeout=30)
        self._thread = None
        with self._q.cond:
            jobs = self._q.jobs()
            self._q.callers.clear()
            self._q.waiting = 0
        for job in jobs:
            self._fail(job, EmbeddingError("the server is shutting down"))

    @property
    def alive(self) -> bool:
        """Started and not stopped (its worker never dies of a pass: a failed pass fails its requests)."""
        return self._started and not self._stopping

    def stats(self) -> EmbeddingStats:
        return EmbeddingStats(self._running, self._q.waiting, self.passes, self.embedded)

    # -- the asyncio side -------------------------------------------------------------------------
    def tokenize(self, text: str) -> list[int]:
        return self.model.tokenize(text)

    def tokenize_pair(self, query: str, document: str) -> list[int]:
        return self.model.tokenize_pair(query, document)

    async def embed(self, inputs: list[list[int]], caller: str = "") -> np.ndarray:
        """Every input's vector (rows in input order). Inputs must be non-empty, within the context window
        and the vocabulary: the service checks each with the client's words; this only guards. `caller`: whose
        request it is (passes take from each caller in turn)."""
        for ids in inputs:
            if not ids or len(ids) > self.context_window:
                raise ValueError(f"an input of {len(ids)} tokens does not fit a window of {self.context_window}")
        if not inputs:
            return np.empty((0, self.dim), dtype=np.float32)
        loop = asyncio.get_running_loop()
        job = _Job(inputs, np.empty((len(inputs), self.dim), dtype=np.float32), loop, loop.create_future(), len(inputs))
        with self._q.cond:
            if self._stopping:
                raise EmbeddingError("the server is shutting down")
            self._q.callers.setdefault(caller, deque()).append(job)
            self._q.waiting += len(inputs)
            self._wake_worker()
        try:
            return await job.future
        finally:
            job.done = True  # cancelled (the client left): its remaining inputs are dropped

    # -- the worker thread ------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            batch = self._take()
            if batch is None:
                return
            try:
                vectors = self.model.embed([job.inputs[i] for job, i in batch])
            except Exception as exc:  # a broken model must not kill the worker
                self._running = 0
                log.exception("embedding pass failed; failing its requests")
                for job in {job for job, _ in batch}:
                    self._fail(job, EmbeddingError(f"the embedding model failed: {exc}"))
            else:
                # counted before anyone is answered, so stats() seen by an answered caller are settled
                self._running = 0
                self.passes += 1
                self.embedded += len(batch)
                self._deliver(batch, vectors)

    def _take(self) -> list[tuple[_Job, int]] | None:
        """As many inputs as fit one pass, one from each caller in turn (None: none are left, or the engine stops;
        the worker ends, and the next input starts another)."""
        q, m = self._q, self.model
        with q.cond:
            batch: list[tuple[_Job, int]] = []
            tokens = 0
            while q.callers and len(batch) < m.max_batch_seqs and not self._stopping:
                caller, jobs = next(iter(q.callers.items()))
                job = jobs[0]
                if not job.done:
                    ids = job.inputs[job.taken]
                    if batch and tokens + len(ids) > m.max_batch_tokens:
                        break
                    batch.append((job, job.taken))
                    tokens += len(ids)
                    job.taken += 1
                    q.waiting -= 1
                else:  # abandoned: its inputs not yet taken are dropped
                    q.waiting -= len(job.inputs) - job.taken
                    job.taken = len(job.inputs)
                if job.taken == len(job.inputs):
                    jobs.popleft()
                if jobs:
                    q.callers.move_to_end(caller)  # its next input waits for the others' turns
                else:
                    del q.callers[caller]
            if not batch:
                if self._thread is threading.current_thread():
                    self._thread = None
                return None
            self._running = len(batch)
            return batch

    def _deliver(self, batch: list[tuple[_Job, int]], vectors: np.ndarray) -> None:
        for row, (job, i) in enumerate(batch):
            if job.done:
                continue
            job.vectors[i] = vectors[row]
            job.left -= 1
            if job.left == 0:
                job.done = True
                self._resolve(job, job.vectors)

    def _fail(self, job: _Job, exc: BaseException) -> None:
        if not job.done:
            job.done = True
            self._resolve(job, exc)

    @staticmethod
    def _resolve(job: _Job, outcome: np.ndarray | BaseException) -> None:
        def settle() -> None:
            if job.future.done():  # cancelled meanwhile
                return
            if isinstance(outcome, BaseException):
                job.future.set_exception(outcome)
            else:
                job.future.set_result(outcome)

        try:
            job.loop.call_soon_threadsafe(settle)
        except RuntimeError:  # its event loop is closed
            pass
