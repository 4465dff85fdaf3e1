"""The process's transport event loop: one daemon thread that runs every grpc.aio server of the process.

Servers keep a synchronous API; they submit their coroutines here. One loop for all servers keeps
grpc.aio on a single event loop and the thread count of a process independent of its servers and streams.
"""

import asyncio
import threading
from collections.abc import Callable, Coroutine

_lock = threading.Lock()
_loop: asyncio.AbstractEventLoop | None = None


def transport_loop() -> asyncio.AbstractEventLoop:
    """The running transport loop, started on first use."""
    global _loop
    with _lock:
        if _loop is None:
            loop = asyncio.new_event_loop()
            ready = threading.Event()
            loop.call_soon(ready.set)
            threading.Thread(target=loop.run_forever, name="grpc-aio", daemon=True).start()
            ready.wait()
            _loop = loop
        return _loop


def run(coro: Coroutine, timeout: float | None = None):
    """Run `coro` on the transport loop from another thread and return its result."""
    return asyncio.run_coroutine_threadsafe(coro, transport_loop()).result(timeout)


def call_soon(fn: Callable, *args) -> None:
    """Schedule `fn(*args)` on the transport loop from any thread."""
    transport_loop().call_soon_threadsafe(fn, *args)
