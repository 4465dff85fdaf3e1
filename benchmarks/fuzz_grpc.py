"""Fuzz every RPC with hypothesis-generated malformed messages (sparrow.bench.fuzz) against
a trajectory server and a coordinator-like control server (ResizePool; Drain answered UNIMPLEMENTED) in
child processes; prints tables last.

Checked: every message gets the answer its mutation calls for (field mutations: INVALID_ARGUMENT naming
the field, in the ack of a stream or the status of a unary call; protocol mutations: the status the
protocol defines), no server process dies and no handler fails (UNKNOWN / INTERNAL), server memory
and threads stay flat, and valid traffic is served afterwards.

Usage (repo root): python benchmarks/fuzz_grpc.py [--messages 10000] [--rounds 2] [--seed 0] [--tls off|job]
(each round sends --messages new messages; memory is read before the first round and after each)
"""

import argparse
import time
from collections import Counter

from sparrow.bench.fuzz.cases import cases, fuzz_config
from sparrow.bench.fuzz.fuzzer import Fuzzer, FuzzReport, FuzzTargets, valid_traffic
from sparrow.bench.fuzz.harness import ServerProcess
from sparrow.coordinator.transport import JobCredentials
from sparrow.tables import format_table

HANDLER_FAILURES = ("UNKNOWN", "INTERNAL")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=10_000)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tls", choices=["off", "job"], default="off")
    args = parser.parse_args()

    config = fuzz_config(security={"tls": args.tls})
    credentials = JobCredentials.create(config)
    with ServerProcess(config, credentials) as trajectory, ServerProcess(config, credentials, "control") as control:
        targets = FuzzTargets(trajectory.address, trajectory.resume, control.address)
        valid_traffic(targets, config, credentials, "before")
        servers = {"trajectory": trajectory, "control": control}
        readings = [{kind: server.stats() for kind, server in servers.items()}]
        report, generate_s, send_s = FuzzReport(), 0.0, 0.0
        for r in range(args.rounds):
            start = time.perf_counter()
            generated_cases = cases(config, args.messages, args.seed + 1000 * r, trajectory.resume)
            generated = time.perf_counter()
            with Fuzzer(targets, config, credentials) as fuzzer:
                report.outcomes += fuzzer.run(generated_cases).outcomes
            generate_s, send_s = generate_s + generated - start, send_s + time.perf_counter() - generated
            readings.append({kind: server.stats() if server.alive else None for kind, server in servers.items()})
        after_traffic = valid_traffic(targets, config, credentials, "after")
        alive = {kind: server.alive for kind, server in servers.items()}

    def reading(kind: str, key: str, i: int) -> str:
        value = readings[i][kind]
        return "-" if value is None else f"{value[key]:.1f}" if key == "rss_mb" else str(value[key])

    server_rows = [[kind, "yes" if alive[kind] else "NO (crashed)",
                    " / ".join(reading(kind, "rss_mb", i) for i in range(len(readings))),
                    " / ".join(reading(kind, "threads", i) for i in range(len(readings)))] for kind in servers]

    failures = Counter(o.rpc for o in report.outcomes if o.got.code in HANDLER_FAILURES)
    rows = [[rpc, c["messages"], c["invalid"], c["as expected"], c["messages"] - c["as expected"], failures[rpc]]
            for rpc, c in report.by_rpc().items()]
    total = [sum(r[i] for r in rows) for i in range(1, 6)]
    print(f"\n{len(report.outcomes)} messages in {args.rounds} rounds (seed {args.seed}, tls={args.tls}): generated in "
          f"{generate_s:.1f} s, sent and answered in {send_s:.1f} s")
    print(format_table(["rpc", "messages", "invalid", "answered as expected", "mismatches", "handler failures"],
                       rows + [["all", *total]]))
    print()
    rounds = " / ".join(["before"] + [f"after {r + 1}" for r in range(args.rounds)])
    print(format_table(["server", "alive at the end", f"RSS MB ({rounds})", f"threads ({rounds})"], server_rows))
    print("threads: OS threads of the server process; they grow only to the bounded pools started on demand "
          "(ingest_threads, the event loop's workers for control calls)")
    print()
    print(format_table(["valid traffic afterwards", "served", "sent"], [[k, *v] for k, v in after_traffic.items()]))
    print()
    by_label = sorted(report.by_label().items())
    print(format_table(
        ["rpc", "mutation", "messages", "expected answer", "as expected"],
        [[rpc, label, c["messages"], ", ".join(k.removeprefix("expected ") for k in c if k.startswith("expected ")),
          c["as expected"]] for (rpc, label), c in by_label],
    ))
    for o in report.mismatches[:20]:
        print(f"MISMATCH {o.rpc} {o.label}: expected {o.expected}, got {o.got}")


if __name__ == "__main__":
    main()
