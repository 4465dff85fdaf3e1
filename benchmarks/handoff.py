"""`sparrow bench handoff`: policy versions handed to a rollout engine on the same device, in place.

Two processes, as in a colocated job: a sender holding a shape's policy (random weights) packs each version
into its shared buffers (`sparrow.weight_sync.SharedSender`: CUDA IPC on a GPU, shared memory on a CPU) after
the finiteness check of all its tensors, and a native engine of the same shape in the other process reads them
in place (`WeightReceiver` over a `SharedSource`): the engine's own validation and copy into its weights
included. The first version opens the handles; later ones reuse them. The issue's targets on one H200:
Qwen3-1.7B ≤ 50 ms, 4B ≤ 100 ms, 8B ≤ 250 ms per version, the first ≤ 1 s.
"""

import json
import statistics
import time
from pathlib import Path

import torch

from sparrow.tables import format_table

from .result_files import default_out_path

TARGETS_MS = {"qwen3-1.7b": 50.0, "qwen3-4b": 100.0, "qwen3-8b": 250.0}
FIRST_TARGET_MS = 1000.0


def _device(name: str) -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if name == "cuda" else torch.device("cpu")


def _receiver(shape: str, device: str, dtype: torch.dtype, conn) -> None:
    """The rollout side: a native engine of `shape`, loading every handle it is sent."""
    from sparrow.rollout_workers.native import NativeEngine, NativeEngineConfig
    from sparrow.rollout_workers.native.shapes import build_model
    from sparrow.weight_sync import SharedMappings, SharedSource, WeightReceiver

    dev = _device(device)
    model = build_model(shape, dev, dtype, 1024, seed=1)
    engine = NativeEngine(NativeEngineConfig(device=str(dev), max_num_seqs=1, max_model_len=1024, num_kv_blocks=64,
                                             cuda_graphs=False), model=model)
    mappings = SharedMappings()
    conn.send("ready")
    while (handle := conn.recv()) is not None:
        start = time.perf_counter()
        report = WeightReceiver(engine).receive(SharedSource(handle, mappings))
        engine.runner.synchronize()
        conn.send({"version": report.version, "seconds": time.perf_counter() - start})
    engine.shutdown()


def measure(shape: str, device: str, versions: int, bucket_mb: float) -> dict:
    from sparrow.finite import first_nonfinite
    from sparrow.rollout_workers.native.shapes import build_model
    from sparrow.weight_sync.send import publish_state_dict
    from sparrow.weight_sync import SharedSender

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    dev = _device(device)
    model = build_model(shape, dev, dtype, 1024, seed=0)
    state = {name: p.detach() for name, p in model.named_parameters()}
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    context = torch.multiprocessing.get_context("spawn")
    here, there = context.Pipe()
    receiver = context.Process(target=_receiver, args=(shape, device, dtype, there), daemon=True)
    receiver.start()
    sender = SharedSender(dev)
    rows = []
    try:
        if here.recv() != "ready":
            raise RuntimeError("the receiving engine did not start")
        for version in range(1, versions + 1):
            start = time.perf_counter()
            if (bad := first_nonfinite(state)) is not None:
                raise ValueError(f"{bad}: not finite")
            checked = time.perf_counter()
            report = publish_state_dict(state, version, sender, int(bucket_mb * 2**20))
            packed = time.perf_counter()
            here.send(report.handle)
            answer = here.recv()
            rows.append({"version": version, "check_ms": (checked - start) * 1e3, "pack_ms": (packed - checked) * 1e3,
                         "receive_ms": answer["seconds"] * 1e3, "total_ms": (time.perf_counter() - start) * 1e3,
                         "buckets": report.num_buckets})
        here.send(None)
        receiver.join(timeout=60)
    finally:
        sender.close()
        if receiver.is_alive():
            receiver.kill()
    later = [r["total_ms"] for r in rows[1:]] or [rows[0]["total_ms"]]
    target = TARGETS_MS.get(shape)
    return {
        "shape": shape, "device": device, "dtype": str(dtype).removeprefix("torch."), "gbytes": nbytes / 1e9,
        "tensors": len(state), "bucket_mb": bucket_mb, "versions": rows,
        "first_ms": rows[0]["total_ms"], "later_median_ms": statistics.median(later), "later_max_ms": max(later),
        "target_ms": target, "met": None if target is None else (statistics.median(later) <= target
                                                                   and rows[0]["total_ms"] <= FIRST_TARGET_MS),
    }


def table(results: list[dict]) -> str:
    rows = []
    for r in results:
        later = r["versions"][1:] or r["versions"]
        rows.append([r["shape"], f"{r['gbytes']:.2f}", r["versions"][0]["buckets"], f"{r['first_ms']:.0f}",
                     f"{statistics.median(x['check_ms'] for x in later):.1f}",
                     f"{statistics.median(x['pack_ms'] for x in later):.1f}",
                     f"{statistics.median(x['receive_ms'] for x in later):.1f}",
                     f"{r['later_median_ms']:.1f}", f"{r['later_max_ms']:.1f}",
                     "-" if r["target_ms"] is None else f"{r['target_ms']:.0f}",
                     "-" if r["met"] is None else ("met" if r["met"] else "not met")])
    return format_table(["shape", "GB", "buckets", "first ms", "check ms", "pack ms", "receive ms", "per version ms",
                         "max ms", "target ms", "target"], rows)


def register(actions) -> None:
    h = actions.add_parser("handoff", help="policy versions handed in place to an engine on the same GPU / host")
    h.add_argument("--models", nargs="+", default=["qwen3-1.7b", "qwen3-4b", "qwen3-8b"], help="shape names")
    h.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    h.add_argument("--versions", type=int, default=11, help="versions per shape (the first opens the handles)")
    h.add_argument("--bucket-mb", type=float, default=256.0, help="bucket size (trainer.publish.bucket_mb)")
    h.add_argument("--out", type=Path, help="JSON path (default benchmarks/results/handoff-<device>-<time>.json)")
    h.set_defaults(handler=run)


def run(args) -> int:
    if args.versions < 2:
        raise ValueError(f"--versions={args.versions}: needs >= 2 (the first opens the handles, the rest are timed)")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda: no CUDA device here; use --device cpu")
    results = []
    for shape in args.models:
        results.append(measure(shape, args.device, args.versions, args.bucket_mb))
        print(table(results[-1:]), flush=True)
    name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    out = args.out or default_out_path(name, "handoff")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"device_name": name, "results": results}, indent=1))
    print(table(results))
    print(f"wrote {out}")
    return 0
