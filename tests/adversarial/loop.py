"""The event loop's lag during an attack, read from the server's own monitor in /metrics.

`servelm_event_loop_lag_seconds` observes how late a timer set every 50 ms ran; while something blocks the loop
(a file read, a scan, a parse), every request on it waits as long. `loop_responsive` fails the test if, during its
block, any tick ran later than the bound.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families

LAG = "servelm_event_loop_lag_seconds"


@dataclass(frozen=True)
class LoopLag:
    ticks: int  # timers observed
    over: int  # of them, those later than the bound
    longest: float  # the longest lag since the server started


def loop_lag(base_url: str, bound_s: float, headers: dict[str, str] | None = None) -> LoopLag:
    """The lag histogram's ticks, those over `bound_s` (a bucket edge at or below it), and the longest lag."""
    text = httpx.get(f"{base_url}/metrics", headers=headers, timeout=60).text
    buckets: dict[float, float] = {}
    count = longest = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == f"{LAG}_bucket":
                buckets[float(sample.labels["le"])] = sample.value
            elif sample.name == f"{LAG}_count":
                count = sample.value
            elif sample.name == "servelm_event_loop_lag_max_seconds":
                longest = sample.value
    edge = max(le for le in buckets if le <= bound_s)
    return LoopLag(int(count), int(count - buckets[edge]), longest)


@contextmanager
def loop_responsive(base_url: str, bound_s: float = 0.5, headers: dict[str, str] | None = None) -> Iterator[None]:
    """Fail if the server's event loop stalled longer than `bound_s` at any moment of the block."""
    before = loop_lag(base_url, bound_s, headers)
    yield
    loop_lag(base_url, bound_s, headers)  # answered once the loop is free again: a stall still going has ended
    time.sleep(0.2)  # and the monitor's late tick has been counted
    after = loop_lag(base_url, bound_s, headers)
    assert after.ticks > before.ticks, "the loop monitor did not run"
    assert after.over == before.over, (
        f"the event loop stalled past {bound_s} s {after.over - before.over} times during the attack "
        f"(longest lag since start: {after.longest:.2f} s)")
