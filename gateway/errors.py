"""One error shape for every gateway response: {"error": {"message", "type", "param", "code"}}.

gRPC status codes from the dense service are mapped to HTTP here and nowhere else.
"""

from __future__ import annotations

import grpc
from fastapi.responses import JSONResponse
from pydantic import BaseModel

TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
         413: "invalid_request_error", 429: "rate_limit_error", 503: "service_unavailable", 500: "internal_error"}


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorBody(BaseModel):
    error: ErrorDetail


class FieldError(ValueError):
    """A request field's value is wrong in a way its type cannot say; param names the field."""

    def __init__(self, param: str, message: str):
        super().__init__(f"{param}: {message}")
        self.param = param


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        detail = ErrorDetail(message=self.message, type=TYPES.get(self.status, "error"), param=self.param,
                             code=self.code)
        return ErrorBody(error=detail).model_dump()

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


_HTTP = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.FAILED_PRECONDITION: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 503,
    grpc.StatusCode.CANCELLED: 503,
}


def from_grpc(exc: grpc.aio.AioRpcError, retry_after_s: int) -> ApiError:
    status = _HTTP.get(exc.code(), 500)
    details = exc.details() or exc.code().name
    param = details.split(":", 1)[0] if status == 400 and ":" in details.split(" ", 1)[0] else None
    headers = {"Retry-After": str(retry_after_s)} if status == 429 else None
    return ApiError(status, details, param, exc.code().name.lower(), headers)


ERROR_RESPONSES = {code: {"model": ErrorBody, "description": TYPES[code]} for code in (400, 401, 404, 413, 429, 503)}
