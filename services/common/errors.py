"""Domain errors shared by every service.

Each service maps these once at its edge: to gRPC status codes in its servicer, to OpenAI error
bodies in the gateway. Nothing below the edges raises anything else on purpose.
"""

from __future__ import annotations


class TandemError(Exception):
    """Base of every domain error."""


class ConfigError(TandemError):
    """A configuration (config.json, a flag) is missing, unsupported or inconsistent."""


class CheckpointError(TandemError):
    """A checkpoint file or tensor is missing, truncated, corrupt, or of the wrong shape or dtype."""


class InvalidRequestError(TandemError):
    """A caller's request is malformed (bad sampling parameters, over-long prompt...)."""


class ResourceExhaustedError(TandemError):
    """A bounded resource (KV cache, request queue) cannot take more now."""


class CancelledError(TandemError):
    """A request was cancelled by its client or ran past its deadline."""

    def __init__(self, message: str, deadline: bool = False):
        super().__init__(message)
        self.deadline = deadline


class ExpertBackendError(TandemError):
    """An expert backend failed to compute a layer; carries the layer, the cause, and a status code
    name (a gRPC StatusCode name: INVALID_ARGUMENT, UNAVAILABLE, DEADLINE_EXCEEDED, INTERNAL)."""

    def __init__(self, layer: int, cause: str, code: str = "INTERNAL"):
        super().__init__(f"expert backend failed at layer {layer} ({code}): {cause}")
        self.layer = layer
        self.cause = cause
        self.code = code
