"""Real gRPC on 127.0.0.1: concurrency, backpressure, duplicates, invalid messages, retries, drain, control."""

import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch

from sparrow.coordinator.transport import (
    ControlClient,
    JobCredentials,
    RetryConfig,
    Trajectory,
    TrajectoryClient,
    TrajectoryServer,
    TransportConfig,
    TransportError,
    trajectory_from_proto,
    trajectory_to_proto,
    validate_sample,
)
from sparrow.coordinator.transport import loop as transport_loop
from sparrow.coordinator.transport.ingest import AckedIngest
from sparrow.protos import sparrow_v1_pb2 as pb
from sparrow.protos import sparrow_v1_pb2_grpc as pb_grpc
from sparrow.rollout_workers.api import RolloutRequest, RolloutSample


def trajectory(i: int, n: int = 16, k: int = 4, worker: str = "w0") -> Trajectory:
    g = torch.Generator().manual_seed(i)
    s = RolloutSample(
        request_id=f"{worker}-p{i // 4}", sample_index=i % 4, prompt_token_ids=[1, 2, 3],
        token_ids=torch.randint(0, 500, (n,), generator=g), logprobs=-torch.rand(n, generator=g),
        top_ids=torch.randint(0, 500, (n, k), generator=g), top_logprobs=-torch.rand(n, k, generator=g),
        blocks_attended=torch.full((n,), 7, dtype=torch.int32), finish_reason="stop", policy_version=1, schedule_version=0,
    )
    return Trajectory.of(s, reward=float(i % 2), worker_id=worker)


def config(**kw) -> TransportConfig:
    kw.setdefault("retry", RetryConfig(max_attempts=40, initial_backoff_s=0.02, max_backoff_s=0.2))
    return TransportConfig(port=kw.pop("port", 0), vocab_size=500, **kw)


CREDS = JobCredentials.create(TransportConfig())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def drain_all(server, expected: int, delay: float = 0.0, timeout: float = 20.0) -> list[Trajectory]:
    got, deadline = [], time.monotonic() + timeout
    while len(got) < expected and time.monotonic() < deadline:
        item = server.get(timeout=0.2)
        if item is not None:
            got.append(item)
            time.sleep(delay)
    return got


def test_concurrent_senders_deliver_every_sample_exactly_once():
    with TrajectoryServer(config(), CREDS) as server:
        reports = {}

        def sender(w):
            with TrajectoryClient(server.address, server.config, CREDS, client_id=f"w{w}") as client:
                reports[w] = client.send(trajectory(i, worker=f"w{w}") for i in range(40))

        threads = [threading.Thread(target=sender, args=(w,)) for w in range(4)]
        for t in threads:
            t.start()
        got = drain_all(server, 160)
        for t in threads:
            t.join()
    assert all(r.accepted == 40 and not r.rejected for r in reports.values())
    ids = [t.sample_id for t in got]
    assert len(ids) == 160 == len(set(ids))
    assert {t.worker_id for t in got} == {"w0", "w1", "w2", "w3"}


def test_full_queue_makes_senders_wait_without_dropping():
    cfg = config(queue_capacity=4, stream_window=2)
    with TrajectoryServer(cfg, CREDS) as server:
        done = []

        def sender(w):
            with TrajectoryClient(server.address, cfg, CREDS) as client:
                done.append(client.send(trajectory(i, worker=f"w{w}") for i in range(10)))

        threads = [threading.Thread(target=sender, args=(w,)) for w in range(3)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 10
        while server.queue_depth < 4 and time.monotonic() < deadline:  # no consumer yet: the queue fills
            time.sleep(0.02)
        time.sleep(0.3)
        assert server.queue_depth == 4 and not done  # ... and the senders wait
        depths = []
        got = []
        while len(got) < 30:
            item = server.get(timeout=5)
            assert item is not None, f"only {len(got)} of 30 samples arrived"
            got.append(item)
            depths.append(server.queue_depth)
            time.sleep(0.01)  # slow consumer
        for t in threads:
            t.join()
        assert server.stats()["waits"] > 0
    assert max(depths) <= 4
    assert len({t.sample_id for t in got}) == 30 and sum(r.accepted for r in done) == 30


def test_resent_samples_are_accepted_once_and_acked_duplicate():
    with TrajectoryServer(config(), CREDS) as server, TrajectoryClient(server.address, server.config, CREDS) as client:
        first = client.send(trajectory(i) for i in range(5))
        again = client.send(trajectory(i) for i in range(3, 8))
        assert (first.accepted, first.duplicate) == (5, 0)
        assert (again.accepted, again.duplicate) == (3, 2)
        assert len(drain_all(server, 8, timeout=2)) == 8


def test_sample_whose_ack_was_lost_is_acked_duplicate_on_resend():
    with TrajectoryServer(config(), CREDS) as server:
        channel = CREDS.channel(server.address)
        sent = threading.Event()

        def requests():
            yield pb.SampleStreamRequest(open=pb.StreamOpen(client_id="flaky"))
            yield pb.SampleStreamRequest(sample=trajectory_to_proto(trajectory(0)))
            sent.wait(10)

        call = pb_grpc.TrajectoryServiceStub(channel).StreamSamples(requests())
        deadline = time.monotonic() + 5
        while server.queue_depth == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        call.cancel()  # the connection drops before the worker reads its ack
        sent.set()
        channel.close()
        with TrajectoryClient(server.address, server.config, CREDS) as client:
            report = client.send([trajectory(0), trajectory(1)])
        assert (report.accepted, report.duplicate) == (1, 1)
        assert [t.sample_id for t in drain_all(server, 2, timeout=2)] == ["w0-p0#0", "w0-p0#1"]


def test_invalid_samples_get_invalid_argument_naming_the_field_and_the_stream_goes_on():
    with TrajectoryServer(config(), CREDS) as server, TrajectoryClient(server.address, server.config, CREDS) as client:
        short = trajectory_to_proto(trajectory(1))
        del short.logprobs[-1]
        out_of_vocab = trajectory_to_proto(trajectory(2))
        out_of_vocab.token_ids[0] = 500
        negative = trajectory_to_proto(trajectory(3))
        negative.policy_version = -1
        messages = [trajectory_to_proto(trajectory(0)), short, out_of_vocab, negative, trajectory_to_proto(trajectory(4))]
        report = client.send(messages)
        assert report.accepted == 2
        assert [(r.id, r.field) for r in report.rejected] == [
            ("w0-p0#1", "logprobs"), ("w0-p0#2", "token_ids"), ("w0-p0#3", "policy_version")
        ]
        assert "has 15 values for 16 tokens" in report.rejected[0].message
        assert "[0]=500 is out of range" in report.rejected[1].message
        assert server.stats()["invalid_argument"] == 3
        assert client.send([trajectory(9)]).accepted == 1  # still serving


def test_a_failed_sample_with_a_bad_top_k_is_rejected_and_the_stream_delivers_the_next():
    """Before: top_k=-1 on a FINISH_REASON_ERROR sample skipped validation, crashed the conversion and ended the
    stream with UNKNOWN (TransportError), so the third sample was never delivered."""
    failed = RolloutSample.failed(RolloutRequest("w0-p9", (1, 2)), 0, "engine crashed", policy_version=1, schedule_version=0)
    bad = trajectory_to_proto(Trajectory.of(failed))
    bad.top_k = -1
    with TrajectoryServer(config(), CREDS) as server, TrajectoryClient(server.address, server.config, CREDS) as client:
        report = client.send([trajectory_to_proto(trajectory(0)), bad, trajectory_to_proto(trajectory(1))])
        assert (report.accepted, [(r.id, r.field) for r in report.rejected], report.streams) == (2, [("w0-p9#0", "top_k")], 1)
        assert [t.sample_id for t in drain_all(server, 2, timeout=2)] == ["w0-p0#0", "w0-p0#1"]


def test_any_conversion_error_rejects_that_sample_alone_naming_the_error():
    """A converter that fails on one message (a bug any sample could trigger) rejects that message; before,
    the exception left the stream handler and ended the stream with UNKNOWN."""
    cfg = config()

    def convert(msg):
        if msg.sample_id == "w0-p0#1":
            raise ZeroDivisionError("division by zero")
        return trajectory_from_proto(msg)

    ingest = AckedIngest("sample", "sample_id", lambda msg: validate_sample(msg, cfg), convert, cfg, "t")
    ingest.open()
    try:
        acks = [transport_loop.run(ingest.ingest(trajectory_to_proto(trajectory(i)))) for i in range(3)]
    finally:
        ingest.close()
    assert [(pb.AckStatus.Name(a.status), a.field) for a in acks] == [
        ("ACK_STATUS_ACCEPTED", ""), ("ACK_STATUS_INVALID_ARGUMENT", "sample"), ("ACK_STATUS_ACCEPTED", "")]
    assert "ZeroDivisionError: division by zero" in acks[1].message
    assert [t.sample_id for t in ingest.get_batch(10, timeout=1)] == ["w0-p0#0", "w0-p0#2"]


def test_stream_must_open_first():
    with TrajectoryServer(config(), CREDS) as server, CREDS.channel(server.address) as channel:
        stub = pb_grpc.TrajectoryServiceStub(channel)
        with pytest.raises(grpc.RpcError) as exc:
            list(stub.StreamSamples(iter([pb.SampleStreamRequest(sample=trajectory_to_proto(trajectory(0)))])))
        assert exc.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "StreamOpen" in exc.value.details()


def test_client_retries_until_the_server_comes_up():
    port = free_port()
    cfg = config(port=port)
    server = TrajectoryServer(cfg, CREDS)
    threading.Timer(0.4, server.start).start()
    try:
        with TrajectoryClient(f"127.0.0.1:{port}", cfg, CREDS) as client:
            report = client.send(trajectory(i) for i in range(6))
        assert report.accepted == 6 and report.streams > 1
    finally:
        time.sleep(0.1)
        server.stop(grace=0)


def test_server_restart_mid_send_loses_nothing():
    port = free_port()
    cfg = config(port=port, queue_capacity=2, stream_window=1)
    first = TrajectoryServer(cfg, CREDS)
    first.start()
    result = {}

    def sender():
        with TrajectoryClient(first.address, cfg, CREDS) as client:
            result["report"] = client.send(trajectory(i) for i in range(20))

    thread = threading.Thread(target=sender)
    thread.start()
    got = drain_all(first, 5, delay=0.02)
    first.stop(grace=0)  # samples queued but unconsumed die with this server; the sender resends the unacked
    leftover = drain_all(first, 2, timeout=0.3)
    second = TrajectoryServer(cfg, CREDS)
    second.start()
    got2, deadline = [], time.monotonic() + 20
    try:
        while (thread.is_alive() or second.queue_depth) and time.monotonic() < deadline:
            item = second.get(timeout=0.05)
            got2 += [item] if item is not None else []
        thread.join()
    finally:
        second.stop(grace=0)
    ids = {t.sample_id for t in got + leftover + got2}
    assert ids == {trajectory(i).sample_id for i in range(20)}
    assert result["report"].streams >= 2 and not result["report"].rejected


def test_drain_refuses_new_samples_until_resumed():
    with TrajectoryServer(config(), CREDS) as server, ControlClient(server.address, server.config, CREDS) as control:
        assert control.drain(timeout_s=0.0) == (True, 0)
        assert control.health().status == "draining"
        threading.Timer(0.3, server.resume).start()
        with TrajectoryClient(server.address, server.config, CREDS) as client:
            report = client.send(trajectory(i) for i in range(4))
        assert report.accepted == 4 and report.streams > 1
        assert server.stats()["unavailable"] >= 1
        assert control.health().status == "serving"


def test_waiting_drains_hold_no_thread_so_health_and_a_short_drain_answer_at_once():
    """16 drains wait for a queue nobody empties. Before, each held a thread of the loop's default executor
    (6 on 2 cores), which Health shares: Health and a later drain waited for one of them to end (3 s)."""
    with TrajectoryServer(config(), CREDS) as server, ControlClient(server.address, server.config, CREDS) as control:
        with TrajectoryClient(server.address, server.config, CREDS) as client:
            assert client.send([trajectory(0)]).accepted == 1  # never consumed: drains wait their whole timeout
        with ThreadPoolExecutor(16) as pool:
            waiting = [pool.submit(control.drain, 3.0) for _ in range(16)]
            time.sleep(0.5)
            start = time.monotonic()
            health = control.health()
            health_s = time.monotonic() - start
            short = control.drain(0.2)
            short_s = time.monotonic() - start - health_s
            results = [w.result() for w in waiting]
        assert (health.status, health.gauges["queue_depth"]) == ("draining", 1.0) and health_s < 1.0, health_s
        assert short == (False, 1) and short_s < 1.0, short_s
        assert results == [(False, 1)] * 16


def test_drain_gives_up_after_attempts_with_a_clear_error():
    cfg = config(retry=RetryConfig(max_attempts=3, initial_backoff_s=0.01, max_backoff_s=0.01))
    with TrajectoryServer(cfg, CREDS) as server, TrajectoryClient(server.address, cfg, CREDS) as client:
        server.drain(0.0)
        with pytest.raises(TransportError, match="gave up after 3 failed streams .*draining"):
            client.send([trajectory(0)])


def test_trajectory_server_control_answers_drain_and_health_and_nothing_removed():
    with TrajectoryServer(config(), CREDS) as server, ControlClient(server.address, server.config, CREDS) as control:
        stub = pb_grpc.ControlServiceStub(control.channel)
        with pytest.raises(grpc.RpcError) as exc:
            stub.Drain(pb.DrainRequest(timeout_s=-1))
        assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "timeout_s" in exc.value.details()
        health = control.health()
        assert (health.status, health.component, health.schedule_version, health.policy_version) == (
            "serving", "trajectory-server", 0, 0)
        assert health.gauges["queue_capacity"] == server.config.queue_capacity and health.pools == []
        # Schedules and statistics travel over Ray now: a client built against the older API (UpdateSchedule,
        # MonitorService.StreamStats) gets UNIMPLEMENTED, as the coordinator answered UpdateSchedule before.
        update = control.channel.unary_unary("/sparrow.v1.ControlService/UpdateSchedule", request_serializer=None,
                                             response_deserializer=None)
        stats = control.channel.stream_stream("/sparrow.v1.MonitorService/StreamStats", request_serializer=None,
                                              response_deserializer=None)
        for call in (lambda: update(b"", timeout=5), lambda: list(stats(iter([b""]), timeout=5))):
            with pytest.raises(grpc.RpcError) as exc:
                call()
            assert exc.value.code() == grpc.StatusCode.UNIMPLEMENTED
        assert server.stats()["unauthenticated"] == 0 and control.health().status == "serving"


def open_stream(channel: grpc.Channel, hold: threading.Event):
    """A raw stream that opens and then sends nothing until `hold` is set; returns its reply iterator."""

    def requests():
        yield pb.SampleStreamRequest(open=pb.StreamOpen(client_id="idle"))
        hold.wait(30)

    return pb_grpc.TrajectoryServiceStub(channel).StreamSamples(requests())


def test_idle_stream_is_closed_naming_the_timeout_and_a_pausing_sender_still_delivers():
    cfg = config(stream_idle_timeout_s=0.5)
    with TrajectoryServer(cfg, CREDS) as server, CREDS.channel(server.address) as channel:
        hold = threading.Event()
        replies = open_stream(channel, hold)
        start = time.monotonic()
        assert next(replies).grant.window == cfg.stream_window
        with pytest.raises(grpc.RpcError) as exc:
            next(replies)
        hold.set()
        assert 0.4 < time.monotonic() - start < 5
        assert exc.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert "nothing received for 0.5 s (transport.stream_idle_timeout_s)" in exc.value.details()
        assert server.stats()["streams_idle_closed"] == 1

        def pausing():  # a rollout worker whose next group takes longer than the idle timeout
            yield trajectory(0)
            time.sleep(1.2)
            yield trajectory(1)

        with TrajectoryClient(server.address, cfg, CREDS) as client:
            report = client.send(pausing())
        assert report.accepted == 2 and report.streams == 2
        assert [t.sample_id for t in drain_all(server, 2, timeout=2)] == ["w0-p0#0", "w0-p0#1"]


def test_streams_beyond_max_streams_are_refused_at_once_and_others_go_on():
    cfg = config(max_streams=2, stream_idle_timeout_s=30)
    with TrajectoryServer(cfg, CREDS) as server, CREDS.channel(server.address) as channel:
        holds = [threading.Event(), threading.Event()]
        held = [open_stream(channel, hold) for hold in holds]
        assert all(next(replies).HasField("grant") for replies in held)
        assert server.stats()["streams_open"] == 2
        start = time.monotonic()
        with pytest.raises(grpc.RpcError) as exc:
            next(open_stream(channel, threading.Event()))
        assert time.monotonic() - start < 2
        assert exc.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "2 streams are open on this server (transport.max_streams=2)" in exc.value.details()
        with ControlClient(server.address, cfg, CREDS) as control:  # unary calls are not streams
            assert control.health().gauges["streams_refused"] == 1
        holds[0].set()  # one idle stream ends: a sender gets its slot (it retries RESOURCE_EXHAUSTED)
        with TrajectoryClient(server.address, cfg, CREDS) as client:
            assert client.send([trajectory(0)]).accepted == 1
        holds[1].set()


def test_a_client_that_reads_no_replies_loses_its_stream_after_the_idle_timeout():
    cfg = config(stream_idle_timeout_s=0.5)
    with TrajectoryServer(cfg, CREDS) as server:
        # A receive window of (almost) nothing: the server cannot even write the grant.
        unread = CREDS.channel(server.address, [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 1)])
        hold = threading.Event()
        call = open_stream(unread, hold)
        deadline, opened = time.monotonic() + 10, False
        while time.monotonic() < deadline and not (opened and server.stats()["streams_open"] == 0):
            opened = opened or server.stats()["streams_open"] == 1
            time.sleep(0.05)
        assert opened and server.stats()["streams_open"] == 0 and server.stats()["streams_idle_closed"] == 1
        call.cancel()
        hold.set()
        unread.close()
        with TrajectoryClient(server.address, cfg, CREDS) as client:
            assert client.send([trajectory(0)]).accepted == 1
