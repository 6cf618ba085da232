"""Issue 13's bodies, each answered as it must be now (tests/http/abuse_corpus.py), on a real HTTP server over
the fake model; and the server still serves afterwards."""

from __future__ import annotations

import httpx
import pytest

from tests.http.abuse_corpus import cases

CASES = cases("fake-model")


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_each_body_gets_its_answer(fake_server, case):
    r = httpx.post(fake_server.base_url + case.path, content=case.body, headers=case.headers, timeout=60)
    assert r.status_code in (case.status if isinstance(case.status, tuple) else (case.status,)), r.text[:500]
    if r.status_code >= 400:
        err = r.json()["error"]
        assert set(err) >= {"message", "type", "param", "code"}
        assert "panic" not in err["message"] and "backtrace" not in err["message"] and "\n" not in err["message"]
        if case.code:
            assert err["code"] == case.code, err
        if case.param:
            assert err["param"] == case.param, err
    elif "stream" in case.body.decode():
        assert '"error"' not in r.text and r.text.rstrip().endswith("data: [DONE]")
    ok = httpx.post(fake_server.base_url + "/v1/chat/completions", timeout=30,
                    json={"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert ok.status_code == 200
