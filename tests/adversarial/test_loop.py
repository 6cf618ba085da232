"""The event-loop lag monitor that the other attacks' tests lean on: it sees a stall, and an idle server has none."""

from __future__ import annotations

import asyncio
import time

from prometheus_client import generate_latest

from servelm.metrics import Metrics
from tests.adversarial.loop import loop_lag, loop_responsive


def test_the_monitor_records_a_blocked_loop():
    metrics = Metrics()

    async def block() -> None:
        watch = asyncio.create_task(metrics.watch_loop())
        await asyncio.sleep(0.12)
        time.sleep(0.4)  # what a file read or a parse on the loop does to every request
        await asyncio.sleep(0.12)
        watch.cancel()

    asyncio.run(block())
    text = generate_latest(metrics.registry).decode()
    assert 'servelm_event_loop_lag_seconds_bucket{le="0.25"}' in text
    assert metrics.loop_lag_max._value.get() >= 0.35
    over = [line for line in text.splitlines() if line.startswith('servelm_event_loop_lag_seconds_bucket{le="0.25"}')]
    total = [line for line in text.splitlines() if line.startswith("servelm_event_loop_lag_seconds_count")]
    assert float(total[0].split()[-1]) - float(over[0].split()[-1]) == 1  # the one stalled tick


def test_an_idle_server_reports_its_loop_responsive(fake_server_factory):
    server = fake_server_factory()
    time.sleep(0.2)
    with loop_responsive(server.base_url, bound_s=0.25):
        time.sleep(0.3)
    lag = loop_lag(server.base_url, 0.25)
    assert lag.ticks >= 5 and lag.over == 0
