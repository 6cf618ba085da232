"""The routers are tables of plain handlers: module-level functions (or BatchRoutes' methods), never closures."""

from __future__ import annotations

import sys

import pytest

from servelm.http import agents, batches, dialects, metrics_route, models, playground, rerank, routes
from servelm.http.routes import Route, router_of

TABLES = {"routes": routes.ROUTES, "agents": agents.ROUTES, "dialects": dialects.ROUTES, "rerank": rerank.ROUTES,
          "lora": models.LORA_ROUTES, "models": models.MODELS_ROUTES, "metrics": metrics_route.ROUTES,
          "playground": playground.ROUTES, "no_batch": batches.NO_BATCH_ROUTES}


@pytest.mark.parametrize("table", TABLES.values(), ids=TABLES.keys())
def test_every_handler_is_a_plain_module_level_function(table: tuple[Route, ...]) -> None:
    for route in table:
        assert "<locals>" not in route.handler.__qualname__, route.path
        assert getattr(sys.modules[route.handler.__module__], route.handler.__name__) is route.handler, route.path


def test_the_batch_handlers_are_batch_routes_methods() -> None:
    for _, path, handler in batches.BATCH_ROUTES:
        assert handler.__qualname__ == f"BatchRoutes.{handler.__name__}", path


def test_a_table_is_registered_in_its_order_with_its_methods_and_docs() -> None:
    router = router_of(rerank.ROUTES + batches.NO_BATCH_ROUTES[:1])
    assert [(r.path, r.methods, r.name, r.include_in_schema) for r in router.routes] == [
        ("/v1/rerank", {"POST"}, "jina", True), ("/rerank", {"POST"}, "jina", True),
        ("/v2/rerank", {"POST"}, "cohere", True), ("/v3/rerank", {"POST"}, "ovms", True),
        ("/v1/score", {"POST"}, "vllm_score", True), ("/v1/files", {"GET", "POST", "DELETE"}, "needs_state_dir", False)]
    assert all(r.openapi_extra for r in router.routes[:5])
