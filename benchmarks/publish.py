"""`sparrow bench publish`: weight publication as a job does it, timed: trainer rank 0's state dict, bucketed,
broadcast over a collective weight group (`run.weights_channel: collective`; NCCL on GPUs, gloo on the CPU)
to N native engines, each taking it through `WeightReceiver` as a rollout worker does (received, staged in
host memory, validated, copied in place).

One sender process and N receiver processes (on CUDA one GPU each: NCCL joins no two ranks on one GPU). The
model is an HF directory or a shape name with random weights (the bytes moved depend on the shape only), on
the sender as the trainer would hold it (bf16 on CUDA), and on each receiver as an engine's. After every
publication each receiver's parameters are checked against the sender's (a float64 checksum per tensor).
"""

import datetime
import json
import sys
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

from sparrow.processes import free_port, gather
from sparrow.tables import format_table

PUBLISHED_FIGURES = [
    ("verl checkpoint engine, NCCL (H20, Megatron)", "Qwen2.5-7B", "4 + 4 GPUs", "0.02 s (per-tensor path 0.12 s)"),
    ("verl checkpoint engine (H100, InfiniBand)", "-", "-", "about 7 s at 8.25 GB/s"),
    ("slime, NCCL from_distributed", "GLM-4.5 355B-A32B bf16", "-", "48 s"),
]
"""What peers publish (reference/anchors.md section 8.1), printed beside our table; not measured here."""


def _device(args, rank: int) -> torch.device:
    return torch.device("cuda", rank) if args.device == "cuda" else torch.device("cpu")


def _model(args, device: torch.device, seed: int):
    from sparrow.rollout_workers.native.model_loader import resolve_dtype
    from sparrow.rollout_workers.native.shapes import build_model

    return build_model(args.model, device, resolve_dtype("auto", device), 1024, seed)


def _checksums(params: dict[str, torch.Tensor]) -> dict[str, float]:
    return {name: float(p.double().sum()) for name, p in params.items()}


def _progress(line: str) -> None:
    """Long runs show where they are (building an 8B-shaped model in each process takes a while)."""
    print(f"bench publish: {line}", file=sys.stderr, flush=True)


def _sender(args, port: int, queue) -> None:
    from sparrow.weight_sync.send import publish_state_dict
    from sparrow.weight_sync import CollectiveGroup, CollectiveSender

    device = _device(args, 0)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    start = time.perf_counter()
    model = _model(args, device, seed=1)
    _progress(f"sender: {args.model} built in {time.perf_counter() - start:.1f} s; waiting for {args.receivers} engine(s)")
    group = CollectiveGroup("127.0.0.1", port, 0, args.receivers + 1, "nccl" if device.type == "cuda" else "gloo", device)
    _progress(f"sender: group formed {time.perf_counter() - start:.1f} s in")
    sender = CollectiveSender(group)
    rows = []
    for version in range(1, args.publishes + 1):
        with torch.no_grad():  # a new policy version: the weights move, as after an optimizer step
            for p in model.parameters():
                p.mul_(1.0 + 1e-3 * version)
        state = {name: p for name, p in model.named_parameters()}
        report = publish_state_dict(state, version, sender, int(args.bucket_mb * 2**20))
        rows.append({"version": version, "bytes": report.nbytes, "buckets": report.num_buckets,
                     "tensors": report.num_tensors, "sender_s": report.seconds, "checksums": _checksums(state)})
        _progress(f"sender: version {version}/{args.publishes}, {report.nbytes / 2**20:.0f} MiB in {report.seconds:.2f} s")
    group.close()
    queue.put(("sender", rows))


def _receiver(rank: int, args, port: int, queue) -> None:
    from sparrow.rollout_workers.native import NativeEngine, NativeEngineConfig
    from sparrow.weight_sync import CollectiveGroup, CollectiveSource, WeightReceiver

    device = _device(args, rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    model = _model(args, device, seed=100 + rank)
    engine = NativeEngine(NativeEngineConfig(device=str(device), max_num_seqs=1, max_model_len=1024, num_kv_blocks=64,
                                             cuda_graphs=False), model=model)
    group = CollectiveGroup("127.0.0.1", port, rank, args.receivers + 1, "nccl" if device.type == "cuda" else "gloo",
                            device)
    receiver, rows = WeightReceiver(engine), []
    for _ in range(args.publishes):
        report = receiver.receive(CollectiveSource(group))
        rows.append({"version": report.version, "receive_s": report.seconds,
                     "checksums": _checksums(dict(model.named_parameters()))})  # the engine serves `model`
    group.close()
    queue.put((f"receiver-{rank}", rows))


def run(args) -> dict:
    """Spawn the sender and the receivers, publish `args.publishes` versions, return the report."""
    if args.device == "cuda" and torch.cuda.device_count() < args.receivers + 1:
        raise ValueError(f"--receivers={args.receivers} on CUDA needs {args.receivers + 1} GPUs (the sender's and one a "
                         f"receiver: NCCL joins no two ranks on one GPU); this machine has {torch.cuda.device_count()}")
    ctx = mp.get_context("spawn")
    queue, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=_sender, args=(args, port, queue))]
    procs += [ctx.Process(target=_receiver, args=(r, args, port, queue)) for r in range(1, args.receivers + 1)]
    results = gather(procs, queue, len(procs), "sparrow bench publish")
    return summarise(args, results)


def summarise(args, results: dict[str, list[dict]]) -> dict:
    rows = []
    for i, sent in enumerate(results["sender"]):
        received = [results[f"receiver-{r}"][i] for r in range(1, args.receivers + 1)]
        if any(r["version"] != sent["version"] for r in received):
            raise RuntimeError(f"version {sent['version']} was sent, receivers got {[r['version'] for r in received]}")
        slowest = max(r["receive_s"] for r in received)
        rows.append({**{k: v for k, v in sent.items() if k != "checksums"}, "slowest_receiver_s": slowest,
                     "gbytes_per_s": sent["bytes"] / max(slowest, sent["sender_s"]) / 1e9,
                     "weights_match": all(r["checksums"] == sent["checksums"] for r in received)})
    device_name = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"
    return {"command": "sparrow " + " ".join(sys.argv[1:]),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "model": args.model, "device": args.device, "device_name": device_name, "receivers": args.receivers,
            "bucket_mb": args.bucket_mb, "publishes": rows}


def render(report: dict) -> str:
    rows = [[r["version"], f"{r['bytes'] / 2**20:.1f}", r["buckets"], f"{r['sender_s']:.3f}",
             f"{r['slowest_receiver_s']:.3f}", f"{r['gbytes_per_s']:.2f}", "yes" if r["weights_match"] else "NO"]
            for r in report["publishes"]]
    lines = [f"{report['model']}: 1 sender -> {report['receivers']} native engine(s), {report['device_name']}, "
             f"buckets of {report['bucket_mb']:g} MiB",
             format_table(["version", "MiB", "buckets", "sender s", "slowest receiver s (incl. load)", "GB/s",
                           "weights match"], rows),
             "Published by peers (reference, not measured here):",
             format_table(["system", "model", "GPUs", "sync time"], [list(r) for r in PUBLISHED_FIGURES])]
    return "\n".join(lines)


def register(actions) -> None:
    """Adds `publish` to `sparrow bench`'s actions."""
    p = actions.add_parser("publish", help="weight publication: trainer rank 0 -> N native engines over NCCL / gloo")
    p.add_argument("--model", required=True, metavar="DIR_OR_SHAPE", help="HF directory, or a shape name (random weights)")
    p.add_argument("--receivers", type=int, default=1, help="receiving engines, one process (one GPU on CUDA) each")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--publishes", type=int, default=3, help="versions published (the first includes warm-up)")
    p.add_argument("--bucket-mb", type=float, default=256.0, help="bucket size (trainer.publish.bucket_mb)")
    p.add_argument("--out", type=Path, help="write the results as JSON here")
    p.add_argument("--json", action="store_true", help="print the results as one JSON object")
    p.set_defaults(handler=run_bench)


def run_bench(args) -> int:
    for flag in ("receivers", "publishes"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag}={getattr(args, flag)}: must be >= 1")
    if args.bucket_mb <= 0:
        raise ValueError(f"--bucket-mb={args.bucket_mb}: must be > 0")
    start = time.perf_counter()
    report = run(args)
    report["wall_s"] = time.perf_counter() - start
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1))
        print(f"wrote {args.out}", file=sys.stderr)
    print(json.dumps(report) if args.json else render(report))
    return 0
