"""Server side of an acknowledged stream: validate, de-duplicate, queue with backpressure, ack.

Protocol (docs/grpc_api.md): the client opens with `StreamOpen`; the server grants a window of W
credits; every payload gets exactly one `Ack`, in order, and each ack returns one credit. The ack is
sent only after the payload is in the bounded queue, so a full queue holds acks back and the
sender stops at W in flight: it waits, nothing is dropped.

Handlers are coroutines on the transport loop, so a stream holds no thread: an idle or waiting
stream costs only its buffers. Validation and conversion run on a few `ingest_threads`.
"""

import asyncio
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import grpc

from sparrow.protos import sparrow_v1_pb2 as pb

from .config import TransportConfig
from .handoff import HandoffQueue
from .validate import MAX_ID_CHARS, InvalidMessage, validate_stream_open
from .wire import Unreadable

POLL_S = 0.05
"""How often `wait_empty` re-checks the queue."""


class DedupeWindow:
    """Ids accepted recently (bounded, oldest forgotten first) plus ids being queued right now.

    An id in flight on one stream blocks a resend of it on another until the first one resolves, so
    a resend racing the original can neither be queued twice nor be lost. Used on the transport loop only.
    """

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._accepted: OrderedDict[str, None] = OrderedDict()
        self._in_flight: dict[str, asyncio.Event] = {}

    async def reserve(self, key: str) -> bool:
        """True: the caller owns `key` now and must `resolve` it. False: it was accepted before."""
        while (pending := self._in_flight.get(key)) is not None:
            await pending.wait()
        if key in self._accepted:
            self._accepted.move_to_end(key)
            return False
        self._in_flight[key] = asyncio.Event()
        return True

    def resolve(self, key: str, accepted: bool) -> None:
        self._in_flight.pop(key).set()
        if accepted:
            self._accepted[key] = None
            while len(self._accepted) > self.capacity:
                self._accepted.popitem(last=False)

    def __len__(self) -> int:
        return len(self._accepted)


class AckedIngest:
    """One acknowledged stream endpoint (`payload`: the request field it carries, "sample") feeding one
    bounded queue."""

    def __init__(
        self,
        payload: str,
        id_field: str,
        validate: Callable[[object], None],
        convert: Callable[[object], object],
        config: TransportConfig,
        server_id: str,
    ):
        self.payload, self.id_field = payload, id_field
        self._validate, self._convert = validate, convert
        self.config, self.server_id = config, server_id
        self.queue = HandoffQueue(config.queue_capacity)
        self.dedupe = DedupeWindow(config.dedupe_window)
        self.counts: Counter[str] = Counter()
        self.open_streams = 0
        self.draining = threading.Event()
        self._lock = threading.Lock()
        self._executor: ThreadPoolExecutor | None = None

    def open(self) -> None:
        self._executor = ThreadPoolExecutor(self.config.ingest_threads, thread_name_prefix=f"ingest-{self.payload}")

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None

    # ------------------------------------------------------------------ the stream

    async def serve(self, _requests, context: grpc.aio.ServicerContext) -> None:
        """The bidirectional stream handler (reads with `context.read`, answers with `context.write`)."""
        limit = self.config.max_streams
        if self.open_streams >= limit:
            self._count("streams_refused")
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{limit} streams are open on this server (transport.max_streams={limit}); retry later or raise max_streams",
            )
        self.open_streams += 1
        try:
            await self._serve(context)
        finally:
            self.open_streams -= 1

    async def _serve(self, context: grpc.aio.ServicerContext) -> None:
        first = await self._read(context)
        if first is None:
            return
        if first.WhichOneof("kind") != "open":
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "open: the first message of a stream must be StreamOpen")
        try:
            validate_stream_open(first.open)
        except InvalidMessage as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        await self._write(context, pb.StreamReply(grant=pb.StreamGrant(window=self.config.stream_window, server_id=self.server_id)))
        while (request := await self._read(context)) is not None:
            kind = request.WhichOneof("kind")
            if kind != self.payload:
                await context.abort(
                    grpc.StatusCode.FAILED_PRECONDITION, f"kind: expected a {self.payload} after StreamOpen, got {kind}"
                )
            ack = await self.ingest(getattr(request, self.payload))
            await self._write(context, pb.StreamReply(ack=ack))

    async def _read(self, context: grpc.aio.ServicerContext):
        """The next request; None at the end of the stream. Closes a stream idle for too long."""
        idle = self.config.stream_idle_timeout_s
        try:
            async with asyncio.timeout(idle):
                request = await context.read()
        except TimeoutError:
            self._count("streams_idle_closed")
            await context.abort(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"stream idle: nothing received for {idle:g} s (transport.stream_idle_timeout_s); open a new stream to send more",
            )
        if request is grpc.aio.EOF:
            return None
        if isinstance(request, Unreadable):
            await context.abort(request.code, request.message)
        return request

    async def _write(self, context: grpc.aio.ServicerContext, reply: pb.StreamReply) -> None:
        """Send a reply; closes a stream whose client reads no reply for as long as an idle one."""
        idle = self.config.stream_idle_timeout_s
        try:
            async with asyncio.timeout(idle):
                await context.write(reply)
        except TimeoutError:
            self._count("streams_idle_closed")
            await context.abort(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"stream stalled: the client read no reply for {idle:g} s (transport.stream_idle_timeout_s)",
            )

    # ------------------------------------------------------------------ one message

    def _accepted_form(self, msg):
        """Validated and converted. The message came off the network: whatever its conversion raises rejects
        this message alone (named in its ack), never the stream it came on."""
        self._validate(msg)
        try:
            return self._convert(msg)
        except InvalidMessage:
            raise
        except Exception as exc:
            reason = f"{type(exc).__name__}: {exc}"[:MAX_ID_CHARS]  # bounded: answers never quote unbounded input
            raise InvalidMessage(self.payload, f"could not be converted ({reason})") from exc

    async def ingest(self, msg) -> pb.Ack:
        key = getattr(msg, self.id_field)
        if self.draining.is_set():
            return self._ack(key, pb.ACK_STATUS_UNAVAILABLE, "", "server is draining; resend to another server or later")
        try:
            item = await asyncio.get_running_loop().run_in_executor(self._executor, self._accepted_form, msg)
        except InvalidMessage as exc:
            return self._ack(key, pb.ACK_STATUS_INVALID_ARGUMENT, exc.field, str(exc))
        if not await self.dedupe.reserve(key):
            return self._ack(key, pb.ACK_STATUS_DUPLICATE, "", f"{self.id_field} {key!r} was accepted before")
        queued = False
        try:
            if await self.queue.put(item):
                self._count("waits")
            queued = True
        finally:
            self.dedupe.resolve(key, queued)
        return self._ack(key, pb.ACK_STATUS_ACCEPTED, "", "")

    def _count(self, name: str) -> None:
        with self._lock:
            self.counts[name] += 1

    def _ack(self, key: str, status: int, field: str, message: str) -> pb.Ack:
        self._count(pb.AckStatus.Name(status).removeprefix("ACK_STATUS_").lower())
        return pb.Ack(id=key, status=status, field=field, message=message)

    # ------------------------------------------------------------------ the consumer's side (any thread)

    def get(self, timeout: float | None = None):
        """The next queued item, or None after `timeout` seconds."""
        return self.queue.get(timeout)

    def get_batch(self, max_items: int, timeout: float | None = None) -> list:
        """Up to `max_items`: waits up to `timeout` for the first, then takes what is already queued."""
        return self.queue.get_batch(max_items, timeout)

    def wait_empty(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while self.queue.qsize() and time.monotonic() < deadline:
            time.sleep(POLL_S)
        return self.queue.qsize() == 0

    def stats(self) -> dict[str, float]:
        with self._lock:
            counts = dict(self.counts)
        names = ("accepted", "duplicate", "invalid_argument", "unavailable", "waits", "streams_refused", "streams_idle_closed")
        return {
            "queue_depth": float(self.queue.qsize()),
            "queue_capacity": float(self.queue.capacity),
            "streams_open": float(self.open_streams),
            **{k: float(counts.get(k, 0)) for k in names},
        }
