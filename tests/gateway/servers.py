"""A dense service and a gateway in this process, on free ports, for the gateway tests."""

from __future__ import annotations

import contextlib
import threading
import time

import uvicorn

from gateway.app import build_app
from gateway.config import GatewayConfig
from services.dense.app import start
from services.dense.config import DenseConfig
from services.dense.runtime import DenseRuntime


def dense(path, experts=None, **kw):
    cfg = DenseConfig(model=path, runtime=DenseRuntime("float32", "cpu"), experts="native", expert_format="int8",
                      threads=2, **{"kv_tokens": 4096, "listen": "127.0.0.1:0", **kw})
    return start(cfg, experts)


@contextlib.contextmanager
def gateway(dense_port: int | str, **kw):
    """Yields (base URL, app) of a gateway served by uvicorn in a thread (dense_port: a port on this
    host, or the --dense addresses)."""
    dense = dense_port if isinstance(dense_port, str) else f"127.0.0.1:{dense_port}"
    app = build_app(GatewayConfig(dense=dense, port=0, **kw))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}", app
    finally:
        server.should_exit = True
        thread.join(10)


@contextlib.contextmanager
def openai_stack(path):
    """Yields (openai client, served model name) of a dense service on path behind a gateway."""
    import openai

    running = dense(path)
    try:
        with gateway(running.port) as (url, _):
            client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
            yield client, client.models.list().data[0].id
    finally:
        running.stop(1)
