"""Sixteen concurrent streams: every one completes with exactly its tokens, and the KV cache empties."""

from __future__ import annotations

import asyncio
import re

import httpx
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


def test_what_the_server_built_before_serving_is_out_of_every_collection(base_url: str) -> None:
    """A full collection of the heap holds the GIL (every thread waits: the engine's next step, every stream): the
    modules, vocabulary tables and models built before serving are frozen, so that one reads only what came since
    (a tenth of a second a collection on the default model otherwise, once every thousand tokens or so)."""
    text = httpx.get(base_url + "/metrics", timeout=10).text
    frozen = re.search(r"^servelm_gc_frozen_objects (\S+)$", text, re.M)
    assert frozen is not None, "no servelm_gc_frozen_objects in /metrics"
    assert float(frozen.group(1)) > 10_000, "the server froze nothing it built before serving"
    pauses = re.findall(r'^servelm_gc_pause_seconds_total{generation="(\d)"} (\S+)$', text, re.M)
    assert sorted(g for g, _ in pauses) == ["0", "1", "2"]
