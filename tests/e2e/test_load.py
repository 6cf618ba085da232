"""Sixteen concurrent streams: every one completes with exactly its tokens, and the KV cache empties."""

from __future__ import annotations

import asyncio

import openai
import pytest

from .helpers import NO_EOS, achat, gather_watching_running, user, wait_idle

pytestmark = pytest.mark.e2e

STREAMS = 16
TOKENS = 32


async def test_sixteen_concurrent_streams(aclient: openai.AsyncOpenAI, base_url: str) -> None:
    results, peak = await gather_watching_running(base_url, [
        achat(aclient, stream=True, messages=user(f"Count from {i} to {i + 40}."), max_tokens=TOKENS,
              temperature=1.0, logit_bias=NO_EOS)
        for i in range(STREAMS)
    ])
    for r in results:
        assert r.finish_reason == "length"
        assert r.usage.completion_tokens == TOKENS
        assert r.text
    assert peak > 1, "the requests never ran together"
    idle, stats = await asyncio.to_thread(wait_idle, base_url, 10.0)
    assert idle, f"the server did not return to idle after the load: {stats}"
    assert stats["kv_cells_used"] == 0
