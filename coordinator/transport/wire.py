"""Registering async handlers whose requests may be any bytes at all.

gRPC's generated registration parses requests before the handler runs and answers bytes that do not
parse with a bare INTERNAL error. Here parsing never raises: bytes that do not parse, or that exceed the
method's own size limit (left unparsed), arrive as `Unreadable`, and the handler answers with its status.
"""

from collections.abc import Callable
from dataclasses import dataclass

import grpc
from google.protobuf.message import DecodeError, Message


@dataclass
class Unreadable:
    """Request bytes a handler will not use; it ends the call with `code` and `message`."""

    code: grpc.StatusCode
    message: str


def lenient(cls: type[Message], max_bytes: int | None = None) -> Callable[[bytes], Message | Unreadable]:
    """A parser of `cls` that never raises; with `max_bytes`, larger requests are refused without parsing."""
    name = cls.DESCRIPTOR.full_name

    def parse(data: bytes):
        if max_bytes is not None and len(data) > max_bytes:
            return Unreadable(grpc.StatusCode.RESOURCE_EXHAUSTED, f"request: {len(data)} bytes; a {name} is at most {max_bytes} bytes")
        try:
            return cls.FromString(data)
        except (DecodeError, ValueError, RuntimeError) as exc:
            return Unreadable(grpc.StatusCode.INVALID_ARGUMENT, f"request: the bytes do not parse as a {name} ({exc})")

    return parse


def stream_stream(handler: Callable, request: type[Message], reply: type[Message]) -> grpc.RpcMethodHandler:
    return grpc.stream_stream_rpc_method_handler(handler, lenient(request), reply.SerializeToString)


def unary_unary(handler: Callable, request: type[Message], reply: type[Message], max_bytes: int) -> grpc.RpcMethodHandler:
    return grpc.unary_unary_rpc_method_handler(handler, lenient(request, max_bytes), reply.SerializeToString)


def service(full_name: str, methods: dict[str, grpc.RpcMethodHandler]) -> grpc.GenericRpcHandler:
    return grpc.method_handlers_generic_handler(full_name, methods)
