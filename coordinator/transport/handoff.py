"""A bounded FIFO from stream handlers on the transport loop (async producers) to consumer threads.

Producers wait for space without holding a thread: each item holds one permit of an asyncio semaphore
until a consumer takes it, and the consumer hands the permit back through the loop.
"""

import asyncio
import threading
from collections import deque

from . import loop


class HandoffQueue:
    def __init__(self, capacity: int):
        self.capacity = capacity
        self._items: deque = deque()
        self._ready = threading.Condition()
        self._space = asyncio.Semaphore(capacity)  # used on the transport loop only

    async def put(self, item) -> bool:
        """Append once there is space (cancellable while waiting); True when it had to wait."""
        waited = self._space.locked()
        await self._space.acquire()
        with self._ready:
            self._items.append(item)
            self._ready.notify()
        return waited

    def _take(self, max_items: int) -> list:
        taken = [self._items.popleft() for _ in range(min(max_items, len(self._items)))]
        loop.call_soon(self._release, len(taken))
        return taken

    def _release(self, permits: int) -> None:
        for _ in range(permits):
            self._space.release()

    def get_batch(self, max_items: int, timeout: float | None = None) -> list:
        """Up to `max_items`: waits up to `timeout` for the first, then takes what is already queued."""
        with self._ready:
            if not self._ready.wait_for(lambda: self._items, timeout):
                return []
            return self._take(max_items)

    def get(self, timeout: float | None = None):
        """The next item, or None after `timeout` seconds."""
        items = self.get_batch(1, timeout)
        return items[0] if items else None

    def qsize(self) -> int:
        return len(self._items)
