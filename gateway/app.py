"""build_app: the OpenAI-compatible HTTP front of the dense service.

One error shape everywhere (gateway.errors); the body size limit and the API key are checked
before any handler runs; a dense-service error becomes its HTTP status in one place.
"""

from __future__ import annotations

import hmac
import logging

import grpc
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from gateway.chat.router import router as chat_router
from gateway.completions.router import router as completions_router
from gateway.config import GatewayConfig
from gateway.dense_client import DensePool
from gateway.errors import ApiError, ErrorBody, FieldError, from_grpc
from gateway.metrics import Metrics
from gateway.messages.router import router as messages_router
from gateway.models.router import router as models_router
from gateway.tokenize.router import router as tokenize_router

log = logging.getLogger(__name__)
OPEN_PATHS = ("/health", "/health/live", "/metrics", "/docs", "/openapi.json")


class GatewayState:
    """What handlers reach through request.app.state."""

    def __init__(self, config: GatewayConfig, client):
        self.config, self.client, self.metrics = config, client, Metrics()

    async def call(self, awaitable):
        try:
            return await awaitable
        except grpc.aio.AioRpcError as exc:
            raise from_grpc(exc, self.config.retry_after_s) from exc

    async def check_model(self, name: str | None) -> None:
        info = await self.call(self.client.info())
        if name is not None and name != info.name:
            raise ApiError(404, f"model {name!r} does not exist; this server serves {info.name!r}", "model",
                           "model_not_found")


class BodyLimit:
    """413 for a body over the limit, by its Content-Length or as it streams in."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            return await self._refuse(scope, receive, send)
        seen = 0

        async def limited():
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.limit:
                raise ApiError(413, f"request body over {self.limit} bytes")
            return message

        try:
            await self.app(scope, limited, send)
        except ApiError as exc:
            await exc.response()(scope, receive, send)

    async def _refuse(self, scope, receive, send):
        await ApiError(413, f"request body over {self.limit} bytes").response()(scope, receive, send)


def _validation_error(exc: RequestValidationError) -> ApiError:
    first = exc.errors()[0] if exc.errors() else {}
    if first.get("type") == "json_invalid":
        return ApiError(400, f"malformed JSON: {first.get('ctx', {}).get('error', 'cannot parse the body')}")
    error = first.get("ctx", {}).get("error")
    if isinstance(error, FieldError):
        return ApiError(400, str(error), error.param, "invalid_value")
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    param = ".".join(loc) or None
    return ApiError(400, f"{param or 'body'}: {first.get('msg', 'invalid value')}", param, "invalid_value")


def _install_errors(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError):
        return _validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        return ApiError(exc.status_code, str(exc.detail)).response()

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception):
        log.exception("unexpected error")
        return ApiError(500, f"internal error: {type(exc).__name__}").response()

    @app.exception_handler(grpc.aio.AioRpcError)
    async def dense_error(request: Request, exc: grpc.aio.AioRpcError):
        return from_grpc(exc, request.app.state.config.retry_after_s).response()


def _install_auth(app: FastAPI, key: str) -> None:
    @app.middleware("http")
    async def api_key(request: Request, call_next):
        if request.url.path not in OPEN_PATHS:
            given = request.headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {key}".encode()):
                return ApiError(401, "missing or wrong API key (Authorization: Bearer <key>)", None,
                                "invalid_api_key").response()
        return await call_next(request)


def _install_ops(app: FastAPI) -> None:
    @app.get("/health", responses={503: {"model": ErrorBody}})
    async def health(request: Request):
        if await request.app.state.client.serving():
            return {"status": "ok"}
        return ApiError(503, "the dense service or one of its expert servers is not serving").response()

    @app.get("/health/live")
    async def live():
        """This process answers (a liveness probe: the rest of the stack may still be down)."""
        return {"status": "ok"}

    @app.get("/metrics", response_class=Response)
    async def metrics(request: Request):
        state = request.app.state
        stats = await state.client.stats()
        if len(stats) < len(state.config.dense_addresses):
            log.warning("dense service unreachable for stats: %s",
                        ", ".join(a for a in state.config.dense_addresses if a not in stats))
        state.metrics.engine(stats)
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)


def build_app(config: GatewayConfig, client=None) -> FastAPI:
    app = FastAPI(title="Tandem", version="0.1.0", description="OpenAI-compatible API of a Tandem MoE server")
    state = GatewayState(config, client or DensePool(config.dense_addresses))
    for name in ("config", "client", "metrics", "call", "check_model"):
        setattr(app.state, name, getattr(state, name))
    _install_errors(app)
    if config.api_key:
        _install_auth(app, config.api_key)
    _install_ops(app)
    for router in (models_router, chat_router, completions_router, messages_router, tokenize_router):
        app.include_router(router)
    app.add_middleware(BodyLimit, limit=config.max_body_bytes)
    return app
