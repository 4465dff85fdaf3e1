"""Fuzz every RPC with hypothesis-generated requests (sparrow.bench.fuzz) against a trajectory server and a
coordinator-like control server in child processes, judging each answer with the oracle written from
docs/grpc_api.md's rules (sparrow.bench.fuzz.oracle, independent of the validation under test); prints
tables last.

Checked: no request the rules refuse is accepted, none they accept is refused, refusals name a broken
field, no handler fails (UNKNOWN / INTERNAL), no server process dies, server memory and threads stay
flat, valid traffic is served afterwards; and, without the token, 60 MiB unary bodies are refused
before the server reads them (bytes counted by a relay in front of the server).

Usage (repo root): python benchmarks/fuzz_grpc.py [--requests 10000] [--rounds 10] [--seed 0] [--tls off|job]
(each round generates and sends --requests new requests; memory is read before the first round and after each)
"""

import argparse
import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import grpc

from sparrow.bench.fuzz.cases import cases, fuzz_config
from sparrow.bench.fuzz.fuzzer import Fuzzer, FuzzReport, FuzzTargets, valid_traffic
from sparrow.bench.fuzz.harness import ServerProcess
from sparrow.bench.fuzz.oracle import ERROR, LENGTH, STOP
from sparrow.bench.fuzz.relay import CountingRelay
from sparrow.coordinator.transport import JobCredentials
from sparrow.tables import format_table

VERDICTS = ("as expected", "invalid accepted", "valid refused", "wrong field named", "other answer", "handler failure")
FINISH_REASONS = {STOP: "STOP", LENGTH: "LENGTH", ERROR: "ERROR"}


def unauthenticated_bodies(server: ServerProcess, calls: int = 12, body_mib: int = 60) -> list:
    """Token-less unary calls with large bodies, 4 at a time, through a relay counting what reaches the server."""
    body = bytes(body_mib * 2**20)
    before = server.stats()
    with CountingRelay(server.port) as relay, \
            grpc.insecure_channel(relay.address, [("grpc.max_send_message_length", -1)]) as channel:
        methods = [channel.unary_unary(f"/sparrow.v1.ControlService/{m}") for m in ("Drain", "Health", "ResizePool")]

        def call(i: int) -> str:
            try:
                methods[i % 3](body, timeout=60)
            except grpc.RpcError as exc:
                return exc.code().name
            return "OK"

        with ThreadPoolExecutor(4) as pool:
            codes = Counter(pool.map(call, range(calls)))
    after = server.stats()
    return [calls, body_mib * calls, f"{relay.to_server / 2**20:.1f}", dict(codes),
            f"{before['rss_mb']:.0f} / {after['rss_mb']:.0f}"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=10_000, help="requests generated and sent per round")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tls", choices=["off", "job"], default="off")
    args = parser.parse_args()

    config = fuzz_config(security={"tls": args.tls})
    credentials = JobCredentials.create(config)
    with ServerProcess(config, credentials) as trajectory, ServerProcess(config, credentials, "control") as control:
        targets = FuzzTargets(trajectory.address, control.address, trajectory.resume)
        valid_traffic(targets, config, credentials, "before")
        servers = {"trajectory": trajectory, "control": control}
        readings = [{kind: server.stats() for kind, server in servers.items()}]
        report, generate_s, send_s = FuzzReport(), 0.0, 0.0
        for r in range(args.rounds):
            start = time.perf_counter()
            generated = cases(config, args.requests, args.seed + 1000 * r, prefix=f"r{r}")
            sent = time.perf_counter()
            with Fuzzer(targets, credentials) as fuzzer:
                report.outcomes += fuzzer.run(generated).outcomes
            generate_s, send_s = generate_s + sent - start, send_s + time.perf_counter() - sent
            readings.append({kind: server.stats() if server.alive else None for kind, server in servers.items()})
            print(f"round {r + 1}/{args.rounds}: {len(report.outcomes)} requests, {len(report.mismatches)} mismatches",
                  file=sys.stderr, flush=True)
        after_traffic = valid_traffic(targets, config, credentials, "after")
        resizes = control.stats()["resizes"]
        unauthenticated = unauthenticated_bodies(trajectory) if trajectory.alive else None
        alive = {kind: server.alive for kind, server in servers.items()}

    n = len(report.outcomes)
    print(f"\n{n} requests in {args.rounds} rounds (seed {args.seed}, tls={args.tls}): generated in {generate_s:.0f} s "
          f"({n / generate_s:.0f}/s), sent and answered in {send_s:.0f} s ({n / send_s:.0f}/s)")
    rows = [[rpc, c["requests"], c["must be refused"], *(c[v] for v in VERDICTS)] for rpc, c in sorted(report.by_rpc().items())]
    total = [sum(r[i] for r in rows) for i in range(1, len(rows[0]))]
    print(format_table(["rpc → server", "requests", "must be refused", *VERDICTS], rows + [["all", *total]]))

    samples = [o for o in report.outcomes if o.finish_reason is not None]
    print(f"\nsamples on shared streams: {len(samples)}, by finish reason")
    by_reason: dict[str, Counter] = {}
    for o in samples:
        c = by_reason.setdefault(FINISH_REASONS.get(o.finish_reason, "other values"), Counter())
        c["samples"] += 1
        c["must be accepted"] += not o.broken
        c["as expected"] += o.verdict == "as expected"
    print(format_table(["finish_reason", "samples", "must be accepted", "must be refused", "as expected"],
                       [[k, c["samples"], c["must be accepted"], c["samples"] - c["must be accepted"], c["as expected"]]
                        for k, c in by_reason.items()]))
    by_field: dict[str, Counter] = {}
    for o in samples:
        for name in o.broken:
            c = by_field.setdefault(name.split("[")[0] + ("[key]" if "[" in name else ""), Counter())
            c["samples"] += 1
            c["only rule broken"] += len(o.broken) == 1
            c["refused"] += o.got.code == "INVALID_ARGUMENT"
    print("\nrules broken (a sample may break several; the server names one of them)")
    print(format_table(["field", "samples breaking it", "it alone", "refused"],
                       [[k, c["samples"], c["only rule broken"], c["refused"]] for k, c in sorted(by_field.items())]))
    by_label = Counter((o.rpc, o.label) for o in report.outcomes)
    print("\nhow requests were drawn or rewritten")
    print(format_table(["rpc", "drawn as", "requests"], [[rpc, label, count] for (rpc, label), count in sorted(by_label.items())]))

    def reading(kind: str, key: str, i: int) -> str:
        value = readings[i][kind]
        return "-" if value is None else f"{value[key]:.1f}" if key == "rss_mb" else str(value[key])

    checkpoints = [0, *range(1, len(readings))]
    print()
    print(format_table(["server", "alive at the end", "RSS MB (before / after each round)", "threads"],
                       [[kind, "yes" if alive[kind] else "NO (crashed)",
                         " / ".join(reading(kind, "rss_mb", i) for i in checkpoints),
                         " / ".join(reading(kind, "threads", i) for i in checkpoints)] for kind in servers]))
    ok_resizes = sum(o.rpc == "ResizePool" and o.got.code == "OK" for o in report.outcomes)
    print(f"resizes the control server's handler recorded: {resizes:.0f} (fuzzed resizes answered OK: {ok_resizes}, "
          f"valid traffic: 6)")
    print()
    print(format_table(["valid traffic afterwards", "served", "sent"], [[k, *v] for k, v in after_traffic.items()]))
    if unauthenticated is not None:
        print()
        print(format_table(["token-less unary calls", "MiB sent", "MiB reaching the server", "answers",
                            "server RSS MB before / after"], [unauthenticated]))
    for o in report.mismatches[:20]:
        print(f"MISMATCH {o.rpc} → {o.target} ({o.label}): expected {o.expected}, got {o.got}")


if __name__ == "__main__":
    main()
