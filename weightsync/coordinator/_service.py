"""The service table, built from the proto's descriptor instead of generated ``_pb2_grpc`` code.

Why: ``*_pb2_grpc.py`` refuses to import on a grpcio older than the grpcio-tools
that generated it, and the GPU hosts run older grpcio than this machine. The
descriptor already names every method, its message types and whether it streams,
so the server's handlers and the client's callables come from it and cannot drift
from the ``.proto``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import grpc  # type: ignore[import-untyped,unused-ignore]  # types-grpcio is not a dependency yet
from google.protobuf.message import Message

from weightsync.coordinator._proto import coordinator_pb2 as pb

SERVICE = "weightsync.v1.Coordinator"


@dataclass(frozen=True)
class Method:
    name: str
    path: str
    request: type[Message]
    response: type[Message]
    server_streaming: bool


def methods() -> dict[str, Method]:
    service = pb.DESCRIPTOR.services_by_name["Coordinator"]
    out = {}
    for m in service.methods:
        if m.client_streaming:
            raise NotImplementedError(f"{m.full_name}: client streaming is not supported by this table")
        out[m.name] = Method(
            m.name,
            f"/{SERVICE}/{m.name}",
            getattr(pb, m.input_type.name),
            getattr(pb, m.output_type.name),
            m.server_streaming,
        )
    return out


def handler(implementations: Mapping[str, Callable[[Any, grpc.ServicerContext], Any]]) -> grpc.GenericRpcHandler:
    """A generic handler serving ``implementations`` (method name -> behaviour); every method must be present."""
    table = methods()
    missing = sorted(set(table) - set(implementations))
    if missing:
        raise TypeError(f"no implementation for {missing}")
    handlers = {}
    for name, m in table.items():
        make = grpc.unary_stream_rpc_method_handler if m.server_streaming else grpc.unary_unary_rpc_method_handler
        handlers[name] = make(
            implementations[name],
            request_deserializer=m.request.FromString,
            response_serializer=m.response.SerializeToString,
        )
    return grpc.method_handlers_generic_handler(SERVICE, handlers)


def stubs(channel: grpc.Channel) -> dict[str, Any]:
    """Client callables per method name (``unary_unary`` or ``unary_stream`` multi-callables)."""
    out: dict[str, Any] = {}
    for name, m in methods().items():
        make = channel.unary_stream if m.server_streaming else channel.unary_unary
        out[name] = make(
            m.path, request_serializer=m.request.SerializeToString, response_deserializer=m.response.FromString
        )
    return out
