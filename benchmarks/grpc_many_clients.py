"""Many open streams against one trajectory server (its own process): a valid sender's latency and the
server's threads and memory as idle and slow streams are added. Prints a table last.

Each row holds `streams` streams open (a quarter idle: open and send nothing; the rest slow: one
64-token sample every `--period` s) over 16 connections, while a valid sender sends one sample per
new stream, 50 ms apart; "p50/p99" are its seconds per send (open, grant, sample, ack).

Usage (repo root): python benchmarks/grpc_many_clients.py [--tls off|job] [--streams 0 64 256 1024] [--sends 100]
"""

import argparse
import statistics
import sys
import time

from sparrow.bench.fuzz.harness import ServerProcess, StreamLoad, send_latencies
from sparrow.coordinator.transport import JobCredentials, TransportConfig
from sparrow.tables import format_table


def quantile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[round(q * 100) - 1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tls", choices=["off", "job"], default="off")
    parser.add_argument("--streams", type=int, nargs="+", default=[0, 64, 256, 1024])
    parser.add_argument("--sends", type=int, default=100, help="valid sends measured per row")
    parser.add_argument("--period", type=float, default=2.0, help="seconds between two samples of a slow stream")
    args = parser.parse_args()

    cfg = TransportConfig(port=0, vocab_size=1000, max_streams=4096, security={"tls": args.tls})
    creds = JobCredentials.create(cfg)
    rows, baseline = [], None
    with ServerProcess(cfg, creds) as server:
        send_latencies(server.address, cfg, creds, 20, "warm-up")
        for streams in args.streams:
            idle = streams // 4
            with StreamLoad(server.address, cfg, creds, idle, streams - idle, args.period, prefix=f"load{streams}") as load:
                start = time.perf_counter()
                seconds = send_latencies(server.address, cfg, creds, args.sends, f"valid{streams}", pause_s=0.05)
                elapsed = time.perf_counter() - start
                stats = server.stats()
            p50, p99 = quantile(seconds, 0.5), quantile(seconds, 0.99)
            baseline = baseline or p50
            rows.append([
                streams, idle, streams - idle, int(stats["streams_open"]), f"{p50 * 1e3:.1f}", f"{p99 * 1e3:.1f}",
                f"{p50 / baseline:.2f}", f"{load.acks['ACK_STATUS_ACCEPTED'] / elapsed:.0f}", sum(load.errors.values()),
                stats["threads"], f"{stats['rss_mb']:.0f}",
            ])
            print(f"{streams} streams done", file=sys.stderr, flush=True)
        alive = server.alive
    print(f"\ntrajectory server, tls={args.tls}, {args.sends} valid sends per row, slow streams send every {args.period:g} s; "
          f"server alive at the end: {alive}")
    print(format_table(
        ["streams", "idle", "slow", "open at server", "valid p50 ms", "valid p99 ms", "p50 / unloaded", "slow acks/s",
         "stream errors", "server threads", "server RSS MB"],
        rows,
    ))
    print("server threads: OS threads of the server process (gRPC core's pollers, the event loop, the consumer, and up "
          f"to ingest_threads={cfg.ingest_threads} started on demand); none is tied to a stream")


if __name__ == "__main__":
    main()
