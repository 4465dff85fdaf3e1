"""Server side of an acknowledged stream: validate, de-duplicate, queue with backpressure, ack.

Protocol (docs/grpc_api.md): the client opens with `StreamOpen`; the server grants a window of W
credits; every payload gets exactly one `Ack`, in order, and each ack returns one credit. The ack is
sent only after the payload is in the bounded queue, so a full queue holds acks back and the
sender stops at W in flight: it waits, nothing is dropped.
"""

import queue
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterator

import grpc

from sparrow.protos import sparrow_v1_pb2 as pb

from .validate import InvalidMessage

POLL_S = 0.05
"""How often a handler blocked on a full queue re-checks that its stream and server are alive."""


class DedupeWindow:
    """Ids accepted recently (bounded, oldest forgotten first) plus ids being queued right now.

    An id in flight on one stream blocks a resend of it on another until the first one resolves, so
    a resend racing the original can neither be queued twice nor be lost.
    """

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._accepted: OrderedDict[str, None] = OrderedDict()
        self._in_flight: set[str] = set()
        self._cond = threading.Condition()

    def reserve(self, key: str, alive: Callable[[], bool]) -> bool | None:
        """True: the caller owns `key` now. False: already accepted. None: the caller's stream died."""
        with self._cond:
            while key in self._in_flight:
                if not alive():
                    return None
                self._cond.wait(POLL_S)
            if key in self._accepted:
                self._accepted.move_to_end(key)
                return False
            self._in_flight.add(key)
            return True

    def resolve(self, key: str, accepted: bool) -> None:
        with self._cond:
            self._in_flight.discard(key)
            if accepted:
                self._accepted[key] = None
                while len(self._accepted) > self.capacity:
                    self._accepted.popitem(last=False)
            self._cond.notify_all()

    def __len__(self) -> int:
        return len(self._accepted)


class AckedIngest:
    """One acknowledged stream endpoint (samples or stats) feeding one bounded queue."""

    def __init__(
        self,
        payload: str,
        id_field: str,
        validate: Callable[[object], None],
        convert: Callable[[object], object],
        capacity: int,
        dedupe_window: int,
        window: int,
        server_id: str,
    ):
        self.payload, self.id_field = payload, id_field
        self._validate, self._convert = validate, convert
        self.queue: queue.Queue = queue.Queue(maxsize=capacity)
        self.dedupe = DedupeWindow(dedupe_window)
        self.window, self.server_id = window, server_id
        self.counts: Counter[str] = Counter()
        self.draining = threading.Event()
        self.stopping = threading.Event()
        self._lock = threading.Lock()

    def serve(self, requests: Iterator, context: grpc.ServicerContext) -> Iterator[pb.StreamReply]:
        first = next(requests, None)
        if first is None:
            return
        if first.WhichOneof("kind") != "open":
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "open: the first message of a stream must be StreamOpen")
        yield pb.StreamReply(grant=pb.StreamGrant(window=self.window, server_id=self.server_id))
        for request in requests:
            kind = request.WhichOneof("kind")
            if kind != self.payload:
                context.abort(
                    grpc.StatusCode.FAILED_PRECONDITION, f"kind: expected a {self.payload} after StreamOpen, got {kind}"
                )
            ack = self.ingest(getattr(request, self.payload), context.is_active)
            if ack is None:  # the stream died while we waited for queue space
                return
            yield pb.StreamReply(ack=ack)

    def ingest(self, msg, alive: Callable[[], bool]) -> pb.Ack | None:
        key = getattr(msg, self.id_field)
        if self.draining.is_set():
            return self._ack(key, pb.ACK_STATUS_UNAVAILABLE, "", "server is draining; resend to another server or later")
        try:
            self._validate(msg)
        except InvalidMessage as exc:
            return self._ack(key, pb.ACK_STATUS_INVALID_ARGUMENT, exc.field, str(exc))
        owner = self.dedupe.reserve(key, lambda: alive() and not self.stopping.is_set())
        if owner is None:
            return None
        if not owner:
            return self._ack(key, pb.ACK_STATUS_DUPLICATE, "", f"{self.id_field} {key!r} was accepted before")
        queued = False
        try:
            item = self._convert(msg)
            while not queued:
                if not alive() or self.stopping.is_set():
                    return None
                try:
                    self.queue.put(item, timeout=POLL_S)
                    queued = True
                except queue.Full:
                    with self._lock:
                        self.counts["waits"] += 1
        finally:
            self.dedupe.resolve(key, queued)
        return self._ack(key, pb.ACK_STATUS_ACCEPTED, "", "")

    def _ack(self, key: str, status: int, field: str, message: str) -> pb.Ack:
        with self._lock:
            self.counts[pb.AckStatus.Name(status).removeprefix("ACK_STATUS_").lower()] += 1
        return pb.Ack(id=key, status=status, field=field, message=message)

    def get(self, timeout: float | None = None):
        """The next queued item, or None after `timeout` seconds."""
        try:
            return self.queue.get(timeout=timeout)
        except queue.Empty:
            return None

    def get_batch(self, max_items: int, timeout: float | None = None) -> list:
        """Up to `max_items`: waits up to `timeout` for the first, then takes what is already queued."""
        first = self.get(timeout)
        if first is None:
            return []
        items = [first]
        while len(items) < max_items:
            try:
                items.append(self.queue.get_nowait())
            except queue.Empty:
                break
        return items

    def wait_empty(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while self.queue.qsize() and time.monotonic() < deadline:
            time.sleep(POLL_S)
        return self.queue.qsize() == 0

    def stats(self) -> dict[str, float]:
        with self._lock:
            counts = dict(self.counts)
        return {
            "queue_depth": float(self.queue.qsize()),
            "queue_capacity": float(self.queue.maxsize),
            **{k: float(counts.get(k, 0)) for k in ("accepted", "duplicate", "invalid_argument", "unavailable", "waits")},
        }
