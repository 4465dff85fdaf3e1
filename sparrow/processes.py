"""Benchmarks that spawn worker processes (trainer ranks, weight senders and receivers): a free local port for
their rendezvous, and their results gathered from a queue without waiting on a process that has died."""

import queue as queues
import socket


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def gather(procs: list, results_queue, expected: int, what: str) -> dict:
    """Start `procs`, collect `expected` (kind, value) pairs they put on `results_queue`, then join them.

    A process that exits with an error ends the wait at once (its traceback is on stderr), instead of the
    others waiting for results that will never come; every process is joined, or killed, before returning.
    """
    for p in procs:
        p.start()
    results: dict = {}
    try:
        while len(results) < expected and not any(p.exitcode not in (None, 0) for p in procs):
            try:
                kind, value = results_queue.get(timeout=1.0)
            except queues.Empty:
                continue
            results[kind] = value
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    failed = {i: p.exitcode for i, p in enumerate(procs) if p.exitcode}
    if failed or len(results) < expected:
        raise RuntimeError(f"{what}: process(es) failed (index: exit code) {failed}; their errors are above")
    return results
