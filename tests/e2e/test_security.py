"""API keys and rate limits through the official client, on a server of its own (--api-key, --rate-limit-rpm)."""

from __future__ import annotations

import openai
import pytest

from .conftest import start_server, stop_server
from .helpers import MODEL, client_for, user

pytestmark = pytest.mark.e2e


def test_keys_and_requests_per_minute(tmp_path_factory: pytest.TempPathFactory) -> None:
    srv = start_server(tmp_path_factory, "--api-key", "sk-e2e-one", "--api-key", "sk-e2e-two",
                       "--rate-limit-rpm", "2", "--no-embedding-model", "--chat-embedding-window", "0")
    try:
        with client_for(srv.base_url, "sk-wrong") as wrong, pytest.raises(openai.AuthenticationError) as e:
            wrong.chat.completions.create(model=MODEL, messages=user("hi"), max_tokens=2)
        assert e.value.status_code == 401 and e.value.code == "invalid_api_key"

        with client_for(srv.base_url, "sk-e2e-two") as right:
            for _ in range(2):
                assert right.chat.completions.create(model=MODEL, messages=user("hi"), max_tokens=2).choices
            with pytest.raises(openai.RateLimitError) as e:
                right.chat.completions.create(model=MODEL, messages=user("hi"), max_tokens=2)
        assert e.value.code == "rate_limit_exceeded" and int(e.value.response.headers["retry-after"]) >= 1
        # the other key has its own bucket
        with client_for(srv.base_url, "sk-e2e-one") as one:
            assert one.chat.completions.create(model=MODEL, messages=user("hi"), max_tokens=2).choices
    finally:
        stop_server(srv)
