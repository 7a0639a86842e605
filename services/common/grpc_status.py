"""Domain errors to gRPC status codes: the one mapping every servicer uses at its edge."""

from __future__ import annotations

import grpc

from services.common.errors import (CancelledError, CheckpointError, ConfigError, ExpertBackendError,
                                    InvalidRequestError, ResourceExhaustedError, TandemError)

_BY_TYPE = (
    (InvalidRequestError, grpc.StatusCode.INVALID_ARGUMENT),
    (ResourceExhaustedError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (ConfigError, grpc.StatusCode.FAILED_PRECONDITION),
    (CheckpointError, grpc.StatusCode.FAILED_PRECONDITION),
)
# an expert call's status as the dense service reports it: the client sent nothing wrong
_EXPERT = {"UNAVAILABLE": grpc.StatusCode.UNAVAILABLE, "DEADLINE_EXCEEDED": grpc.StatusCode.UNAVAILABLE}


def status_of(exc: TandemError) -> grpc.StatusCode:
    if isinstance(exc, CancelledError):
        return grpc.StatusCode.DEADLINE_EXCEEDED if exc.deadline else grpc.StatusCode.CANCELLED
    if isinstance(exc, ExpertBackendError):
        return _EXPERT.get(exc.code, grpc.StatusCode.INTERNAL)
    for kind, code in _BY_TYPE:
        if isinstance(exc, kind):
            return code
    return grpc.StatusCode.INTERNAL


def abort(context: grpc.ServicerContext, exc: TandemError) -> None:
    """Ends the RPC with the error's status and message (raises, as context.abort does)."""
    context.abort(status_of(exc), str(exc))
