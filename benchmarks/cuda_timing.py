"""How the GPU benchmarks time a kernel: the median of CUDA-event timings with a flushed L2, usually of a
CUDA-graph replay (no launch overhead), and the device-to-device copy bandwidth that achieved rates are read
against."""

import torch

DEVICE = "cuda"

_FLUSH: dict[str, torch.Tensor] = {}


def median_us(fn, rep_ms: int, flush: str = "read") -> float:
    """Median microseconds of `fn`, timed with CUDA events, with L2 flushed before each call.

    `flush="read"` streams a 512 MB buffer through L2 (a sum), leaving it cold and clean, as a layer finds it
    after the previous layer's reads. `flush="zero"` is triton.testing.do_bench's flush (zeroing 256 MB): it
    leaves up to a whole L2 of dirty lines that the timed kernel must write back first (~14 us on an H200),
    which is an artifact of the method, kept measurable for comparison.
    """
    if flush not in _FLUSH:
        size = 512 << 20 if flush == "read" else 256 << 20
        _FLUSH[flush] = torch.ones(size // 4, dtype=torch.float32, device=DEVICE)
    buf = _FLUSH[flush]
    sink = torch.empty((), dtype=torch.float32, device=DEVICE)
    wipe = (lambda: torch.sum(buf, dim=0, out=sink)) if flush == "read" else buf.zero_
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        fn()
    end.record()
    torch.cuda.synchronize()
    reps = max(10, min(300, int(rep_ms / max(start.elapsed_time(end) / 5, 1e-3))))
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for s_ev, e_ev in events:
        wipe()
        s_ev.record()
        fn()
        e_ev.record()
    torch.cuda.synchronize()
    times = sorted(s_ev.elapsed_time(e_ev) for s_ev, e_ev in events)
    return 1e3 * times[len(times) // 2]


def graph_replay(fn):
    """Capture `fn` (already run once, so compiled) into a CUDA graph; returns its replay."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def copy_bandwidth(nbytes: int = 2 << 30, rep_ms: int = 200) -> float:
    """Device-to-device copy bandwidth in GB/s, counting bytes read plus bytes written."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=DEVICE).normal_()
    dst = torch.empty_like(src)
    us = median_us(lambda: dst.copy_(src), rep_ms)
    return 2 * nbytes / us / 1e3
