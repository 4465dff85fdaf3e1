"""A trajectory server in a child process, and many-stream load against it; `PoolRecorder`, a control
handler that resizes pools like the coordinator's and records what it was asked.

Shared by tests (test_grpc_load, test_grpc_fuzz, test_grpc_security) and the benchmarks grpc_many_clients.py
and fuzz_grpc.py. The server runs in its own process so that its threads and memory are measured alone and a
crash shows as a dead process. Run as `python -m sparrow.bench.fuzz.harness`
it is that child: it reads its config and credentials from stdin, prints its port, empties its queue
and answers `stats` / `resume` lines with one JSON line each.
"""

import asyncio
import base64
import json
import pickle
import random
import subprocess
import sys
import threading
import time
from collections import Counter

import grpc
import psutil

from sparrow.protos import sparrow_v1_pb2 as pb
from sparrow.protos import sparrow_v1_pb2_grpc as pb_grpc

from sparrow.coordinator.transport.auth import HEADER, bearer
from sparrow.coordinator.transport.client import TrajectoryClient
from sparrow.coordinator.transport.config import TransportConfig
from sparrow.coordinator.transport.control import Health, PoolStatus
from sparrow.coordinator.transport.security import JobCredentials

from .examples import valid_sample

SEPARATE_CONNECTION = ("grpc.use_local_subchannel_pool", 1)
"""Channel option: a channel of its own TCP connection (gRPC shares one between equal channels otherwise)."""


class PoolRecorder:
    """A coordinator-like ControlHandler: accepts every resize (the servicer has validated it), records
    (pool, size), and reports the pools in `health()`; drains are UNIMPLEMENTED, as the coordinator's."""

    component = "coordinator"

    def __init__(self, rollout: int = 2, trainer: int = 1):
        self.resizes: list[tuple[str, int]] = []
        self.pools = {"rollout": rollout, "trainer": trainer}
        self._lock = threading.Lock()

    def resize_pool(self, pool: str, size: int) -> tuple[bool, int, str]:
        with self._lock:
            self.resizes.append((pool, size))
            was, self.pools[pool] = self.pools[pool], size
        return True, size, f"was {was}; new workers join at the next weights version"

    def drain(self, timeout_s: float):
        raise NotImplementedError("the coordinator does not drain; stop the job instead")

    def health(self) -> Health:
        with self._lock:
            pools = [PoolStatus("rollout", self.pools["rollout"], self.pools["rollout"], resizable=True),
                     PoolStatus("trainer", self.pools["trainer"], self.pools["trainer"])]
        return Health("serving", self.component, 3, 7, {"step": 7.0}, pools)


class ServerProcess:
    """A TrajectoryServer (or, `kind="control"`, a ControlServer around a `PoolRecorder`) in a child process
    whose consumer empties the queue as it fills."""

    def __init__(self, config: TransportConfig, credentials: JobCredentials, kind: str = "trajectory"):
        if kind not in ("trajectory", "control"):
            raise ValueError(f"kind={kind!r}: 'trajectory' or 'control'")
        self.config, self.credentials, self.kind = config, credentials, kind
        self._port: int | None = None
        self._proc: subprocess.Popen | None = None

    def __enter__(self) -> "ServerProcess":
        """Starts the child and returns at once (several children start side by side); `port` waits for it."""
        self._proc = subprocess.Popen([sys.executable, "-m", __name__], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        blob = pickle.dumps((self.config.model_dump_json(), self.credentials, self.kind))
        self._proc.stdin.write(base64.b64encode(blob).decode() + "\n")
        self._proc.stdin.flush()
        return self

    @property
    def port(self) -> int:
        """The server's port, once it serves (its first line)."""
        if self._port is None:
            self._port = self._reply()["port"]
        return self._port

    def _reply(self) -> dict:
        line = self._proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the {self.kind} server process exited (code {self._proc.poll()})")
        return json.loads(line)

    def __exit__(self, *exc) -> None:
        self._proc.stdin.close()
        try:
            self._proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def alive(self) -> bool:
        return self._proc.poll() is None

    def _command(self, name: str) -> dict:
        self.port  # noqa: B018 (the port line comes first)
        self._proc.stdin.write(name + "\n")
        self._proc.stdin.flush()
        return self._reply()

    def stats(self) -> dict[str, float]:
        """The server's `stats()` plus `threads` (OS threads of its process), `rss_mb` and `consumed`."""
        return self._command("stats")

    def resume(self) -> None:
        self._command("resume")


def _serve_child() -> None:
    from sparrow.coordinator.transport.servers import ControlServer, TrajectoryServer

    config_json, credentials, kind = pickle.loads(base64.b64decode(sys.stdin.readline()))
    config = TransportConfig.model_validate_json(config_json)
    consumed, recorder = [0], PoolRecorder()
    if kind == "control":
        server = ControlServer(config, credentials, recorder)
    else:
        server = TrajectoryServer(config, credentials, server_id=f"harness-{kind}")
    port = server.start()

    def consume():
        while True:
            consumed[0] += len(server.get_batch(256, timeout=0.5))

    if kind != "control":
        threading.Thread(target=consume, name="consumer", daemon=True).start()
    print(json.dumps({"port": port}), flush=True)
    me = psutil.Process()
    for line in sys.stdin:
        if line.strip() == "resume":
            if kind != "control":
                server.resume()
            reply = {}
        else:
            reply = {**server.stats(), "threads": me.num_threads(), "rss_mb": me.memory_info().rss / 2**20,
                     "consumed": consumed[0], "resizes": len(recorder.resizes)}
        print(json.dumps(reply), flush=True)
    server.stop(grace=0)


def aio_channel(address: str, credentials: JobCredentials, options: list) -> tuple[grpc.aio.Channel, tuple]:
    """A grpc.aio channel and the metadata its calls need (the token travels as call credentials over TLS)."""
    options = [*options, SEPARATE_CONNECTION]
    if credentials.tls:
        return grpc.aio.secure_channel(address, credentials.channel_credentials(), options=credentials.channel_options(options)), ()
    return grpc.aio.insecure_channel(address, options=options), ((HEADER, bearer(credentials.token)),)


class StreamLoad:
    """`idle` streams that open and then send nothing, and `slow` streams that send one valid sample every
    `period_s`, spread over `connections` connections; held open from `__enter__` to `__exit__`."""

    def __init__(self, address: str, config: TransportConfig, credentials: JobCredentials, idle: int, slow: int,
                 period_s: float = 2.0, connections: int = 16, prefix: str = "load"):
        self.address, self.config, self.credentials = address, config, credentials
        self.idle, self.slow, self.period_s, self.connections, self.prefix = idle, slow, period_s, connections, prefix
        self.granted = 0
        self.acks: Counter[str] = Counter()
        self.errors: Counter[str] = Counter()
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread: threading.Thread | None = None

    def __enter__(self) -> "StreamLoad":
        self._thread = threading.Thread(target=asyncio.run, args=(self._main(),), name="stream-load", daemon=True)
        self._thread.start()
        if not self._ready.wait(120):
            raise TimeoutError(f"only {self.granted} of {self.idle + self.slow} streams were granted within 120 s")
        return self

    def __exit__(self, *exc) -> None:
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(30)

    async def _main(self) -> None:
        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        channels = [aio_channel(self.address, self.credentials, self.config.grpc_options()) for _ in range(self.connections)]
        total = self.idle + self.slow
        tasks = [asyncio.create_task(self._stream(*channels[i % self.connections], i, sends=i >= self.idle)) for i in range(total)]
        if total == 0:
            self._ready.set()
        await self._stop.wait()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.gather(*(channel.close() for channel, _ in channels))

    async def _stream(self, channel: grpc.aio.Channel, metadata: tuple, index: int, sends: bool) -> None:
        call = pb_grpc.TrajectoryServiceStub(channel).StreamSamples(metadata=metadata)
        try:
            await call.write(pb.SampleStreamRequest(open=pb.StreamOpen(client_id=f"{self.prefix}-{index}")))
            await call.read()
            self.granted += 1
            if self.granted == self.idle + self.slow:
                self._ready.set()
            await asyncio.sleep(random.Random(index).uniform(0, self.period_s))  # spread the senders over a period
            n = 0
            while sends:
                await call.write(pb.SampleStreamRequest(sample=valid_sample(n, f"{self.prefix}-{index}")))
                reply = await call.read()
                self.acks[pb.AckStatus.Name(reply.ack.status)] += 1
                n += 1
                await asyncio.sleep(self.period_s)
            await asyncio.Event().wait()
        except grpc.aio.AioRpcError as exc:
            self.errors[exc.code().name] += 1
        finally:
            call.cancel()


def send_latencies(address: str, config: TransportConfig, credentials: JobCredentials, n: int, prefix: str,
                   pause_s: float = 0.0) -> list[float]:
    """Seconds per `send` of one valid sample, each on a new stream (open, grant, sample, ack), `pause_s` apart."""
    out = []
    with TrajectoryClient(address, config, credentials, client_id=prefix) as client:
        for i in range(n):
            time.sleep(pause_s)
            start = time.perf_counter()
            report = client.send([valid_sample(i, prefix)])
            out.append(time.perf_counter() - start)
            if report.accepted != 1:
                raise RuntimeError(f"{prefix}-{i} was not accepted: {report}")
    return out


if __name__ == "__main__":
    _serve_child()
