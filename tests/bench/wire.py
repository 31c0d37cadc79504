"""The wire floor of a Build: what moving the same request and response costs with no work in
between.

* ``serialize_parse``: protobuf alone, in process: the BuildRequest serialized and parsed and
  the BuildResponse serialized and parsed (the four codec steps of one gRPC call: the client
  serializes the request, the server parses it, the server serializes the response, the client
  parses it), on the exact messages of a warm Build.
* ``EchoServer``: a generic gRPC service on loopback, started like the service (``grpc.aio`` on
  the same event-loop thread, the service's server options, no interceptors), with two methods:

  - ``Echo``: identity serializers on both sides. The client sends the serialized BuildRequest
    as bytes; the server returns ``reply`` (the serialized BuildResponse of the same Build) or,
    when no reply is set, the request bytes. The round trip moves exactly Build's bytes each
    way, and no protobuf work is done: transport only.
  - ``EchoProto``: the same round trip with BuildRequest and BuildResponse as the codecs (the
    client serializes the request and parses the response, the server parses the request and
    serializes ``reply_message``): a Build that does nothing. A request naming a base
    (``base_build_id``) is answered ``incremental_reply`` instead: an incremental Build that
    does nothing, moving that Build's own request and delta response.

Both are called from a sync client channel with the options of the benchmark's Build channel,
timed around the call, as Build is.
"""

from __future__ import annotations

import time
from typing import Any

import grpc
from context_engine.v1 import context_engine_pb2 as pb

from tests.bench.common import Loop

SERVICE = "bench.Echo"
MESSAGE_LIMIT = 64 * 1024 * 1024
CLIENT_OPTIONS = [("grpc.max_receive_message_length", MESSAGE_LIMIT),
                  ("grpc.max_send_message_length", MESSAGE_LIMIT)]


def serialize_parse(request: pb.BuildRequest,
                    response: pb.BuildResponse) -> tuple[float, tuple[float, ...]]:
    """(total ms, (request serialize, request parse, response serialize, response parse) ms)."""
    t0 = time.perf_counter()
    data = request.SerializeToString()
    t1 = time.perf_counter()
    pb.BuildRequest.FromString(data)
    t2 = time.perf_counter()
    body = response.SerializeToString()
    t3 = time.perf_counter()
    pb.BuildResponse.FromString(body)
    t4 = time.perf_counter()
    parts = tuple((b - a) * 1000 for a, b in ((t0, t1), (t1, t2), (t2, t3), (t3, t4)))
    return (t4 - t0) * 1000, parts


class EchoServer:
    def __init__(self, loop: Loop, options: list[tuple[str, int]]) -> None:
        self.loop = loop
        self.reply: bytes | None = None
        self.reply_message: pb.BuildResponse = pb.BuildResponse()
        self.incremental_reply: pb.BuildResponse = pb.BuildResponse()
        self.received = 0  # bytes of the last Echo request, as the server got them
        self.server, port = loop.call(self._start(options))
        self.channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=CLIENT_OPTIONS)
        self.echo: grpc.UnaryUnaryMultiCallable[bytes, bytes] = self.channel.unary_unary(
            f"/{SERVICE}/Echo")
        self.echo_proto: grpc.UnaryUnaryMultiCallable[pb.BuildRequest, pb.BuildResponse]
        self.echo_proto = self.channel.unary_unary(
            f"/{SERVICE}/EchoProto", request_serializer=pb.BuildRequest.SerializeToString,
            response_deserializer=pb.BuildResponse.FromString)

    async def _start(self, options: list[tuple[str, int]]) -> tuple[grpc.aio.Server, int]:
        server = grpc.aio.server(options=options)
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, {
            "Echo": grpc.unary_unary_rpc_method_handler(self._echo),
            "EchoProto": grpc.unary_unary_rpc_method_handler(
                self._echo_proto, request_deserializer=pb.BuildRequest.FromString,
                response_serializer=pb.BuildResponse.SerializeToString),
        }),))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        return server, port

    async def _echo(self, request: bytes, context: Any) -> bytes:
        self.received = len(request)
        return request if self.reply is None else self.reply

    async def _echo_proto(self, request: pb.BuildRequest, context: Any) -> pb.BuildResponse:
        return self.incremental_reply if request.base_build_id else self.reply_message

    def set_reply(self, response: pb.BuildResponse) -> None:
        self.reply = response.SerializeToString()
        self.reply_message = response

    def set_incremental_reply(self, response: pb.BuildResponse) -> None:
        """What ``EchoProto`` answers a request that names a base."""
        self.incremental_reply = response

    def timed_echo(self, data: bytes) -> tuple[float, bytes]:
        started = time.perf_counter()
        body: bytes = self.echo(data, timeout=60)
        return (time.perf_counter() - started) * 1000, body

    def timed_echo_proto(self, request: pb.BuildRequest) -> tuple[float, pb.BuildResponse]:
        started = time.perf_counter()
        response: pb.BuildResponse = self.echo_proto(request, timeout=60)
        return (time.perf_counter() - started) * 1000, response

    def close(self) -> None:
        self.channel.close()
        self.loop.call(self.server.stop(0))
