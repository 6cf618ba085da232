"""Attacks on the stored responses and conversations kept in the --state-dir database: two requests answering one
approval at once, a full conversation that a response would overflow, out-of-range bounds, a foreign table where
ours go, and damage met while serving."""

from __future__ import annotations

import sqlite3
import threading
from pathlib import Path

import httpx
import pytest
from pydantic import ValidationError

from servelm.batch.store import BatchStore, StoreDamaged
from servelm.config import ServerSettings
from servelm.http.batches import BatchConfig
from servelm.service.durable import SqlConversations, SqlResponses
from servelm.service.store import StoredResponse


def test_two_answers_to_one_approval_at_once_claim_it_once(tmp_path):
    db = BatchStore(tmp_path)
    store = SqlResponses(db)
    won: list[bool] = []
    start = threading.Barrier(8)

    def answer() -> None:
        start.wait()
        won.append(store.claim("k", "approval:mcpr_1"))

    threads = [threading.Thread(target=answer) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    db.close()
    assert sorted(won) == [False] * 7 + [True]


@pytest.mark.parametrize("field", ["responses_store_entries", "responses_store_mib", "responses_store_ttl"])
def test_a_store_bound_past_its_range_is_refused(field):
    with pytest.raises(ValidationError) as caught:
        ServerSettings(**{field: 2**61})
    assert field in str(caught.value)


def test_a_foreign_table_where_ours_go_stops_the_start_and_changes_nothing(tmp_path):
    db = tmp_path / "servelm.db"
    with sqlite3.connect(db) as other:
        other.execute("CREATE TABLE conversations (id TEXT, title TEXT)")
        other.execute("INSERT INTO conversations VALUES ('c1', 'theirs')")
    with pytest.raises(StoreDamaged, match="conversations"):
        BatchStore(tmp_path).close()
    with sqlite3.connect(db) as other:
        assert other.execute("SELECT * FROM conversations").fetchall() == [("c1", "theirs")]


def test_damage_met_while_serving_is_a_503_not_a_crash(tmp_path):
    db = BatchStore(tmp_path)
    responses, talks = SqlResponses(db), SqlConversations(db)
    responses.put("k", "resp_1", StoredResponse({"id": "resp_1"}, [], []))
    cid = talks.create("k", {}, []).id
    db.close()
    raw = bytearray((tmp_path / "servelm.db").read_bytes())
    for page in range(1, len(raw) // 4096):  # every page but the header garbage
        raw[page * 4096:page * 4096 + 64] = b"\xff" * 64
    (tmp_path / "servelm.db").write_bytes(bytes(raw))
    for name in ("servelm.db-wal", "servelm.db-shm"):
        (tmp_path / name).unlink(missing_ok=True)
    db._db = sqlite3.connect(db.db_path, check_same_thread=False, isolation_level=None)
    for call in (lambda: responses.get("k", "resp_1"), lambda: talks.items("k", cid),
                 lambda: responses.put("k", "resp_2", StoredResponse({}, [], []))):
        with pytest.raises(StoreDamaged) as caught:
            call()
        assert caught.value.status == 503 and caught.value.code == "store_damaged"
    db._db.close()


def fill(base: str, conversation: str, count: int) -> None:
    for _ in range(count // 20):
        answer = httpx.post(f"{base}/v1/conversations/{conversation}/items",
                            json={"items": [{"type": "message", "role": "user", "content": "x"}] * 20})
        assert answer.status_code == 200, answer.text


def test_a_conversation_too_long_to_read_is_a_400_naming_it(fake_server_factory, tmp_path):
    """It was a 400 naming `input` with pydantic's words about a list the client never sent."""
    server = fake_server_factory(batches=BatchConfig(str(tmp_path / "state")))
    conversation = httpx.post(f"{server.base_url}/v1/conversations", json={}).json()["id"]
    fill(server.base_url, conversation, 2060)
    answer = httpx.post(f"{server.base_url}/v1/responses", json={"model": "fake-model", "input": "more",
                                                                  "conversation": conversation})
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "conversation", answer.text
    assert "2048" in answer.json()["error"]["message"]


@pytest.mark.parametrize("stream", [False, True])
def test_a_response_that_cannot_fit_its_conversation_is_refused_before_it_runs(tmp_path, stream):
    """A streamed response into a full conversation was generated, then its answer dropped with an error event."""
    from fastapi.testclient import TestClient

    from servelm.compose import build_deployment
    from servelm.http.app import AppOptions, create_app
    from servelm.runners.fake import FakeRunner
    from servelm.service.conversations import ConversationLimits
    from servelm.service.registry.deployments import Deployments

    deployment, engine = build_deployment("fake-model", FakeRunner())
    app = create_app(Deployments([deployment]), AppOptions(batches=BatchConfig(str(tmp_path)),
                                                           conversations=ConversationLimits(max_items=3)),
                     on_start=engine.start, on_stop=engine.stop)
    with TestClient(app) as client:
        conversation = client.post("/v1/conversations", json={"items": [
            {"type": "message", "role": "user", "content": "one"}, {"type": "message", "role": "user", "content": "two"}]}).json()["id"]
        steps = engine.stats().steps
        answer = client.post("/v1/responses", json={"model": "fake-model", "input": "more", "conversation": conversation,
                                                    "stream": stream})
        assert answer.status_code == 400, answer.text
        assert answer.json()["error"]["code"] == "conversation_limit_reached", answer.text
        assert engine.stats().steps == steps, "nothing was generated for an answer with no room"
        assert len(client.get(f"/v1/conversations/{conversation}/items").json()["data"]) == 2


def test_a_page_after_an_unknown_item_is_a_400(fake_server_factory, tmp_path):
    server = fake_server_factory(batches=BatchConfig(str(tmp_path / "state")))
    conversation = httpx.post(f"{server.base_url}/v1/conversations", json={}).json()["id"]
    answer = httpx.get(f"{server.base_url}/v1/conversations/{conversation}/items", params={"after": "msg_nope"})
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "after", answer.text


def test_the_state_is_in_the_database_a_health_report_names(fake_server_factory, tmp_path):
    server = fake_server_factory(batches=BatchConfig(str(tmp_path / "state")))
    kept = httpx.get(f"{server.base_url}/health").json()["kept"]
    assert kept["survives_restart"] is True and str(Path(tmp_path / "state")) in kept["responses"]
    memory = fake_server_factory()
    assert httpx.get(f"{memory.base_url}/health").json()["kept"] == {
        "responses": "memory", "conversations": "memory", "survives_restart": False}


def test_once_damage_is_met_nothing_more_is_acknowledged_and_health_says_so(fake_server_factory, tmp_path):
    """Writes that missed the damaged pages were still answered 200 after damage was met, then lost: the restart
    refuses the database. /health's status said ok meanwhile, and `kept` that a restart keeps them."""
    server = fake_server_factory(batches=BatchConfig(str(tmp_path / "state")))
    base = server.base_url
    conversation = httpx.post(f"{base}/v1/conversations", json={}).json()["id"]
    store = server.state.services.responses.store.db
    assert isinstance(store, BatchStore)
    store.damaged("a damaged page met by another request")
    answers = [httpx.post(f"{base}/v1/conversations/{conversation}/items",
                          json={"items": [{"type": "message", "role": "user", "content": "x"}]}),
               httpx.post(f"{base}/v1/responses", json={"model": "fake-model", "input": "x", "max_output_tokens": 2}),
               httpx.post(f"{base}/v1/conversations", json={})]
    assert [a.status_code for a in answers] == [503, 503, 503], [a.text for a in answers]
    assert all(a.json()["error"]["code"] == "store_damaged" for a in answers)
    health = httpx.get(f"{base}/health").json()
    assert health["status"] == "degraded" and health["kept"]["survives_restart"] is False
    assert health["batch_store"]["status"] == "damaged"


def test_a_start_on_a_database_with_many_bad_pages_is_refused_in_one_line(tmp_path):
    db = BatchStore(tmp_path)
    talks = SqlConversations(db)
    for _ in range(40):
        talks.create("k", {}, [{"type": "message", "id": f"m{i}", "content": "x" * 500} for i in range(20)])
    db.close()
    raw = bytearray((tmp_path / "servelm.db").read_bytes())
    for offset in range(4096 + 100, len(raw), 4096 * 3):
        raw[offset:offset + 300] = bytes(range(256)) + bytes(44)
    (tmp_path / "servelm.db").write_bytes(bytes(raw))
    with pytest.raises(StoreDamaged) as caught:
        BatchStore(tmp_path).close()
    assert "\n" not in str(caught.value) and "move it aside" in str(caught.value), str(caught.value)


def test_a_bad_state_directory_stops_the_start_before_any_model_loads(tmp_path):
    """A damaged, foreign or misplaced database was refused only after the models had loaded and self-checked
    (minutes on a busy machine)."""
    import subprocess
    import sys

    (tmp_path / "servelm.db").write_bytes(b"not a database at all" * 100)
    done = subprocess.run([sys.executable, "-m", "servelm", "serve", "--state-dir", str(tmp_path), "--port", "0"],
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 1 and "loading" not in done.stderr, done.stderr[-2000:]
    assert done.stderr.strip().splitlines()[-1].startswith("servelm: ") and str(tmp_path) in done.stderr


@pytest.mark.parametrize("path", ["/v1/conversations/{c}/items", "/v1/conversations/{c}/items/{i}",
                                  "/v1/responses/{r}/input_items"])
def test_an_include_value_openai_does_not_know_is_a_400(fake_server, path):
    """include=bogus was taken and ignored (OpenAI answers 400)."""
    base = fake_server.base_url
    conversation = httpx.post(f"{base}/v1/conversations", json={"items": [
        {"type": "message", "role": "user", "content": "hi"}]}).json()
    item = httpx.get(f"{base}/v1/conversations/{conversation['id']}/items").json()["data"][0]["id"]
    response = httpx.post(f"{base}/v1/responses", json={"model": "fake-model", "input": "x", "max_output_tokens": 2}).json()
    url = base + path.format(c=conversation["id"], i=item, r=response["id"])
    assert httpx.get(url, params={"include": "message.output_text.logprobs"}).status_code == 200
    answer = httpx.get(url, params={"include": "bogus"})
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "include", answer.text
