"""What a black-box attack on the rerank, tokenize, tracing, dialect and prefix-cache surfaces found, each written as
a test first: prefix-cache files readable by every user of the machine; a rerank query that is too long blamed on the document; `/tokenize {}` answered as
if the body were not an object; Azure's `extra-parameters: drop` refused. (Stop strings in traces without
--otlp-capture-content: tests/http/test_tracing_fake.py.)"""

from __future__ import annotations

import stat

import httpx
import pytest

from servelm.compose import build_embedding_deployment
from servelm.engine.spill import SUFFIX, write_state
from servelm.errors import ContextLengthExceeded
from servelm.runners.fake import FakeEmbedder
from servelm.service import dialects
from servelm.service.registry.deployments import Deployments
from servelm.service.rerank import ScoreQuery, ScoreService


def test_a_prefix_cache_file_is_its_owners_alone(tmp_path):
    path, _ = write_state(tmp_path, "model", "scope", (1, 2, 3), b"state", b"k" * 32)
    assert path.suffix == SUFFIX
    assert stat.S_IMODE(path.stat().st_mode) == 0o600, "it holds a key's prompt tokens"


def test_a_rerank_query_too_long_is_blamed_on_the_query():
    rerank, engine = build_embedding_deployment("rr", FakeEmbedder(cross_encoder=True, context_window=32))
    service = ScoreService(Deployments([rerank]))
    with pytest.raises(ContextLengthExceeded) as err:
        service.prepare("rr", ScoreQuery("rr", ["word " * 40], ["a"], "query", "documents"))
    assert err.value.param == "query" and "'query'" in str(err.value)
    with pytest.raises(ContextLengthExceeded) as pair:  # each fits alone, the pair does not: the document's
        service.prepare("rr", ScoreQuery("rr", ["word " * 5], ["word " * 5], "query", "documents"))
    assert pair.value.param == "documents"


def test_tokenize_with_no_input_says_what_is_missing(fake_server):
    r = httpx.post(fake_server.base_url + "/tokenize", json={}, timeout=10)
    assert r.status_code == 400
    message = r.json()["error"]["message"]
    assert "prompt" in message and "messages" in message and "JSON object" not in message


def test_azures_drop_is_its_word_for_ignore():
    body = {"messages": [], "top_k": 3}
    assert dialects.azure_chat_body(body, "drop") == dialects.azure_chat_body(body, "ignore") == ({"messages": []},
                                                                                                  ["top_k"])
