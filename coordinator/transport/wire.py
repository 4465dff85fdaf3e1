"""Registering async handlers whose requests may be any bytes at all.

gRPC's generated registration parses requests before the handler runs and answers bytes that do not
parse with a bare INTERNAL error. Here parsing never raises: such bytes arrive as `Undecodable`, and
the handler answers INVALID_ARGUMENT naming the request.
"""

from collections.abc import Callable
from dataclasses import dataclass

import grpc
from google.protobuf.message import DecodeError, Message


@dataclass
class Undecodable:
    type_name: str
    reason: str

    def describe(self) -> str:
        return f"request: the bytes do not parse as a {self.type_name} ({self.reason})"


def lenient(cls: type[Message]) -> Callable[[bytes], Message | Undecodable]:
    def parse(data: bytes):
        try:
            return cls.FromString(data)
        except (DecodeError, ValueError, RuntimeError) as exc:
            return Undecodable(cls.DESCRIPTOR.full_name, str(exc))

    return parse


def stream_stream(handler: Callable, request: type[Message], reply: type[Message]) -> grpc.RpcMethodHandler:
    return grpc.stream_stream_rpc_method_handler(handler, lenient(request), reply.SerializeToString)


def unary_unary(handler: Callable, request: type[Message], reply: type[Message]) -> grpc.RpcMethodHandler:
    return grpc.unary_unary_rpc_method_handler(handler, lenient(request), reply.SerializeToString)


def service(full_name: str, methods: dict[str, grpc.RpcMethodHandler]) -> grpc.GenericRpcHandler:
    return grpc.method_handlers_generic_handler(full_name, methods)
