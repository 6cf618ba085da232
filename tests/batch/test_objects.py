"""The typed Batch and File objects: a store's rows as the server wrote them before the objects were typed load, and
are written back as the same JSON text; the API answers the same JSON."""

from __future__ import annotations

import json
import sqlite3

import pytest

from servelm.batch.objects import Batch, BatchErrors
from servelm.batch.store import BatchStore, FileRecord, LineResult
from servelm.http.batches import new_batch

# a batch row's body exactly as json.dumps wrote it before the objects were typed (the store survives restarts)
IN_PROGRESS = (
    '{"id": "batch_0123456789abcdef01234567", "object": "batch", "endpoint": "/v1/chat/completions", "model": null, '
    '"errors": null, "input_file_id": "file-00112233445566778899aabb", "completion_window": "24h", "status": '
    '"in_progress", "output_file_id": null, "error_file_id": null, "created_at": 1795700000, "in_progress_at": '
    '1795700001, "expires_at": 1795786400, "finalizing_at": null, "completed_at": null, "failed_at": null, '
    '"expired_at": null, "cancelling_at": null, "cancelled_at": null, "request_counts": {"total": 3, "completed": 1, '
    '"failed": 0}, "usage": {"input_tokens": 12, "input_tokens_details": {"cached_tokens": 4}, "output_tokens": 5, '
    '"output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 17}, "metadata": {"job": "nightly"}}'
)
FAILED = (
    '{"id": "batch_fedcba9876543210fedcba98", "object": "batch", "endpoint": "/v1/completions", "model": null, '
    '"errors": {"object": "list", "data": [{"code": "invalid_json_line", "message": "line 2 is not JSON: Expecting '
    'value.", "param": null, "line": 2}]}, "input_file_id": "file-ffeeddccbbaa998877665544", "completion_window": '
    '"1h", "status": "failed", "output_file_id": null, "error_file_id": null, "created_at": 1795700100, '
    '"in_progress_at": null, "expires_at": 1795703700, "finalizing_at": null, "completed_at": null, "failed_at": '
    '1795700102, "expired_at": null, "cancelling_at": null, "cancelled_at": null, "request_counts": {"total": 0, '
    '"completed": 0, "failed": 0}, "usage": {"input_tokens": 0, "input_tokens_details": {"cached_tokens": 0}, '
    '"output_tokens": 0, "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 0}, "metadata": null}'
)


def _store_with_rows(directory) -> BatchStore:
    """A state directory whose database holds the two rows, written as an earlier server wrote them."""
    BatchStore(directory).close()
    with sqlite3.connect(directory / "servelm.db") as db:
        for body in (IN_PROGRESS, FAILED):
            row = json.loads(body)
            db.execute("INSERT INTO batches VALUES (?, ?, ?, ?, ?)", (row["id"], "", row["created_at"], row["status"], body))
    db.close()
    return BatchStore(directory)


@pytest.mark.parametrize("body", [IN_PROGRESS, FAILED], ids=["in_progress", "failed"])
def test_a_stored_row_loads_and_is_written_back_as_the_same_json(tmp_path, body):
    store = _store_with_rows(tmp_path)
    batch = store.batch("", json.loads(body)["id"])
    assert batch is not None and batch.stored() == body
    assert batch.wire() == json.loads(body) and list(batch.wire()) == list(json.loads(body))
    assert json.loads(body) in [b.wire() for b in store.batches("")]
    store.close()


def test_a_stored_row_takes_its_next_line_and_update_as_before(tmp_path):
    store = _store_with_rows(tmp_path)
    batch_id = json.loads(IN_PROGRESS)["id"]
    assert store.record(batch_id, LineResult(2, False, '{"id": "x"}', input_tokens=3, cached_tokens=1, output_tokens=2))
    expected = json.loads(IN_PROGRESS)
    expected["request_counts"]["failed"] = 1
    expected["usage"].update(input_tokens=15, input_tokens_details={"cached_tokens": 5}, output_tokens=7, total_tokens=22)
    with sqlite3.connect(tmp_path / "servelm.db") as db:
        (stored,) = db.execute("SELECT body FROM batches WHERE id = ?", (batch_id,)).fetchone()
    db.close()
    assert stored == json.dumps(expected), "the row is the JSON text the untyped store wrote"
    updated = store.update(batch_id, ("in_progress",), status="cancelling", cancelling_at=1795700500)
    assert updated is not None and updated.wire() == {**expected, "status": "cancelling", "cancelling_at": 1795700500}
    assert store.update(batch_id, ("validating",), status="failed") is None, "only from the statuses named"
    store.close()


def test_a_new_batch_is_the_object_the_api_always_answered(tmp_path):
    batch = new_batch("/v1/completions", "file-1", "24h", 86400, {"k": "v"})
    wire = batch.wire()
    assert list(wire) == list(json.loads(IN_PROGRESS)) and wire["status"] == "validating"
    assert wire["request_counts"] == {"total": 0, "completed": 0, "failed": 0}
    assert wire["expires_at"] - wire["created_at"] == 86400 and wire["errors"] is None and wire["metadata"] == {"k": "v"}
    assert Batch.from_stored(batch.stored()) == batch


def test_a_field_a_batch_has_not_is_refused():
    batch = Batch.from_stored(FAILED)
    with pytest.raises(KeyError, match="no field failed_on"):
        batch.with_fields(failed_on=1)
    assert isinstance(batch.errors, BatchErrors) and batch.errors.data[0].line == 2


def test_a_file_object_is_openais_file():
    record = FileRecord("file-1", "owner", "in.jsonl", "batch", 10, 1795700000)
    assert json.dumps(record.file_object().wire()) == (
        '{"id": "file-1", "object": "file", "bytes": 10, "created_at": 1795700000, "filename": "in.jsonl", '
        '"purpose": "batch", "status": "processed"}')
    expiring = FileRecord("file-2", "owner", "out.jsonl", "batch_output", 5, 1795700000, 1795786400)
    assert list(expiring.file_object().wire())[-1] == "expires_at"
