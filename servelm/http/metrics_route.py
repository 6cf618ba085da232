"""GET /metrics (Prometheus text format), and the engine counts it reads from every deployment."""

from __future__ import annotations

from collections.abc import Iterator

from fastapi import Request
from fastapi.responses import Response

from servelm.http.routes import Route, app_state
from servelm.metrics import CONTENT_TYPE, EngineGauges
from servelm.service.registry.deployments import Deployments


def engine_gauges(deployments: Deployments) -> Iterator[EngineGauges]:
    """Each text-generating deployment's queue, running sequences and KV cells (embedding-only ones have none)."""
    for d in deployments.generators():
        s = d.engine.stats()
        yield EngineGauges(d.name, s.waiting, s.running, s.kv_cells_used, s.kv_cells_cached, s.kv_cells_total,
                           s.kv_cell_bytes, s.cache_hits, s.cached_tokens, s.step_seconds, s.forward_seconds, s.steps, s.forward_calls,
                           s.phase_seconds, s.draft_tokens, s.draft_accepted, s.spill_ram_bytes, s.spill_disk_bytes,
                           s.spill_restored, s.spill_restore_failures, s.preemptions, s.resumed_tokens,
                           tuple((t.label, t.slots, t.waiting, t.tokens) for t in s.tenants))


async def prometheus_metrics(request: Request) -> Response:
    return Response(await app_state(request).metrics.exposition(), media_type=CONTENT_TYPE)


ROUTES = (Route("GET", "/metrics", prometheus_metrics),)
