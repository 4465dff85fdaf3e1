"""Many streams against a server in its own process: idle and slow streams neither starve a valid sender
nor add server threads (before grpc.aio, 20 idle streams took 16 pool threads and starved everyone)."""

import statistics

from sparrow.bench.fuzz.harness import ServerProcess, StreamLoad, send_latencies
from sparrow.coordinator.transport import JobCredentials, TransportConfig


def test_256_streams_neither_starve_a_valid_sender_nor_grow_the_server_threads():
    cfg = TransportConfig(port=0, vocab_size=1000, max_streams=512)
    creds = JobCredentials.create(cfg)
    with ServerProcess(cfg, creds) as server:
        send_latencies(server.address, cfg, creds, 10, "warm-up")
        baseline = send_latencies(server.address, cfg, creds, 40, "unloaded", pause_s=0.02)
        before = server.stats()
        with StreamLoad(server.address, cfg, creds, idle=64, slow=192, period_s=1.0) as load:
            loaded = send_latencies(server.address, cfg, creds, 40, "loaded", pause_s=0.05)
            during = server.stats()
        assert load.granted == 256 and not load.errors
        assert sum(load.acks.values()) == load.acks["ACK_STATUS_ACCEPTED"] > 100  # the slow senders were served too
        assert during["streams_open"] == 256
        assert during["threads"] <= before["threads"] + 2, (before["threads"], during["threads"])
        p50, p50_loaded = statistics.median(baseline), statistics.median(loaded)
        assert p50_loaded < 5 * p50 + 0.05, (p50, p50_loaded)
        assert max(loaded) < 2.0  # never near the 10 s deadline that the old thread pool blew
        assert server.alive
