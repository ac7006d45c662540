"""Bounds on what a client may send: message size, every field, members per job, jobs per coordinator.

gRPC's own ``max_receive_message_length`` is the hard cap (set a little above the
policy limit by the server assembly, so memory stays bounded); this interceptor
enforces the policy limit with a message naming the method, the size and the
option that raises it. Control-plane messages are small (a capability set, a
plan per replica); only a plan for a very large fleet or many IPC handles
approaches the default 4 MiB.

Within that size every field is bounded too (``check_fields``), because what one
member sends is kept and repeated to every other: a 4 MB member id, registered a
few times, would make every ``GetJob`` answer too large for anyone. The walk
covers every field of every request, so a field added to the proto is bounded by
default; ``FIELD_LIMITS`` names the few that may be longer. The core bounds member
and job counts (``state.MAX_MEMBERS_PER_JOB``, ``state.MAX_JOBS``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc  # type: ignore[import-untyped,unused-ignore]  # types-grpcio is not a dependency yet

from weightsync.coordinator import faults, serde
from weightsync.coordinator.state import MAX_MEMBERS_PER_JOB

DEFAULT_MAX_MESSAGE_BYTES = 4 << 20
MAX_TEXT = 253
"""Characters in a string field: a DNS name's length (member ids are pod names, hosts are host names)."""
MAX_ITEMS = 64
"""Entries in a repeated field (GPUs of a replica, channels, offers)."""
MAX_BYTES = 4096
"""Bytes in a bytes field."""
MAX_RANKS = 1024
"""Trainer ranks a sharded trainer may have, and workers a replica (one GPU each)."""
MAX_TENSORS = 1 << 20
"""Entries a layout lists once per tensor (a table's tensors and placements, a worker's parameters and fills;
Kimi-K2's checkpoint has about 70,000 tensors): bounded by the message size only. A layout is one member's, read by
the planner and never repeated to the others."""
COUNT_LIMITS: dict[str, int] = {
    "gpu_uuids": 16,  # a replica's GPUs: one node's
    "devices": 16,  # the GPUs a sender's buffers live on
    "rank_gpu_uuids": MAX_RANKS,  # a sharded trainer's ranks' GPUs
    "peer_gpu_uuids": 16,  # the other GPUs of a replica's node
    "failed": MAX_MEMBERS_PER_JOB,  # the receivers a publisher lost
    "lost": MAX_MEMBERS_PER_JOB,  # the receivers a publisher lost while the version is under way
    "region_digests": MAX_MEMBERS_PER_JOB,  # one per replica a version's plan sent regions
    # the layouts (TrainerLayout, EngineLayout)
    "tensors": MAX_TENSORS,
    "placements": MAX_TENSORS,
    "group_starts": MAX_TENSORS,
    "meshes": MAX_TENSORS,  # one per distinct holder set: each expert a fused expert parameter's shard holds whole
    "ranks": MAX_RANKS,  # a device mesh's ranks
    "workers": MAX_RANKS,
    "params": MAX_TENSORS,
    "fills": MAX_TENSORS,
}
"""Repeated fields with their own bound on entries, by field name (each entry keeps its type's bound)."""
FIELD_LIMITS: dict[str, int] = {
    "incarnation": 64,
    "error": serde.MAX_ERROR_CHARS,  # a failure's text, kept per replica in the version's record
    "volume_error": serde.MAX_ERROR_CHARS,  # why the publisher's volume copy failed (an OS error names paths)
    "manifest_path": 1024,
    "volume_mount": 1024,
    "root": 1024,
    "metadata": 1 << 20,  # NIXL's agent metadata
}
"""String and bytes fields with their own bound on length, by field name. With these, the largest ``GetJob``
answer (every member at every bound) stays within the default message limit."""


def check_fields(message: Any, path: str = "") -> None:
    """Raise ``faults.InvalidArgument`` naming the first field of ``message`` (recursively) over its bound."""
    for fd, value in message.ListFields():
        where = f"{path}{fd.name}"
        if fd.is_repeated:
            limit = COUNT_LIMITS.get(fd.name, MAX_ITEMS)
            if len(value) > limit:
                raise faults.InvalidArgument(f"{where} has {len(value)} entries, over the limit of {limit}")
            for i, item in enumerate(value):
                _check_value(fd, item, f"{where}[{i}]", entry=True)
        else:
            _check_value(fd, value, where)


def _check_value(fd: Any, value: Any, where: str, entry: bool = False) -> None:
    if fd.type == fd.TYPE_MESSAGE:
        check_fields(value, where + ".")
        return
    if fd.type in (fd.TYPE_STRING, fd.TYPE_BYTES):
        default = MAX_TEXT if fd.type == fd.TYPE_STRING else MAX_BYTES
        limit = default if entry else FIELD_LIMITS.get(fd.name, default)
        if len(value) > limit:
            unit = "characters" if fd.type == fd.TYPE_STRING else "bytes"
            raise faults.InvalidArgument(f"{where} is {len(value)} {unit}, over the limit of {limit}")


class SizeLimitInterceptor(grpc.ServerInterceptor):  # type: ignore[misc,unused-ignore]
    def __init__(self, max_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> None:
        self.max_bytes = max_bytes

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        method, limit = handler_call_details.method, self.max_bytes

        def check(request: Any, context: grpc.ServicerContext) -> None:
            size = request.ByteSize()
            if size > limit:
                context.abort(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"{method}: request is {size} bytes, over the limit of {limit}; "
                    "raise the coordinator's --max-message-bytes if this is expected",
                )
            try:
                check_fields(request)
            except faults.InvalidArgument as e:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{method}: {e}")

        if handler.unary_unary is not None:
            inner_uu = handler.unary_unary

            def unary(request: Any, context: grpc.ServicerContext) -> Any:
                check(request, context)
                return inner_uu(request, context)

            return handler._replace(unary_unary=unary)  # type: ignore[attr-defined,no-any-return,unused-ignore]
        if handler.unary_stream is not None:
            inner_us = handler.unary_stream

            def stream(request: Any, context: grpc.ServicerContext) -> Any:
                check(request, context)
                yield from inner_us(request, context)

            return handler._replace(unary_stream=stream)  # type: ignore[attr-defined,no-any-return,unused-ignore]
        return handler
