"""The error hierarchy. Raised anywhere, rendered once (http/errors.py) as the OpenAI error envelope:
{"error": {"message", "type", "param", "code"}} with the status of the class."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class ApiError(Exception):
    status: int = 500
    type: str = "server_error"

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
        self.headers: dict[str, str] = {}  # sent with the error (WWW-Authenticate, Retry-After)

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class ClientError(ApiError):
    status = 400
    type = "invalid_request_error"


class InvalidParameter(ClientError):
    """A parameter is missing, of the wrong type, out of range, or not supported here."""

    def __init__(self, message: str, param: str | None, code: str | None = "invalid_value") -> None:
        super().__init__(message, param=param, code=code)


class ContextLengthExceeded(ClientError):
    def __init__(self, message: str, param: str = "messages") -> None:
        super().__init__(message, param=param, code="context_length_exceeded")


class ConstraintFailed(ClientError):
    """A grammar that compiled but could not be followed while the answer was made (it grew past the grammar
    engine's per-step limits): the request fails rather than silently giving unconstrained or empty output."""

    def __init__(self, message: str, param: str | None) -> None:
        super().__init__(message, param=param, code="grammar_too_complex")


class ContentFiltered(ClientError):
    """A prompt the policy blocks (the seed's ContentFilterError): 400 `content_filter`, `param` naming it, and
    Azure OpenAI's innererror with the filter's results."""

    def __init__(self, param: str, categories: Sequence[str], results: dict[str, Any]) -> None:
        super().__init__(f"The prompt was filtered by this deployment's content policy ({', '.join(categories)}). "
                         "Modify the prompt and try again.", param=param, code="content_filter")
        self.results = results

    def body(self) -> dict[str, Any]:
        body = super().body()
        body["error"]["innererror"] = {"code": "ResponsibleAIPolicyViolation", "content_filter_result": self.results}
        return body


class UnprocessableContent(ClientError):
    """Well-formed, but holding something this model or contract cannot take (Azure ML's 422)."""

    status = 422


class NotFound(ClientError):
    status = 404


class ModelNotFound(NotFound):
    def __init__(self, model: str) -> None:
        super().__init__(
            f"The model `{model}` does not exist or you do not have access to it.",
            param="model",
            code="model_not_found",
        )


class ServerError(ApiError):
    status = 500
    type = "server_error"


class ServiceUnavailable(ServerError):
    status = 503


class Unauthorized(ClientError):
    status = 401

    def __init__(self, message: str, challenge: str = "Bearer") -> None:
        super().__init__(message, code="invalid_api_key")
        self.headers = {"WWW-Authenticate": challenge}


class Forbidden(ClientError):
    status = 403
    type = "permission_error"

    def __init__(self, message: str) -> None:
        super().__init__(message, code="forbidden")


class PayloadTooLarge(ClientError):
    status = 413

    def __init__(self, limit: int) -> None:
        super().__init__(f"The request body is larger than this server accepts ({limit} bytes).",
                         code="request_too_large")


class UnsupportedMediaType(ClientError):
    status = 415

    def __init__(self, got: str | None) -> None:
        what = f"`{got}`" if got else "no Content-Type"
        super().__init__(f"This endpoint takes a JSON body with `Content-Type: application/json`; the request had "
                         f"{what}.", code="unsupported_media_type")


class RateLimited(ClientError):
    """429 with Retry-After (whole seconds). kind is OpenAI's error type: "requests" or "tokens"."""

    status = 429

    def __init__(self, message: str, retry_after: float, *, kind: str = "requests",
                 code: str = "rate_limit_exceeded") -> None:
        super().__init__(message, code=code)
        self.type = kind
        self.retry_after = max(1, int(-(-retry_after // 1)))
        self.headers = {"Retry-After": str(self.retry_after)}


class QueueFull(RateLimited):
    def __init__(self, waiting: int, what: str | None = None, retry_after: float = 1) -> None:
        what = what or f"The deployment's queue is full ({waiting} requests waiting)"
        super().__init__(f"{what}; retry later.", retry_after, kind="server_overloaded", code="queue_full")


class RequestTimeout(ServerError):
    status = 504

    def __init__(self, seconds: float) -> None:
        super().__init__(f"The request did not finish within the server's deadline of {seconds:g} s; it was "
                         "stopped.", code="request_timeout")
        self.type = "timeout"
