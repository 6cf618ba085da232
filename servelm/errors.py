"""The error hierarchy. Raised anywhere, rendered once (http/errors.py) as the OpenAI error envelope:
{"error": {"message", "type", "param", "code"}} with the status of the class."""

from __future__ import annotations


class ApiError(Exception):
    status: int = 500
    type: str = "server_error"

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code

    def body(self) -> dict:
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
