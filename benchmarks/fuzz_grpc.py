"""Fuzz every RPC with hypothesis-generated malformed messages (sparrow.coordinator.transport.fuzz) against
a trajectory and a monitor server in child processes; prints tables last.

Checked: every message gets the answer its mutation calls for (field mutations: INVALID_ARGUMENT naming
the field, in the ack of a stream or the status of a unary call; protocol mutations: the status the
protocol defines), no server process dies and no handler fails (UNKNOWN / INTERNAL), server memory
and threads stay flat, and valid traffic is served afterwards.

Usage (repo root): python benchmarks/fuzz_grpc.py [--messages 10000] [--seed 0] [--tls off|job]
"""

import argparse
import time
from collections import Counter

from sparrow.coordinator.transport import JobCredentials
from sparrow.coordinator.transport.fuzz import Fuzzer, FuzzTargets, valid_traffic
from sparrow.coordinator.transport.fuzz_cases import cases, fuzz_config
from sparrow.coordinator.transport.harness import ServerProcess
from sparrow.tables import format_table

HANDLER_FAILURES = ("UNKNOWN", "INTERNAL")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=10_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tls", choices=["off", "job"], default="off")
    args = parser.parse_args()

    config = fuzz_config(security={"tls": args.tls})
    credentials = JobCredentials.create(config)
    with ServerProcess(config, credentials) as trajectory, ServerProcess(config, credentials, "monitor") as monitor:
        targets = FuzzTargets(trajectory.address, monitor.address, trajectory.resume)
        valid_traffic(targets, config, credentials, "before", schedule_version=10**9)
        before = {"trajectory": trajectory.stats(), "monitor": monitor.stats()}
        start = time.perf_counter()
        generated_cases = cases(config, args.messages, args.seed, trajectory.resume)
        generated = time.perf_counter()
        with Fuzzer(targets, config, credentials) as fuzzer:
            report = fuzzer.run(generated_cases)
        sent = time.perf_counter()
        after_traffic = valid_traffic(targets, config, credentials, "after", schedule_version=10**9 + 1)
        servers = []
        for kind, server in (("trajectory", trajectory), ("monitor", monitor)):
            alive = server.alive
            after = server.stats() if alive else {"rss_mb": float("nan"), "threads": "-"}
            servers.append([kind, "yes" if alive else "NO (crashed)", f"{before[kind]['rss_mb']:.1f}", f"{after['rss_mb']:.1f}",
                            before[kind]["threads"], after["threads"]])

    failures = Counter(o.rpc for o in report.outcomes if o.got.code in HANDLER_FAILURES)
    rows = [[rpc, c["messages"], c["invalid"], c["as expected"], c["messages"] - c["as expected"], failures[rpc]]
            for rpc, c in report.by_rpc().items()]
    total = [sum(r[i] for r in rows) for i in range(1, 6)]
    print(f"\n{len(report.outcomes)} messages (seed {args.seed}, tls={args.tls}): generated in {generated - start:.1f} s, "
          f"sent and answered in {sent - generated:.1f} s")
    print(format_table(["rpc", "messages", "invalid", "answered as expected", "mismatches", "handler failures"],
                       rows + [["all", *total]]))
    print()
    print(format_table(["server", "alive", "RSS before MB", "RSS after MB", "threads before", "threads after"], servers))
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
