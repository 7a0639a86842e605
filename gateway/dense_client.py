"""The gateway's gRPC client of the dense service (grpc.aio); it caches the model's description."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tandem.v1 import dense_pb2 as pb
from tandem.v1 import dense_pb2_grpc as pb_grpc


class DenseClient:
    def __init__(self, address: str):
        self.address = address
        self._channel = None
        self._info: pb.GetModelInfoResponse | None = None

    @property
    def channel(self) -> grpc.aio.Channel:
        """Made on first use, inside the event loop that serves requests (aio channels are per loop)."""
        if self._channel is None:
            self._channel = grpc.aio.insecure_channel(self.address)
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
        """Streams the responses; leaving the iteration early (or a cancelled task) cancels the call."""
        call = self.stub.Generate(request, metadata=metadata)
        try:
            async for response in call:
                yield response
        finally:
            call.cancel()

    async def tokenize(self, text: str, add_special_tokens: bool) -> list[int]:
        reply = await self.stub.Tokenize(pb.TokenizeRequest(text=text, add_special_tokens=add_special_tokens),
                                         timeout=10)
        return list(reply.token_ids)

    async def detokenize(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        reply = await self.stub.Detokenize(pb.DetokenizeRequest(token_ids=ids, skip_special_tokens=skip_special_tokens),
                                           timeout=10)
        return reply.text

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
