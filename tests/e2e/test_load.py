"""Sixteen concurrent streams: every one completes with exactly its tokens, and the KV cache empties."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from .helpers import MODEL, NO_EOS, achat, user, wait_idle

pytestmark = pytest.mark.e2e

STREAMS = 16
TOKENS = 32


async def test_sixteen_concurrent_streams(aclient: openai.AsyncOpenAI, base_url: str) -> None:
    peak = 0
    done = asyncio.Event()

    async def watch() -> None:
        nonlocal peak
        async with httpx.AsyncClient(timeout=10) as http:
            while not done.is_set():
                stats = (await http.get(f"{base_url}/health")).json()["deployments"][MODEL]
                peak = max(peak, stats["running"])
                await asyncio.sleep(0.05)

    watcher = asyncio.create_task(watch())
    try:
        results = await asyncio.gather(*[
            achat(aclient, stream=True, messages=user(f"Count from {i} to {i + 40}."), max_tokens=TOKENS,
                  temperature=1.0, logit_bias=NO_EOS)
            for i in range(STREAMS)
        ])
    finally:
        done.set()
        await watcher
    for r in results:
        assert r.finish_reason == "length"
        assert r.usage.completion_tokens == TOKENS
        assert r.text
    assert peak > 1, "the requests never ran together"
    idle, stats = await asyncio.to_thread(wait_idle, base_url, 10.0)
    assert idle, f"the server did not return to idle after the load: {stats}"
    assert stats["kv_cells_used"] == 0
