"""The platform dialects' routes: Azure ML (`/chat/completions?api-version=…`, `/info`), SageMaker / DJL LMI
(`/invocations`, `/ping`) and OpenVINO Model Server (`/v3/chat/completions`, `/v3/completions`; `/v3/models`
is in routes.py). Each translates the request (service/dialects.py) and serves it with the OpenAI services."""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar
from urllib.parse import quote

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError

from servelm.errors import ApiError, InvalidParameter
from servelm.http.errors import error_response, invalid_json, validation_error
from servelm.http.limits import check_json_containers
from servelm.http.openapi import doc
from servelm.http.routes import Route, app_state, embed, generate
from servelm.http.streams import JSONLINES, SSE
from servelm.protocol.chat import ChatCompletion, ChatCompletionRequest
from servelm.protocol.completions import Completion, CompletionRequest
from servelm.protocol.dialects import DjlRequest
from servelm.protocol.embeddings import EmbeddingRequest, EmbeddingResponse
from servelm.service.dialects import (
    EXTRA_PARAMETER_MODES,
    azure_chat_body,
    azure_embeddings_body,
    check_api_version,
    default_embedding_model,
    default_model,
    invocation_kind,
    ovms_body,
    route_model,
    sagemaker_target,
)
from servelm.service.registry.deployments import Deployments

log = logging.getLogger("servelm.http")
M = TypeVar("M", bound=BaseModel)

AZURE_DEPLOYMENT_HEADER = "azureml-model-deployment"
EXTRA_PARAMETERS_HEADER = "extra-parameters"
DROPPED_PARAMETERS_HEADER = "x-servelm-dropped-parameters"  # the extra parameters dropped (no header, or ignore)
SAGEMAKER_TARGET_HEADER = "x-amzn-sagemaker-target-model"
API_VERSION = {"name": "api-version", "required": True, "schema": {"type": "string", "example": "2024-05-01-preview"}}


# -- Azure ML and Azure AI model inference ------------------------------------------------------
async def _azure(request: Request, translate: Callable[[dict[str, Any], str | None], tuple[dict[str, Any], list[str]]],
                 default: Callable[[Deployments], str],
                 serve: Callable[[Request, dict[str, Any]], Awaitable[Response]]) -> Response:
    """An Azure route: api-version, the extra-parameters rule, the deployment header, Azure's error bodies,
    and the dropped parameters listed in a response header."""
    data: dict[str, Any] | None = None
    try:
        check_api_version(request.query_params.get("api-version"))
        data = load_object(await request.body())
        body, dropped = translate(data, request.headers.get(EXTRA_PARAMETERS_HEADER))
        body = route_model(body, request.headers.get(AZURE_DEPLOYMENT_HEADER), AZURE_DEPLOYMENT_HEADER,
                           app_state(request).deployments, default)
        response = await serve(request, body)
    except ApiError as exc:
        return error_response(exc, request.url.path, data)
    if dropped:
        # names are the client's: percent-encoded, so that any name makes a valid (and harmless) header value
        response.headers[DROPPED_PARAMETERS_HEADER] = ",".join(quote(name, safe="_-.~") for name in dropped)
    return response


async def _chat(request: Request, body: dict[str, Any]) -> Response:
    return await generate(request, validate(body, ChatCompletionRequest), app_state(request).services.chat)


async def _embeddings(request: Request, body: dict[str, Any]) -> Response:
    return await embed(request, validate(body, EmbeddingRequest), app_state(request).services.embeddings)


async def azure_chat(request: Request) -> Response:
    return await _azure(request, azure_chat_body, default_model, _chat)


async def azure_embeddings(request: Request) -> Response:
    """Azure AI model inference's embeddings (azure-ai-inference's EmbeddingsClient)."""
    return await _azure(request, azure_embeddings_body, default_embedding_model, _embeddings)


async def azure_info(request: Request) -> Response:
    try:
        check_api_version(request.query_params.get("api-version"))
        name = route_model({}, request.headers.get(AZURE_DEPLOYMENT_HEADER), AZURE_DEPLOYMENT_HEADER,
                           app_state(request).deployments)["model"]
    except ApiError as exc:
        return error_response(exc, request.url.path)
    return JSONResponse({"model_name": name, "model_type": "chat-completion", "model_provider_name": "servelm"})


# -- SageMaker / DJL LMI ----------------------------------------------------------------------
async def invocations(request: Request) -> Response:
    state = app_state(request)
    data = load_object(await request.body())
    target = sagemaker_target(request.headers.get(SAGEMAKER_TARGET_HEADER))
    data = route_model(data, target, "X-Amzn-SageMaker-Target-Model", state.deployments)
    kind = invocation_kind(data)
    framing = JSONLINES if _wants_jsonlines(request.headers.get("accept", ""), kind) else SSE
    if kind == "chat":
        return await generate(request, validate(data, ChatCompletionRequest), state.services.chat, framing)
    if kind == "completion":
        return await generate(request, validate(data, CompletionRequest), state.services.completions, framing)
    return await generate(request, validate(data, DjlRequest), state.services.native, framing)


async def ping(request: Request) -> JSONResponse:
    ok = app_state(request).deployments.all_alive()
    return JSONResponse({"status": "Healthy" if ok else "Unhealthy"}, status_code=200 if ok else 503)


# -- OpenVINO Model Server --------------------------------------------------------------------
async def ovms_chat(request: Request) -> Response:
    data = ovms_body(load_object(await request.body()))
    return await generate(request, validate(data, ChatCompletionRequest), app_state(request).services.chat)


async def ovms_legacy_completions(request: Request) -> Response:
    data = ovms_body(load_object(await request.body()))
    return await generate(request, validate(data, CompletionRequest), app_state(request).services.ovms_completions)


_AZURE_HEADERS = [{"name": EXTRA_PARAMETERS_HEADER, "schema": {"type": "string", "enum": list(EXTRA_PARAMETER_MODES)}},
                  {"name": AZURE_DEPLOYMENT_HEADER, "schema": {"type": "string"}}]
ROUTES = (
    Route("POST", "/chat/completions", azure_chat, doc(
        request=ChatCompletionRequest, response=ChatCompletion, streams="text/event-stream", query=[API_VERSION],
        headers=_AZURE_HEADERS)),
    Route("POST", "/embeddings", azure_embeddings, doc(
        request=EmbeddingRequest, response=EmbeddingResponse, query=[API_VERSION], headers=_AZURE_HEADERS)),
    Route("GET", "/info", azure_info, doc(query=[API_VERSION])),
    Route("POST", "/invocations", invocations, doc(
        request=[ChatCompletionRequest, CompletionRequest, DjlRequest], streams=JSONLINES.media_type,
        headers=[{"name": SAGEMAKER_TARGET_HEADER, "schema": {"type": "string"}}])),
    Route("GET", "/ping", ping),
    Route("POST", "/v3/chat/completions", ovms_chat,
          doc(request=ChatCompletionRequest, response=ChatCompletion, streams="text/event-stream")),
    Route("POST", "/v3/completions", ovms_legacy_completions,
          doc(request=CompletionRequest, response=Completion, streams="text/event-stream")),
)


# -- parsing ----------------------------------------------------------------------------------------


def load_object(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object (a dialect rewrites it before validation); else the usual 400s."""
    check_json_containers(raw)
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise invalid_json() from None
    if not isinstance(data, dict):
        raise InvalidParameter("The request body must be a JSON object.", None, "invalid_type")
    return data


def validate(data: dict[str, Any], model: type[M]) -> M:
    """The body, parsed once by load_object and rewritten by the dialect, as the typed request. Every value came
    from JSON, so the strict Python mode takes exactly what the /v1 routes' JSON mode takes."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise validation_error(exc, model) from None


# -- streaming ----------------------------------------------------------------------------------------


def _wants_jsonlines(accept: str, kind: str) -> bool:
    """jsonlines where DJL streams that way (chat and the native schema), SSE for completions; an Accept
    header naming either picks it."""
    if JSONLINES.media_type in accept:
        return True
    if "text/event-stream" in accept:
        return False
    return kind in ("chat", "native")
