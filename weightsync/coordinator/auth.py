"""Bearer-token interceptor: every call must carry ``authorization: Bearer <token>``.

The token is a shared secret (a Kubernetes Secret, or a file for local runs)
compared in constant time. A rejected call gets UNAUTHENTICATED with a message
that says what was missing and how to supply it; the token itself is never
logged or echoed.
"""

from __future__ import annotations

import hmac
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc  # type: ignore[import-untyped,unused-ignore]  # types-grpcio is not a dependency yet

from weightsync.errors import PermanentError

HEADER = "authorization"
TOKEN_ENV = "WEIGHTSYNC_TOKEN"


def load_token(token_file: str | None = None, env: str = TOKEN_ENV) -> str | None:
    """The token from ``token_file`` (stripped), else from ``$WEIGHTSYNC_TOKEN``, else None."""
    if token_file:
        try:
            token = Path(token_file).read_text().strip()
        except OSError as e:
            raise PermanentError(f"--token-file {token_file!r} cannot be read ({e.strerror})") from None
        if not token:
            raise PermanentError(f"--token-file {token_file!r} is empty; write the shared token into it")
        return token
    return os.environ.get(env) or None


def _abort_handler(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    def abort(request: Any, context: grpc.ServicerContext) -> Any:
        context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(
            abort, request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer
        )
    return grpc.unary_unary_rpc_method_handler(
        abort, request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer
    )


class BearerTokenInterceptor(grpc.ServerInterceptor):  # type: ignore[misc,unused-ignore]
    def __init__(self, token: str) -> None:
        if not token:
            raise PermanentError("bearer token is empty")
        self._expected = f"Bearer {token}".encode()

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        got = next((v for k, v in handler_call_details.invocation_metadata or () if k == HEADER), None)
        if got is None:
            return _abort_handler(
                handler,
                "missing bearer token: send metadata 'authorization: Bearer <token>' "
                f"(CoordinatorClient(token=...), or set {TOKEN_ENV})",
            )
        value = got.encode() if isinstance(got, str) else bytes(got)
        if not hmac.compare_digest(value, self._expected):
            return _abort_handler(
                handler,
                "bearer token rejected: it does not match the coordinator's token "
                "(check --token-file / WEIGHTSYNC_TOKEN on both ends)",
            )
        return handler
