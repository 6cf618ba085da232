"""Every failure leaves as the OpenAI error envelope; this is the one place errors are rendered."""

from __future__ import annotations

import json
import logging
import re
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from servelm.errors import ApiError, InvalidParameter, NotFound


def error_parts(exc: ApiError, path: str | None = None, data: Any = None) -> tuple[int, dict[str, Any], dict[str, str]]:
    """An error's status, body and headers (WWW-Authenticate, Retry-After): the OpenAI envelope, or on Azure ML's
    paths Azure ML's shape (`data`: the request body, from which a 422 quotes the value it names)."""
    if path in AZURE_PATHS:
        return _azure_parts(exc, data)
    if path is not None and is_anthropic(path):
        return exc.status, anthropic_error(exc), dict(exc.headers)
    if path == COHERE_RERANK_PATH:  # Cohere's errors: {"message"}
        return exc.status, {"message": exc.message}, dict(exc.headers)
    if path == OVMS_RERANK_PATH:  # OpenVINO Model Server's: {"error": message}
        return exc.status, {"error": exc.message}, dict(exc.headers)
    return exc.status, exc.body(), dict(exc.headers)


def error_response(exc: ApiError, path: str | None = None, data: Any = None) -> JSONResponse:
    status, body, headers = error_parts(exc, path, data)
    return JSONResponse(body, status_code=status, headers=headers or None)


def error_json(exc: ApiError) -> bytes:
    """The envelope as JSON, for an error that travels inside a stream that has begun."""
    return json.dumps(exc.body()).encode()


log = logging.getLogger("servelm.http")


def install(app: FastAPI) -> None:
    @app.exception_handler(ClientDisconnect)
    async def _gone(request: Request, exc: ClientDisconnect) -> Response:
        # the client went away while its body was read: nobody to answer, nothing wrong with the server
        log.info("%s %s: the client disconnected while sending its body", request.method, request.url.path)
        return Response(status_code=499)

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return error_response(exc, request.url.path)

    @app.exception_handler(RequestValidationError)
    async def _fastapi_validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(query_error(exc), request.url.path)

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
        if exc.status_code == 404 and exc.detail == "Not Found":  # no route matched
            return error_response(unknown_route(request.method, request.url.path))
        kind = ApiError(str(exc.detail))
        kind.status = exc.status_code
        kind.type = "invalid_request_error" if exc.status_code < 500 else "server_error"
        kind.headers = dict(exc.headers or {})
        return error_response(kind, request.url.path)


def query_error(exc: RequestValidationError) -> ApiError:
    """A query or path parameter FastAPI could not read (`?limit=abc`): the first problem, naming its parameter;
    never FastAPI's own rendering, which quotes the route's source file and line."""
    errors = exc.errors()
    if not errors:
        return InvalidParameter("The request's parameters are not valid.", None)
    loc = [str(part) for part in errors[0].get("loc", ()) if part not in ("query", "path", "body", "header")]
    param = ".".join(loc) or None
    message = str(errors[0].get("msg", "not valid")).rstrip(".")
    return InvalidParameter(f"Invalid value for '{param}': {message}." if param else f"{message}.", param)


def unknown_route(method: str, path: str) -> ApiError:
    return NotFound(f"Unknown request URL: {method} {path}. See /openapi.json for the routes served.", code="not_found")


def validation_error(exc: ValidationError, model: type[BaseModel]) -> ApiError:
    """The first problem pydantic found, with `param` naming the field as OpenAI does (a.b[0].c); a list over its
    bound first (of a field that may be a string or a list, the string's complaint would mislead)."""
    errors = exc.errors()
    err = next((e for e in errors if e["type"] == "too_long"), errors[0])
    kind = err["type"]
    if kind == "json_invalid":
        return invalid_json()
    loc = err["loc"]
    names = _field_names(model) | ({loc[-1]} if kind == "extra_forbidden" and loc and isinstance(loc[-1], str) else set())
    param = _param(loc, frozenset(names))
    if not param and kind == "value_error":  # a rule over several fields (a model validator): in its own words
        message = str(err["msg"]).removeprefix("Value error, ")
        return _bad_request(f"{message[:1].upper()}{message[1:]}.", None, "invalid_value")
    if not param:
        return _bad_request("The request body must be a JSON object.", None, "invalid_type")
    if kind == "extra_forbidden":
        return _bad_request(f"Unrecognized request argument supplied: {param}", param, "unknown_parameter")
    if kind == "missing":
        return _bad_request(f"Missing required parameter: '{param}'.", param, "missing_required_parameter")
    code = "invalid_type" if kind.endswith("_type") or kind.endswith("_parsing") else "invalid_value"
    return _bad_request(f"Invalid value for '{param}': {err['msg']}.", param, code)


def invalid_json() -> ApiError:
    """A body that is not JSON: OpenAI's words for it."""
    return _bad_request("We could not parse the JSON body of your request. (HINT: This likely means you aren't using "
                        "your HTTP library correctly. The OpenAI API expects a JSON payload.)", None, None)


def _bad_request(message: str, param: str | None, code: str | None) -> ApiError:
    return InvalidParameter(message, param, code)


def _param(loc: tuple[Any, ...], names: frozenset[str]) -> str:
    out = ""
    last = None
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in names and part != last:
            out += f".{part}" if out else part
        last = part
    return out


def _field_names(model: type[BaseModel], seen: set[type] | None = None) -> frozenset[str]:
    seen = seen if seen is not None else set()
    if model in seen:
        return frozenset()
    seen.add(model)
    names = set(model.model_fields)
    for field in model.model_fields.values():
        for sub in _models_in(field.annotation):
            names |= _field_names(sub, seen)
    return frozenset(names)


def _models_in(annotation: object) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    out: list[type[BaseModel]] = []
    for arg in getattr(annotation, "__args__", ()) or ():
        out += _models_in(arg)
    for meta in getattr(annotation, "__metadata__", ()) or ():
        out += _models_in(meta)
    origin = getattr(annotation, "__origin__", None)
    if origin is not None and origin is not annotation and hasattr(annotation, "__metadata__"):
        out += _models_in(origin)
    return out


# -- Azure ML's error bodies ----------------------------------------------------------------------------
AZURE_PATHS = frozenset({"/chat/completions", "/embeddings", "/info"})  # where errors take Azure ML's shape
# Our 400s that Azure ML answers with 422: content or parameters this model cannot take.
AZURE_422_CODES = frozenset({"unsupported_content", "unsupported_parameter", "unknown_parameter"})
_AZURE_CODES = {400: "BadRequest", 401: "Unauthorized", 404: "NotFound", 413: "PayloadTooLarge", 415: "UnsupportedMediaType",
                422: "UnprocessableContent", 429: "TooManyRequests", 500: "InternalServerError",
                503: "ServiceUnavailable", 504: "GatewayTimeout"}


def _azure_parts(exc: ApiError, data: Any) -> tuple[int, dict[str, Any], dict[str, str]]:
    """The OpenAI envelope plus Azure ML's fields: `status` and `code` at the top (and `status` in `error`),
    `message`, and for a 422 `detail: {loc, value}` naming the parameter (`details`: every one, when the
    extra-parameters check found several). The `x-ms-error-code` header carries the code."""
    status = 422 if exc.status == 400 and exc.code in AZURE_422_CODES else exc.status
    if exc.code == "modality_not_supported":  # an image for a model that reads text: Azure ML's 404
        status = 404
    code = exc.code or _AZURE_CODES.get(status, exc.type)
    body = exc.body()
    body["error"]["status"] = status
    body.update(status=status, code=code, message=exc.message)
    if status == 422:
        names = getattr(exc, "names", None) or ([exc.param] if exc.param else [])
        details = [_detail(name, data) for name in names]
        if details:
            body["detail"] = body["error"]["detail"] = details[0]
            body["details"] = details
    headers = {**exc.headers, "x-ms-error-code": code}
    return status, body, headers


_PATH_PART = re.compile(r"([^.\[\]]+)|\[(\d+)\]")


def _detail(param: str, data: dict[str, Any] | None) -> dict[str, Any]:
    """Azure's Detail: loc ["body", "messages", 0, "content", 1] and the value sent there (as text)."""
    loc: list[str | int] = [int(i) if i else name for name, i in _PATH_PART.findall(param)]
    value: Any = data
    for part in loc:
        try:
            value = value[part]
        except (KeyError, IndexError, TypeError):
            value = None
            break
    text = value if isinstance(value, str) or value is None else json.dumps(value)
    if isinstance(text, str) and len(text) > 256:
        text = text[:256] + "…"
    return {"loc": ["body", *loc], "value": text}



# -- Anthropic's error bodies (the Messages API's paths) -----------------------------------------------------
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error",
                    504: "timeout_error"}


COHERE_RERANK_PATH = "/v2/rerank"
OVMS_RERANK_PATH = "/v3/rerank"


def is_anthropic(path: str) -> bool:
    return path == "/v1/messages" or path.startswith("/v1/messages/")


def anthropic_error(exc: ApiError) -> dict[str, Any]:
    """`{"type": "error", "error": {"type", "message"}}`, Anthropic's types by status."""
    kind = _ANTHROPIC_TYPES.get(exc.status, "invalid_request_error" if exc.status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": exc.message}}
