"""The OpenAPI document at /openapi.json: FastAPI's own, with the request and response bodies that the routes
read and write themselves (they parse bodies with our strict pydantic models, not through FastAPI's parameters,
so each route states its models here with `doc(...)`, and `install` puts every model's schema into components)."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from servelm.protocol.common import ErrorResponse

REF = "#/components/schemas/{model}"
_MODELS = "x-servelm-models"  # the models a route names, until install() turns them into components


def _ref(model: type[BaseModel]) -> dict[str, str]:
    return {"$ref": REF.format(model=model.__name__)}


def doc(*, request: type[BaseModel] | list[type[BaseModel]] | None = None, response: type[BaseModel] | None = None,
        streams: str | None = None, query: list[dict[str, Any]] | None = None,
        headers: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """A route's `openapi_extra`: its JSON body (one model, or any of several), its 200 answer (and the media type
    it streams as, when it may stream), extra query and header parameters, and the error envelope of its 4xx/5xx."""
    models: list[type[BaseModel]] = [ErrorResponse]
    extra: dict[str, Any] = {}
    if request is not None:
        choices = request if isinstance(request, list) else [request]
        models += choices
        schema = _ref(choices[0]) if len(choices) == 1 else {"anyOf": [_ref(m) for m in choices]}
        extra["requestBody"] = {"required": True, "content": {"application/json": {"schema": schema}}}
    ok: dict[str, Any] = {"description": "OK"}
    if response is not None:
        models.append(response)
        ok["content"] = {"application/json": {"schema": _ref(response)}}
        if streams:
            ok["content"][streams] = {"schema": {"type": "string"}}
    error = {"description": "An error, in the envelope", "content": {"application/json": {"schema": _ref(ErrorResponse)}}}
    extra["responses"] = {"200": ok, "4XX": error, "5XX": error}
    params = [{**p, "in": "query"} for p in query or []] + [{**p, "in": "header"} for p in headers or []]
    if params:
        extra["parameters"] = params
    extra[_MODELS] = [m.__module__ + "." + m.__qualname__ for m in models]
    _registry.update({m.__module__ + "." + m.__qualname__: m for m in models})
    return extra


_registry: dict[str, type[BaseModel]] = {}


def install(app: FastAPI) -> None:
    """Serve /openapi.json with every named model's schema in components (built once, on first request)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            spec = get_openapi(title="servelm", version=app.version, routes=app.routes,
                               description="An OpenAI-compatible LLM server (servelm).")
            wanted: dict[str, type[BaseModel]] = {}
            for path in spec.get("paths", {}).values():
                for op in path.values():
                    for name in op.pop(_MODELS, []):
                        wanted[name] = _registry[name]
            _, defs = models_json_schema([(m, "validation" if _is_request(m) else "serialization")
                                          for m in wanted.values()], ref_template=REF)
            spec.setdefault("components", {}).setdefault("schemas", {}).update(defs.get("$defs", {}))
            app.openapi_schema = spec
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]  # FastAPI's documented way to give its own schema


def _is_request(model: type[BaseModel]) -> bool:
    return bool(model.model_config.get("extra") == "forbid")
