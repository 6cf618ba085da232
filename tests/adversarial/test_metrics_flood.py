"""A client that scrapes /metrics back to back (found by the black-box attack): each scrape rendered every collector
on the event loop, about 1.5 ms of Python, so a tight scraping loop took the loop from everyone's streams. Scrapes
now share renders: at most one every RENDER_EVERY_S, each begun after every scrape it answers arrived (nothing
stale is served)."""

from __future__ import annotations

import asyncio
import time

import httpx

from servelm.metrics import RENDER_EVERY_S
from tests.http.test_metrics_fake import MSG, scrape, value


def test_a_scraping_flood_costs_one_render_a_period(fake_server):
    metrics = fake_server.state.metrics
    renders = []
    inner = metrics.render

    def counted() -> bytes:
        renders.append(time.monotonic())
        return inner()

    metrics.render = counted

    async def flood() -> tuple[int, float]:
        async with httpx.AsyncClient(base_url=fake_server.base_url, timeout=30,
                                     limits=httpx.Limits(max_connections=16)) as client:

            async def scraper() -> int:
                done = 0
                while time.monotonic() < until:
                    r = await client.get("/metrics")
                    assert r.status_code == 200 and "servelm_event_loop_lag_seconds" in r.text
                    done += 1
                return done

            start = time.monotonic()
            until = start + 1.5
            counts = await asyncio.gather(*(scraper() for _ in range(16)))
            return sum(counts), time.monotonic() - start

    scrapes, took = asyncio.run(flood())
    assert scrapes > 2 * len(renders)  # the scrapes shared renders
    assert len(renders) <= took / RENDER_EVERY_S + 2
    gaps = [b - a for a, b in zip(renders, renders[1:])]
    assert min(gaps) >= RENDER_EVERY_S * 0.9


def test_a_scrape_sees_what_happened_before_it_was_sent(fake_server):
    url = fake_server.base_url
    before = value(scrape(url), "servelm_generation_tokens_total", model="fake-model")
    for tokens in (3, 4):  # back to back: the second scrape comes within a period of the first's render
        r = httpx.post(url + "/v1/chat/completions", json={"model": "fake-model", "messages": MSG, "max_tokens": tokens})
        assert r.status_code == 200
        before += tokens
        assert value(scrape(url), "servelm_generation_tokens_total", model="fake-model") == before
