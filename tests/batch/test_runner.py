"""BatchRunner over a real store and a scripted caller: a "not now" answer (429, 503) is no answer."""

from __future__ import annotations

import asyncio
import json

from servelm.batch import runner as runner_module
from servelm.batch.objects import Batch
from servelm.batch.runner import BatchRunner
from servelm.batch.store import BatchStore
from servelm.http.batches import new_batch


def stored_batch(directory, lines: int) -> tuple[BatchStore, Batch]:
    """A store holding one batch of `lines` completions, not yet validated."""
    store = BatchStore(directory)
    data = b"".join(json.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions",
                                "body": {"model": "m", "prompt": "x"}}).encode() + b"\n" for i in range(lines))
    f = store.add_file("", "in.jsonl", "batch", data)
    batch = new_batch("/v1/completions", f.id, "24h", 86400, None)
    store.add_batch("", batch)
    return store, batch


async def test_a_line_answered_not_now_is_sent_again_not_recorded_as_failed(tmp_path, monkeypatch):
    monkeypatch.setattr(runner_module, "RETRY_S", 0.01)
    store, batch = stored_batch(tmp_path, 3)
    calls: list[str] = []

    async def caller(endpoint, body, owner):
        calls.append(endpoint)
        if len(calls) <= 2:  # the server was shutting down, then its queue was full
            return (503 if len(calls) == 1 else 429), "", {"error": {"message": "not now"}}
        return 200, "rid", {"object": "text_completion", "usage": {"prompt_tokens": 2, "completion_tokens": 1}}

    runner = BatchRunner(store, caller, priority=10, max_lines=10, in_flight=lambda: 1)
    runner.start()
    for _ in range(500):
        if store.batch("", batch.id).status == "completed":
            break
        await asyncio.sleep(0.02)
    await runner.stop()
    done = store.batch("", batch.id)
    assert done.status == "completed"
    assert done.wire()["request_counts"] == {"total": 3, "completed": 3, "failed": 0}
    assert len(calls) == 5 and done.error_file_id is None
    store.close()


async def test_a_batch_waits_for_its_last_lines_without_spinning(tmp_path, monkeypatch):
    """Once one worker has no line left, the others' last lines are awaited, not polled: a loop that kept
    asking about the finished worker took a core from the engine at every batch's end."""
    store, batch = stored_batch(tmp_path, 2)

    async def caller(endpoint, body, owner):
        await asyncio.sleep(0.5 if len(waits) else 0)  # one line is quick, the other slow
        return 200, "rid", {"object": "text_completion"}

    waits: list[int] = []
    real_wait = asyncio.wait

    async def counted(*args, **kwargs):
        waits.append(1)
        return await real_wait(*args, **kwargs)

    monkeypatch.setattr(runner_module.asyncio, "wait", counted)
    runner = BatchRunner(store, caller, priority=10, max_lines=10, in_flight=lambda: 2)
    runner.width = 2
    runner._slots = asyncio.Semaphore(2)
    await runner.run(batch.id)
    assert store.batch("", batch.id).status == "completed"
    assert len(waits) <= 4, f"{len(waits)} waits for two lines"
    store.close()
