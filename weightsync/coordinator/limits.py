"""Message size limits: a clear RESOURCE_EXHAUSTED before a large message costs anything more.

gRPC's own ``max_receive_message_length`` is the hard cap (set a little above the
policy limit by the server assembly, so memory stays bounded); this interceptor
enforces the policy limit with a message naming the method, the size and the
option that raises it. Control-plane messages are small (a capability set, a
plan per replica); only a plan for a very large fleet or many IPC handles
approaches the default 4 MiB.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc  # type: ignore[import-untyped,unused-ignore]  # types-grpcio is not a dependency yet

DEFAULT_MAX_MESSAGE_BYTES = 4 << 20


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
