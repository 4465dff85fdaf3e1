"""The job's bearer token on every call: servers check it, plaintext clients attach it.

Over TLS clients attach the token as call credentials (gRPC sends those only on secure channels);
on a plaintext channel (loopback, or `allow_insecure`) `TokenMetadata` adds the same header.
"""

import hmac
from collections.abc import Callable

import grpc

HEADER = "authorization"


def bearer(token: str) -> str:
    return f"Bearer {token}"


def token_problem(metadata, expected: bytes) -> str | None:
    """Why the call's metadata does not carry the job token (None: it does). Constant-time compare."""
    values = [m.value for m in metadata or () if m.key == HEADER]
    if not values:
        return (f"missing '{HEADER}' metadata: every call needs '{HEADER}: Bearer <job token>' "
                "(clients built from the job's JobCredentials send it)")
    value = values[0]
    given = value.encode() if isinstance(value, str) else value
    if len(values) > 1 or not hmac.compare_digest(given, expected):
        return f"the '{HEADER}' bearer token is not this job's token; use the JobCredentials of this job"
    return None


def _refusal(message: str) -> grpc.RpcMethodHandler:
    """A handler that answers UNAUTHENTICATED without reading the request.

    Registered as a stream handler whatever the method: a unary handler would have gRPC read the whole
    request (up to max_message_mb) before it runs; a stream handler that never reads leaves the body unread.
    """

    async def refuse(_requests, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    return grpc.stream_stream_rpc_method_handler(refuse)


class TokenCheck(grpc.aio.ServerInterceptor):
    """Refuses every call without the job token (UNAUTHENTICATED), unknown methods included (a caller without the
    token learns nothing of which methods exist), before its request is read; the server goes on serving the rest."""

    def __init__(self, token: str, on_refusal: Callable[[], None] = lambda: None):
        self._expected = bearer(token).encode()
        self._on_refusal = on_refusal

    async def intercept_service(self, continuation, handler_call_details):
        problem = token_problem(handler_call_details.invocation_metadata, self._expected)
        if problem is None:
            return await continuation(handler_call_details)
        self._on_refusal()
        return _refusal(problem)


class TokenMetadata(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """Adds `authorization: Bearer <token>` to every call of a plaintext channel."""

    def __init__(self, token: str):
        self._header = (HEADER, bearer(token))

    def _with_token(self, details: grpc.ClientCallDetails) -> grpc.ClientCallDetails:
        return _CallDetails(details.method, details.timeout, [*(details.metadata or ()), self._header],
                            details.credentials, details.wait_for_ready, details.compression)

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._with_token(details), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._with_token(details), request)

    def intercept_stream_unary(self, continuation, details, request_iterator):
        return continuation(self._with_token(details), request_iterator)

    def intercept_stream_stream(self, continuation, details, request_iterator):
        return continuation(self._with_token(details), request_iterator)


class _CallDetails(grpc.ClientCallDetails):
    def __init__(self, method, timeout, metadata, credentials, wait_for_ready, compression):
        self.method, self.timeout, self.metadata = method, timeout, metadata
        self.credentials, self.wait_for_ready, self.compression = credentials, wait_for_ready, compression
