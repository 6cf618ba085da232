"""A stream's deadline and the shutdown's cutoff, armed once a stream (http/limits.py StepWatch): they end the
stream with their error whether they come while it awaits a step or while its chunk before is being written, they
never swallow a cancellation that is not theirs, and nothing of them outlives the stream."""

from __future__ import annotations

import asyncio
import time

import pytest

from servelm.engine.wrappers.admission import Admission
from servelm.errors import RequestTimeout, ServiceUnavailable
from servelm.http.limits import SCOPE_LIMITS, Drain, RequestLimits, streamed


class _Admission(Admission):
    def __init__(self) -> None:
        self.closed = 0

    def close(self) -> None:
        self.closed += 1


def _scope(timeout: float | None, drain: Drain | None = None) -> dict:
    deadline = None if timeout is None else time.monotonic() + timeout
    return {SCOPE_LIMITS: RequestLimits(max_waiting=1, timeout=timeout or 0, deadline=deadline, drain=drain)}


async def _chunks(delays: list[float], closed: list[bool]):
    try:
        for i, delay in enumerate(delays):
            await asyncio.sleep(delay)
            yield i
    finally:
        closed.append(True)


async def test_chunks_pass_through_and_nothing_is_left_armed():
    drain, closed, admission = Drain(), [], _Admission()
    got = [c async for c in streamed(_scope(5.0, drain), admission, _chunks([0, 0, 0], closed))]
    assert got == [0, 1, 2] and closed == [True] and admission.closed == 1
    assert not drain.watches and asyncio.current_task().cancelling() == 0


async def test_a_deadline_while_a_step_is_awaited_is_a_request_timeout():
    closed: list[bool] = []
    got = []
    with pytest.raises(RequestTimeout):
        async for c in streamed(_scope(0.2), _Admission(), _chunks([0, 5.0], closed)):
            got.append(c)
    assert got == [0] and closed == [True]
    assert asyncio.current_task().cancelling() == 0  # the task is not left cancelled: it goes on to write the error
    await asyncio.sleep(0)  # and is not cancelled at its next await


async def test_a_deadline_while_the_chunk_before_is_written_ends_the_stream_at_its_next_step():
    closed: list[bool] = []
    stream = streamed(_scope(0.1), _Admission(), _chunks([0, 0, 0], closed))
    assert await anext(stream) == 0
    await asyncio.sleep(0.3)  # the consumer writes: the deadline passes meanwhile, and cancels nothing
    assert asyncio.current_task().cancelling() == 0
    with pytest.raises(RequestTimeout):
        await anext(stream)
    assert closed == [True]  # the chunks were closed, not read on


async def test_a_cancellation_that_is_not_the_deadlines_stays_a_cancellation():
    closed: list[bool] = []

    async def consume():
        async for _ in streamed(_scope(0.2), _Admission(), _chunks([0, 5.0], closed)):
            pass

    task = asyncio.ensure_future(consume())
    await asyncio.sleep(0.2)
    task.cancel()  # the client went away, about when the deadline came
    with pytest.raises(asyncio.CancelledError):
        await task
    assert closed == [True]


async def test_the_shutdown_cutoff_ends_a_waiting_stream_and_a_writing_one():
    drain = Drain()
    waiting_closed: list[bool] = []
    writing_closed: list[bool] = []
    waiting = streamed(_scope(None, drain), _Admission(), _chunks([0, 5.0], waiting_closed))
    writing = streamed(_scope(None, drain), _Admission(), _chunks([0, 0], writing_closed))
    assert await anext(waiting) == 0 and await anext(writing) == 0
    step = asyncio.ensure_future(anext(waiting))
    await asyncio.sleep(0.05)
    assert len(drain.watches) == 2
    drain.cut_now()
    with pytest.raises(ServiceUnavailable) as raised:
        await step
    assert raised.value.code == "server_shutting_down"
    with pytest.raises(ServiceUnavailable):
        await anext(writing)
    assert waiting_closed == [True] and writing_closed == [True] and not drain.watches


async def test_a_stream_that_began_past_its_deadline_reads_nothing():
    closed: list[bool] = []
    scope = _scope(0.0)
    await asyncio.sleep(0.01)
    with pytest.raises(RequestTimeout):
        async for _ in streamed(scope, _Admission(), _chunks([0], closed)):
            raise AssertionError("a chunk came past the deadline")
