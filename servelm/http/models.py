"""Models and adapters that come and go, over HTTP: the pure-ASGI piece that has a request wait while the model it
names loads (and holds that model loaded until its answer ends); llama-server's routes POST /models/load,
/models/unload and /models/refresh; vLLM's POST /v1/load_lora_adapter and /v1/unload_lora_adapter. With keys on,
the routes answer an admin key only."""

from __future__ import annotations

import json
import re
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, PlainTextResponse

from servelm.errors import ApiError, Forbidden, InvalidParameter, ModelNotFound
from servelm.http.asgi import ASGIApp, Message, Receive, Scope, Send, header, send_error
from servelm.http.auth import KEYS_ON, allowed, current_key
from servelm.http.limits import is_json
from servelm.http.routes import Route, app_state
from servelm.service.registry.adapters import AdapterNotFound, AdapterRegistry, check_scale
from servelm.service.registry.catalog import ModelCatalog, parse_keep_alive
from servelm.service.registry.deployments import Deployments, TextDeployment

_AZURE_PATH = re.compile(r"^/openai/deployments/([^/]+)/")
_ROUTING_HEADERS = (b"azureml-model-deployment", b"x-amzn-sagemaker-target-model")


class LoadOnDemand:
    """Inside auth and the body limits: a POST whose JSON body (or Azure path, or routing header) names one of
    the catalog's models waits while it loads, and runs holding it loaded; the body is read here once and given
    to the app as it came. A bad `keep_alive` is a 400 naming it; a load that fails answers its error."""

    def __init__(self, app: ASGIApp, catalog: ModelCatalog) -> None:
        self.app = app
        self.catalog = catalog

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("method") != "POST" or scope["path"].startswith("/models/"):
            await self.app(scope, receive, send)
            return
        body, messages = b"", []
        try:
            if is_json(header(scope, b"content-type")):
                while True:
                    message = await receive()
                    messages.append(message)
                    body += message.get("body", b"")
                    if message["type"] != "http.request" or not message.get("more_body", False):
                        break
            model, keep_alive = _named(scope, body)
            name = await self.catalog.resolve(model) if model and allowed(scope, model) else None
        except ApiError as exc:
            await send_error(send, exc, scope)
            return
        replay = iter(messages)

        async def replayed() -> Message:
            return next(replay, None) or await receive()

        if name is None:
            await self.app(scope, replayed, send)
            return
        started = False

        async def tracked(message: Message) -> None:
            nonlocal started
            started = True
            await send(message)

        try:
            async with self.catalog.use(name, keep_alive):
                await self.app(scope, replayed, tracked)
        except ApiError as exc:  # the load's own error (the app answers its errors itself)
            if started:
                raise
            await send_error(send, exc, scope)


def _named(scope: Scope, body: bytes) -> tuple[str | None, float | None]:
    """The model a request names, and its keep_alive (a 400 for a bad one)."""
    data: Any = None
    if body:
        try:
            data = json.loads(body)
        except ValueError:
            data = None  # the route answers the malformed body
    data = data if isinstance(data, dict) else {}
    keep_alive = parse_keep_alive(data.get("keep_alive"))
    model = data.get("model")
    if not isinstance(model, str):
        path = _AZURE_PATH.match(scope["path"])
        model = path.group(1) if path else next((v for h in _ROUTING_HEADERS if (v := header(scope, h))), None)
    return model, keep_alive


def _admin(request: Request, what: str) -> None:
    if request.scope.get(KEYS_ON) and not getattr(current_key(request.scope), "admin", False):
        raise Forbidden(f"{what} needs an admin key (--admin-key).")


async def _body(request: Request, *required: str) -> dict[str, Any]:
    """The JSON body, with these string fields present (a 400 naming the first one missing)."""
    try:
        data = await request.json()
    except ValueError:
        data = None
    data = data if isinstance(data, dict) else {}
    for name in required:
        if not isinstance(data.get(name), str) or not data[name]:
            raise InvalidParameter(f"`{name}` is required (a string).", name, code="missing_required_parameter")
    return data


def _adapters_of(deployments: Deployments, model: str | None) -> AdapterRegistry:
    """The deployment a LoRA route acts on: the one `model` names, else the first that takes adapters."""
    if model is not None:
        d = deployments.get(model)
        if not isinstance(d, TextDeployment) or d.adapters is None:
            raise InvalidParameter(f"The model `{model}` takes no LoRA adapters.", "model")
        return d.adapters
    for d in deployments.generators():
        if d.adapters is not None:
            return d.adapters
    raise InvalidParameter("No model on this server takes LoRA adapters.", "model")


async def load_lora(request: Request) -> PlainTextResponse:
    _admin(request, "Loading a LoRA adapter")
    deployments = app_state(request).deployments
    body = await _body(request, "lora_name", "lora_path")
    name, path, model, scale = body["lora_name"], body["lora_path"], body.get("model"), body.get("scale", 1.0)
    if deployments.base_of(name) is not None:
        raise InvalidParameter(f"The lora adapter '{name}' has already been loaded.", "lora_name",
                               code="lora_already_loaded")
    if name in {n for n, _ in deployments.model_ids()}:
        raise InvalidParameter(f"`{name}` names a model already.", "lora_name", code="lora_already_loaded")
    scale = check_scale(scale)  # finite, within ±SCALE_BOUND: JSON's NaN, Infinity and 1e999 are 400s
    await _adapters_of(deployments, model if isinstance(model, str) else None).add(name, path, scale)
    return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")


async def unload_lora(request: Request) -> PlainTextResponse:
    _admin(request, "Unloading a LoRA adapter")
    name = (await _body(request, "lora_name"))["lora_name"]
    base = app_state(request).deployments.base_of(name)
    if base is None or base.adapters is None:
        raise AdapterNotFound(name)
    await base.adapters.remove(name)
    return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")


# vLLM's runtime LoRA routes (its shapes and status codes; `model` names the base when there are several)
LORA_ROUTES = (
    Route("POST", "/v1/load_lora_adapter", load_lora),
    Route("POST", "/v1/unload_lora_adapter", unload_lora),
)


async def _target(request: Request) -> tuple[ModelCatalog, str]:
    """The catalog, and the model of its that the request names (an admin's request)."""
    _admin(request, "Loading and unloading models")
    catalog = app_state(request).catalog
    if catalog is None:
        raise InvalidParameter("This server loads no model on demand (start it with --models-dir, or give a "
                               "deployment `load = \"on-demand\"`).", "model", code="model_not_supported")
    model = (await _body(request, "model"))["model"]
    name = await catalog.resolve(model)
    if name is None:
        raise ModelNotFound(model)
    return catalog, name


async def load(request: Request) -> JSONResponse:
    """llama-server's router: loads the model now (a no-op when it is loaded)."""
    catalog, name = await _target(request)
    await catalog.load(name)
    return JSONResponse({"success": True, "model": name, "status": catalog.statuses()[name].wire()})


async def unload(request: Request) -> JSONResponse:
    """Unloads the model once its requests under way end (its prefix cache written to disk first)."""
    catalog, name = await _target(request)
    await catalog.unload(name)
    return JSONResponse({"success": True, "model": name, "status": catalog.statuses()[name].wire()})


async def refresh(request: Request) -> JSONResponse:
    """Rescans --models-dir: new files become models, changed settings apply at the next load."""
    _admin(request, "Rescanning the models directory")
    catalog = app_state(request).catalog
    if catalog is not None:
        await catalog.refresh()
    statuses = catalog.statuses() if catalog is not None else {}
    return JSONResponse({"success": True, "models": {n: s.wire() for n, s in statuses.items()}})


MODELS_ROUTES = (
    Route("POST", "/models/load", load),
    Route("POST", "/models/unload", unload),
    Route("POST", "/models/refresh", refresh),
)
