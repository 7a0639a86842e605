"""The gateway's gRPC clients of the dense services (grpc.aio): one DenseClient per service (it
caches the model's description), and the DensePool of them that the handlers use: each generation
goes to the least-loaded healthy service, a service that does not answer is skipped for a while."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tandem.v1 import dense_pb2 as pb
from tandem.v1 import dense_pb2_grpc as pb_grpc

DOWN_S = 3.0  # a service that did not answer is skipped this long, then tried again
GONE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
# A restarted dense service is found again within a second (gRPC's default backoff grows to 120 s).
CHANNEL_OPTIONS = [("grpc.initial_reconnect_backoff_ms", 200), ("grpc.min_reconnect_backoff_ms", 200),
                   ("grpc.max_reconnect_backoff_ms", 1000)]


class DenseClient:
    def __init__(self, address: str):
        self.address = address
        self._channel = None
        self._generate: dict[int, grpc.aio.Channel] = {}  # by grpc++ Generate port (a restart may change it)
        self._info: pb.GetModelInfoResponse | None = None

    @property
    def channel(self) -> grpc.aio.Channel:
        """Made on first use, inside the event loop that serves requests (aio channels are per loop)."""
        if self._channel is None:
            self._channel = grpc.aio.insecure_channel(self.address, options=CHANNEL_OPTIONS)
        return self._channel

    @property
    def stub(self) -> pb_grpc.DenseServiceStub:
        return pb_grpc.DenseServiceStub(self.channel)

    @property
    def health_stub(self) -> health_pb2_grpc.HealthStub:
        return health_pb2_grpc.HealthStub(self.channel)

    async def info(self) -> pb.GetModelInfoResponse:
        if self._info is None:
            self._info = await self.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
        return self._info

    async def serving(self) -> bool:
        try:
            reply = await self.health_stub.Check(health_pb2.HealthCheckRequest(), timeout=2)
        except grpc.aio.AioRpcError:
            return False
        return reply.status == health_pb2.HealthCheckResponse.SERVING

    async def stats(self) -> pb.GetStatsResponse:
        return await self.stub.GetStats(pb.GetStatsRequest(), timeout=2)

    async def generate(self, request: pb.GenerateRequest, metadata=()) -> AsyncIterator[pb.GenerateResponse]:
        """Streams the responses, from the service's grpc++ Generate port where it has one; leaving the
        iteration early (or a cancelled task) cancels the call. A grpc++ port that does not answer (the
        service restarted on another) is forgotten and the call made on the service's own port."""
        native = await self._generate_stub()
        call = (native or self.stub).Generate(request, metadata=metadata)
        started = False
        try:
            async for response in call:
                started = True
                yield response
        except grpc.aio.AioRpcError as exc:
            if native is None or started or exc.code() != grpc.StatusCode.UNAVAILABLE:
                raise
            self._info = None  # asked again by the next call
            call = self.stub.Generate(request, metadata=metadata)
            async for response in call:
                yield response
        finally:
            call.cancel()

    async def _generate_stub(self) -> pb_grpc.DenseServiceStub | None:
        """A stub on the port GetModelInfo names for Generate (generate_port), None without one."""
        try:
            port = (await self.info()).generate_port
        except grpc.aio.AioRpcError:
            return None  # the call on the service's own port reports what is wrong
        if not port:
            return None
        if port not in self._generate:
            host = self.address.rsplit(":", 1)[0]
            self._generate[port] = grpc.aio.insecure_channel(f"{host}:{port}", options=CHANNEL_OPTIONS)
        return pb_grpc.DenseServiceStub(self._generate[port])

    async def tokenize(self, text: str, add_special_tokens: bool) -> list[int]:
        reply = await self.stub.Tokenize(pb.TokenizeRequest(text=text, add_special_tokens=add_special_tokens),
                                         timeout=10)
        return list(reply.token_ids)

    async def detokenize(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        reply = await self.stub.Detokenize(pb.DetokenizeRequest(token_ids=ids, skip_special_tokens=skip_special_tokens),
                                           timeout=10)
        return reply.text

    async def close(self) -> None:
        for channel in self._generate.values():
            await channel.close()
        if self._channel is not None:
            await self._channel.close()


class DensePool:
    """Dense services that serve one model, behind the one client interface the handlers use.

    A generation goes to the healthy service with the fewest running + waiting requests (each one's
    GetStats, asked per request; ties go to the one this gateway has fewer streams open to); one
    that does not answer (UNAVAILABLE, a deadline) is skipped for DOWN_S, and a generation that it
    refused before its first response is sent to the next. Model info and tokenizing ask the first
    service that answers."""

    def __init__(self, addresses: list[str]):
        self.clients = [DenseClient(a) for a in addresses]
        self._down_until = {a: 0.0 for a in addresses}
        self._open = {a: 0 for a in addresses}

    def _up(self) -> list[DenseClient]:
        now = time.monotonic()
        return [c for c in self.clients if self._down_until[c.address] <= now] or self.clients

    def _down(self, client: DenseClient) -> None:
        self._down_until[client.address] = time.monotonic() + DOWN_S

    async def _first(self, call):
        """call(client) on the first service up that answers."""
        error = None
        for client in self._up():
            try:
                return await call(client)
            except grpc.aio.AioRpcError as exc:
                if exc.code() not in GONE or len(self.clients) == 1:
                    raise
                self._down(client)
                error = exc
        raise error

    async def info(self) -> pb.GetModelInfoResponse:
        return await self._first(lambda c: c.info())

    async def tokenize(self, text: str, add_special_tokens: bool) -> list[int]:
        return await self._first(lambda c: c.tokenize(text, add_special_tokens))

    async def detokenize(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return await self._first(lambda c: c.detokenize(ids, skip_special_tokens))

    async def serving(self) -> bool:
        """Whether any service is serving (the others are skipped until they are again)."""
        states = await asyncio.gather(*(c.serving() for c in self.clients))
        for client, ok in zip(self.clients, states):
            if ok:
                self._down_until[client.address] = 0.0
            else:
                self._down(client)
        return any(states)

    async def stats(self) -> dict[str, pb.GetStatsResponse]:
        """Each service's stats, by address; the ones that do not answer are left out."""
        replies = await asyncio.gather(*(c.stats() for c in self.clients), return_exceptions=True)
        return {c.address: r for c, r in zip(self.clients, replies) if isinstance(r, pb.GetStatsResponse)}

    async def _ranked(self) -> list[DenseClient]:
        """The services up, least loaded first; those whose stats did not come are dropped (all kept
        when none came, so the caller gets the real error)."""
        up = self._up()
        if len(up) == 1:
            return up
        replies = await asyncio.gather(*(c.stats() for c in up), return_exceptions=True)
        loads = []
        for i, (client, r) in enumerate(zip(up, replies)):
            if isinstance(r, pb.GetStatsResponse):
                loads.append((r.running + r.waiting, self._open[client.address], i, client))
            else:
                self._down(client)
        return [x[-1] for x in sorted(loads)] or up

    async def generate(self, request: pb.GenerateRequest, metadata=()) -> AsyncIterator[pb.GenerateResponse]:
        ranked = await self._ranked()
        for n, client in enumerate(ranked):
            self._open[client.address] += 1
            stream, started = client.generate(request, metadata), False
            try:
                async for response in stream:
                    started = True
                    yield response
                return
            except grpc.aio.AioRpcError as exc:
                if started or exc.code() not in GONE or n == len(ranked) - 1:
                    raise
                self._down(client)
            finally:
                self._open[client.address] -= 1
                await stream.aclose()

    async def close(self) -> None:
        for client in self.clients:
            await client.close()
