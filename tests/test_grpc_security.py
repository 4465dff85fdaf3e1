"""The job token and TLS on real gRPC servers and clients (127.0.0.1), and the security config rules."""

import dataclasses
import pickle
import shutil
import socket
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import psutil
import pytest
import torch
from pydantic import ValidationError

from sparrow.bench.fuzz.harness import PoolRecorder, ServerProcess
from sparrow.bench.fuzz.relay import CountingRelay
from sparrow.coordinator.config import ConfigError, load_config
from sparrow.coordinator.transport import (
    ControlClient,
    ControlServer,
    CredentialsError,
    JobCredentials,
    RetryConfig,
    Trajectory,
    TrajectoryClient,
    TrajectoryServer,
    TransportConfig,
    TransportError,
    trajectory_to_proto,
)
from sparrow.coordinator.transport.control import CONTROL_REQUEST_MAX_BYTES
from sparrow.coordinator.transport.pki import issue, new_ca
from sparrow.protos import sparrow_v1_pb2 as pb
from sparrow.protos import sparrow_v1_pb2_grpc as pb_grpc
from sparrow.rollout_workers.api import RolloutSample


def trajectory(i: int) -> Trajectory:
    g = torch.Generator().manual_seed(i)
    s = RolloutSample(
        request_id=f"p{i // 4}", sample_index=i % 4, prompt_token_ids=[1, 2, 3],
        token_ids=torch.randint(0, 500, (8,), generator=g), logprobs=-torch.rand(8, generator=g),
        top_ids=torch.zeros(8, 0, dtype=torch.long), top_logprobs=torch.zeros(8, 0),
        blocks_attended=torch.full((8,), 2, dtype=torch.int32), finish_reason="stop", policy_version=1, schedule_version=0,
    )
    return Trajectory.of(s, reward=1.0, worker_id="w0")


def config(**security) -> TransportConfig:
    retry = RetryConfig(max_attempts=2, initial_backoff_s=0.01, max_backoff_s=0.01)
    return TransportConfig(port=0, vocab_size=500, retry=retry, security=security)


def refused(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as exc:
        call()
    return exc.value


def every_rpc(channel: grpc.Channel) -> dict:
    """One call of each RPC on `channel`, as thunks."""
    samples = pb_grpc.TrajectoryServiceStub(channel)
    control = pb_grpc.ControlServiceStub(channel)
    opening = [pb.SampleStreamRequest(open=pb.StreamOpen(client_id="x")),
               pb.SampleStreamRequest(sample=trajectory_to_proto(trajectory(50)))]
    return {
        "StreamSamples": lambda: list(samples.StreamSamples(iter(opening), timeout=5)),
        "Drain": lambda: control.Drain(pb.DrainRequest(timeout_s=0), timeout=5),
        "Health": lambda: control.Health(pb.HealthRequest(), timeout=5),
        "ResizePool": lambda: control.ResizePool(pb.ResizePoolRequest(pool="rollout", size=2), timeout=5),
    }


@pytest.mark.parametrize("tls", ["off", "job"])
def test_calls_without_the_job_token_are_unauthenticated_and_the_server_keeps_serving(tls):
    cfg = config(tls=tls)
    creds = JobCredentials.create(cfg)
    impostor = dataclasses.replace(creds, token="not-the-job-token-" + "x" * 20)
    bare = grpc.insecure_channel if tls == "off" else lambda a: grpc.secure_channel(a, grpc.ssl_channel_credentials(creds.ca_pem))
    with TrajectoryServer(cfg, creds) as server:
        with bare(server.address) as no_token, impostor.channel(server.address) as wrong_token:
            for channel, reason in ((no_token, "missing 'authorization' metadata"), (wrong_token, "not this job's token")):
                for rpc, call in every_rpc(channel).items():
                    error = refused(call)
                    assert (rpc, error.code()) == (rpc, grpc.StatusCode.UNAUTHENTICATED) and reason in error.details()
        assert server.stats()["unauthenticated"] == 8
        # Nothing the refused calls asked for happened: no sample queued, no drain.
        assert (server.queue_depth, server.health().status) == (0, "serving")
        with TrajectoryClient(server.address, cfg, creds) as client:
            assert client.send([trajectory(1), trajectory(2)]).accepted == 2
        with ControlClient(server.address, cfg, creds) as control:
            assert control.health().status == "serving"
        with TrajectoryClient(server.address, cfg, impostor) as client, pytest.raises(TransportError, match="UNAUTHENTICATED"):
            client.send([trajectory(3)])  # not retried: a wrong token stays wrong
        assert [t.sample_id for t in server.get_batch(10, timeout=2)] == ["p0#1", "p0#2"]


def status_of(call, *args) -> grpc.StatusCode:
    try:
        call(*args, timeout=30)
    except grpc.RpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


CONTROL_METHODS = ("Drain", "Health", "ResizePool")


def test_unary_calls_without_the_token_are_refused_before_their_body_is_read():
    """12 calls with 60 MiB bodies (under max_message_mb=64) to the control methods from a client without the token,
    through a relay that counts what the server takes off the wire. Before, each body was read before the refusal:
    all 720 MiB crossed and the server process grew from ~320 MB to ~1.3 GB RSS; now a few MiB per call do
    (what HTTP/2 flow control lets a client send before it hears the refusal)."""
    cfg = TransportConfig(port=0, vocab_size=500)
    creds = JobCredentials.create(cfg)
    body, calls_made = bytes(60 * 2**20), 12
    with ServerProcess(cfg, creds) as server, CountingRelay(server.port) as relay, \
            grpc.insecure_channel(relay.address, [("grpc.max_send_message_length", -1)]) as no_token:
        calls = [no_token.unary_unary(f"/sparrow.v1.ControlService/{m}") for m in CONTROL_METHODS]
        before = server.stats()
        with ThreadPoolExecutor(4) as pool:
            codes = list(pool.map(lambda i: status_of(calls[i % 3], body), range(calls_made)))
        after = server.stats()
    assert set(codes) == {grpc.StatusCode.UNAUTHENTICATED} and after["unauthenticated"] == calls_made
    assert relay.to_server < calls_made * len(body) / 4, f"{relay.to_server / 2**20:.0f} MiB reached the server"
    assert after["rss_mb"] - before["rss_mb"] < 60, (before["rss_mb"], after["rss_mb"])  # less than one body


def test_control_requests_over_their_size_limit_are_refused_unparsed():
    """A control request is at most CONTROL_REQUEST_MAX_BYTES, whatever max_message_mb allows samples; before,
    a 64 KiB ResizePool request was parsed and answered INVALID_ARGUMENT naming the pool."""
    cfg = config()
    creds = JobCredentials.create(cfg)
    huge = pb.ResizePoolRequest(pool="x" * 65_536, size=2)
    with ControlServer(cfg, creds, PoolRecorder()) as server, creds.channel(server.address) as channel:
        control = pb_grpc.ControlServiceStub(channel)
        error = refused(lambda: control.ResizePool(huge, timeout=5))
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert error.details() == (f"request: {huge.ByteSize()} bytes; a sparrow.v1.ResizePoolRequest is at most "
                                   f"{CONTROL_REQUEST_MAX_BYTES} bytes")
        assert control.Health(pb.HealthRequest(), timeout=5).component == "coordinator"  # still serving


@pytest.mark.parametrize("method", ["/sparrow.v1.ControlService/Shutdown", "/sparrow.v1.TrajectoryService/Stats",
                                    "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo"])
def test_unknown_methods_are_unauthenticated_without_the_token_and_unimplemented_with_it(method):
    """Before, an unknown method answered UNIMPLEMENTED to anyone, so a client without the token could list the
    methods that exist."""
    cfg = config()
    creds = JobCredentials.create(cfg)
    impostor = dataclasses.replace(creds, token="not-the-job-token-" + "x" * 20)
    with TrajectoryServer(cfg, creds) as server, grpc.insecure_channel(server.address) as no_token, \
            impostor.channel(server.address) as wrong_token, creds.channel(server.address) as job:
        codes = {name: (status_of(channel.unary_unary(method), b""),
                        status_of(lambda r, timeout: list(channel.stream_stream(method)(iter([r]), timeout=timeout)), b""))
                 for name, channel in (("no token", no_token), ("wrong token", wrong_token), ("job token", job))}
        assert codes == {"no token": (grpc.StatusCode.UNAUTHENTICATED,) * 2,
                         "wrong token": (grpc.StatusCode.UNAUTHENTICATED,) * 2,
                         "job token": (grpc.StatusCode.UNIMPLEMENTED,) * 2}
        assert server.stats()["unauthenticated"] == 4


def test_plaintext_and_untrusting_clients_cannot_talk_to_a_tls_server():
    cfg = config(tls="job")
    creds = JobCredentials.create(cfg)
    plaintext = JobCredentials(token=creds.token)
    other_ca = dataclasses.replace(creds, ca_pem=new_ca("another CA")[0])
    with TrajectoryServer(cfg, creds) as server:
        for stranger in (plaintext, other_ca):
            with TrajectoryClient(server.address, cfg, stranger) as client, pytest.raises(TransportError, match="UNAVAILABLE"):
                client.send([trajectory(0)])
        with TrajectoryClient(server.address, cfg, creds) as client:
            assert client.send([trajectory(0)]).accepted == 1
        assert server.stats()["accepted"] == 1


def test_mutual_tls_refuses_a_client_certificate_not_signed_by_the_job_ca():
    cfg = config(tls="job", client_auth=True)
    creds = JobCredentials.create(cfg)
    ca, ca_key = new_ca("another CA")
    forged = dataclasses.replace(creds, client_identity=issue(ca, ca_key, "intruder", server=False, client=True))
    no_cert = dataclasses.replace(creds, client_identity=None)
    with ControlServer(cfg, creds, PoolRecorder()) as server:  # as the coordinator's, for `sparrow pool`
        for stranger in (forged, no_cert):
            with ControlClient(server.address, cfg, stranger, timeout_s=5) as control, pytest.raises(TransportError, match="UNAVAILABLE"):
                control.health()
        with ControlClient(server.address, cfg, creds) as control:
            assert control.health().component == "coordinator"


def write_files(tmp_path, names: list[str], client: bool = True) -> dict:
    """A site CA and one certificate for `names` on disk; the tls=files settings that read them."""
    ca, ca_key = new_ca("site CA")
    cert, key = issue(ca, ca_key, "sparrow", names, server=True, client=client)
    for name, data in (("ca.pem", ca), ("cert.pem", cert), ("key.pem", key)):
        (tmp_path / name).write_bytes(data)
    return {"tls": "files", "cert_file": str(tmp_path / "cert.pem"), "key_file": str(tmp_path / "key.pem"),
            "ca_file": str(tmp_path / "ca.pem")}


def test_files_mode_serves_with_certificates_read_from_disk(tmp_path):
    (tmp_path / "token").write_text("0123456789abcdef0123456789abcdef\n")
    cfg = config(**write_files(tmp_path, ["sparrow-transport"]), client_auth=True, token_file=str(tmp_path / "token"))
    creds = JobCredentials.create(cfg)
    assert creds.token == "0123456789abcdef0123456789abcdef" and creds.ca_key_pem is None
    with TrajectoryServer(cfg, creds) as server, TrajectoryClient(server.address, cfg, creds) as client:
        assert client.send([trajectory(0), trajectory(1)]).accepted == 2
    with TrajectoryServer(cfg, creds) as server:
        with TrajectoryClient(server.address, cfg, dataclasses.replace(creds, client_identity=None)) as client:
            with pytest.raises(TransportError, match="UNAVAILABLE"):
                client.send([trajectory(0)])


def test_files_mode_clients_verify_the_server_name_not_the_pod_ip_they_dial(tmp_path):
    """Kubernetes: one certificate made in advance for every server, which cannot name pod IPs assigned at
    start; it names server_name only, and a client dialling an IP verifies that name."""
    cfg = config(**write_files(tmp_path, ["sparrow-transport"]))
    creds = JobCredentials.create(cfg)
    assert (creds.server_name, creds.verify_server_name) == ("sparrow-transport", True)
    with TrajectoryServer(cfg, creds) as server:
        assert server.address.startswith("127.0.0.1:")
        with TrajectoryClient(f"127.0.0.1:{server.port}", cfg, creds) as client:
            assert client.send([trajectory(0)]).accepted == 1
        with ControlClient(f"127.0.0.1:{server.port}", cfg, creds) as control:
            assert control.health().status == "serving"
        # The name is what is checked: verifying the dialled IP (which the certificate lacks) fails the handshake.
        by_address = dataclasses.replace(creds, verify_server_name=False)
        with TrajectoryClient(f"127.0.0.1:{server.port}", cfg, by_address) as client, pytest.raises(TransportError, match="UNAVAILABLE"):
            client.send([trajectory(1)])
    # Another server_name configured (e.g. a wildcard certificate's domain): the same files work for it.
    wildcard = tmp_path / "wild"
    wildcard.mkdir()
    cfg = config(**write_files(wildcard, ["*.sparrow.svc"]), server_name="transport.sparrow.svc")
    creds = JobCredentials.create(cfg)
    with TrajectoryServer(cfg, creds) as server, TrajectoryClient(f"127.0.0.1:{server.port}", cfg, creds) as client:
        assert client.send([trajectory(2)]).accepted == 1


def test_files_mode_refuses_a_certificate_without_the_server_name_at_job_start(tmp_path):
    cfg = config(**write_files(tmp_path, ["127.0.0.1", "trainer-0.example"]))
    with pytest.raises(CredentialsError) as exc:
        JobCredentials.create(cfg)
    message = str(exc.value)
    assert f"transport.security.cert_file='{tmp_path / 'cert.pem'}' names trainer-0.example but not " \
           "server_name='sparrow-transport'" in message
    assert "reissue the certificate with subjectAltName=DNS:sparrow-transport" in message
    assert "or set transport.security.server_name to one of its names" in message
    # Set to a name it lists, the same files are accepted.
    assert JobCredentials.create(config(**write_files(tmp_path, ["trainer-0.example"]), server_name="trainer-0.example")).tls


def test_job_mode_certificates_name_the_node_and_the_server_name():
    """tls=job keeps per-server SANs (in-job clients verify the address they dial) and adds server_name,
    which the `sparrow pool` client verifies (it may dial through a port-forward)."""
    cfg = config(tls="job")
    creds = JobCredentials.create(cfg)
    assert not creds.verify_server_name
    with TrajectoryServer(cfg, creds) as server:
        with TrajectoryClient(server.address, cfg, creds) as client:
            assert client.send([trajectory(0)]).accepted == 1
        by_name = dataclasses.replace(creds, verify_server_name=True)
        with ControlClient(f"localhost:{server.port}", cfg, by_name) as control:
            assert control.health().status == "serving"
        wrong = dataclasses.replace(creds, verify_server_name=True, server_name="not-sparrow")
        with ControlClient(server.address, cfg, wrong, timeout_s=5) as control, pytest.raises(TransportError, match="UNAVAILABLE"):
            control.health()


DEPLOY_DOC = Path(__file__).resolve().parents[1] / "docs" / "deploy.md"


@pytest.mark.skipif(shutil.which("openssl") is None, reason="no openssl on PATH")
def test_the_deploy_guides_openssl_commands_make_files_a_pod_ip_client_accepts(tmp_path):
    """docs/deploy.md's commands, run as written (but kubectl), give tls=files material that works with the
    default server_name while the client dials an IP."""
    section = DEPLOY_DOC.read_text().split("### 3. The TLS material")[1]
    block = section.split("```bash\n")[1].split("```")[0]
    script = "\n".join(line for line in block.replace("\\\n", " ").splitlines() if not line.startswith("kubectl"))
    assert "subjectAltName=DNS:sparrow-transport" in script
    subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=tmp_path, check=True, capture_output=True)
    tls = tmp_path / "tls"
    cfg = config(tls="files", cert_file=str(tls / "tls.crt"), key_file=str(tls / "tls.key"), ca_file=str(tls / "ca.crt"),
                 token_file=str(tls / "token"), client_auth=True)
    assert cfg.security.server_name == "sparrow-transport"
    creds = JobCredentials.create(cfg)
    with TrajectoryServer(cfg, creds) as server, TrajectoryClient(f"127.0.0.1:{server.port}", cfg, creds) as client:
        assert client.send([trajectory(0)]).accepted == 1


def test_a_server_on_all_interfaces_is_trusted_at_every_address_of_its_node():
    cfg = TransportConfig(host="0.0.0.0", port=0, vocab_size=500)
    assert cfg.tls_mode == "job"
    creds = JobCredentials.create(cfg)
    addresses = ["127.0.0.1"] + [a.address for nic in psutil.net_if_addrs().values() for a in nic
                                 if a.family == socket.AF_INET and not a.address.startswith("127.")][:1]
    with TrajectoryServer(cfg, creds) as server:
        for i, host in enumerate(addresses):  # what clients on this node and on others dial
            with TrajectoryClient(f"{host}:{server.port}", cfg, creds) as client:
                assert client.send([trajectory(i)]).accepted == 1


def test_credentials_survive_pickling_and_never_print_their_secrets():
    cfg = config(tls="job", client_auth=True)
    creds = JobCredentials.create(cfg)
    copy = pickle.loads(pickle.dumps(creds))  # as handed to a Ray actor
    assert copy == creds
    assert creds.token not in repr(creds) and "BEGIN" not in repr(creds)
    assert repr(creds) == f"JobCredentials(tls='job', client_auth=True, token=<{len(creds.token)} chars>)"
    with TrajectoryServer(cfg, copy) as server, TrajectoryClient(server.address, cfg, creds) as client:
        assert client.send([trajectory(0)]).accepted == 1


def test_auto_tls_is_off_on_loopback_and_job_credentials_elsewhere():
    assert TransportConfig(host="127.0.0.1").tls_mode == "off"
    assert TransportConfig(host="localhost").tls_mode == "off"
    assert TransportConfig(host="0.0.0.0").tls_mode == "job"
    assert TransportConfig(host="10.1.2.3").tls_mode == "job"
    assert TransportConfig(host="0.0.0.0", security={"tls": "off", "allow_insecure": True}).tls_mode == "off"
    assert TransportConfig(host="127.0.0.1", security={"tls": "job"}).tls_mode == "job"


@pytest.mark.parametrize("transport, expected", [
    ({"host": "0.0.0.0", "security": {"tls": "off"}},
     "security.tls='off' with host='0.0.0.0' (not loopback) would carry samples and the job token in plaintext"),
    ({"security": {"tls": "files", "cert_file": "c.pem"}},
     "tls='files' needs cert_file, key_file and ca_file (PEM paths); set key_file, ca_file"),
    ({"security": {"tls": "job", "ca_file": "ca.pem"}}, "ca_file='ca.pem' is read only with tls='files' (tls='job')"),
    ({"security": {"client_auth": True}},
     "security.client_auth=true needs TLS (client certificates are checked in the TLS handshake) but security.tls='auto' "
     "with host='127.0.0.1' is plaintext; set security.tls: job or files"),
    ({"security": {"tls": "ssl"}}, "Input should be 'auto', 'off', 'job' or 'files'"),
    ({"security": {"tokenfile": "t"}}, "Extra inputs are not permitted"),
    ({"security": {"server_name": "10.0.0.7"}}, "server_name='10.0.0.7' is an IP address; give a DNS name"),
    ({"security": {"server_name": "sparrow_transport"}}, "server_name='sparrow_transport' is not a DNS name"),
])
def test_security_rules_name_the_key_the_value_and_the_fix(transport, expected):
    with pytest.raises(ValidationError) as exc:
        TransportConfig.model_validate(transport)
    assert expected in str(exc.value)


def test_security_errors_in_a_job_config_carry_the_dotted_path():
    with pytest.raises(ConfigError) as exc:
        load_config(None, ["transport.host=0.0.0.0", "transport.security.tls=off"])
    assert "transport: security.tls='off' with host='0.0.0.0'" in str(exc.value) and "allow_insecure" in str(exc.value)
    with pytest.raises(ConfigError) as exc:
        load_config(None, ["transport.security.tlss=job"])
    assert "transport.security.tlss: unknown key; did you mean 'transport.security.tls'?" in str(exc.value)
    insecure = load_config(None, ["transport.host=0.0.0.0", "transport.security.tls=off", "transport.security.allow_insecure=true"])
    assert insecure.transport.tls_mode == "off"


def test_unreadable_security_files_fail_at_job_start_naming_the_key(tmp_path):
    (tmp_path / "bad.pem").write_text("not a certificate")
    (tmp_path / "short").write_text("abc")
    files = {"tls": "files", "cert_file": str(tmp_path / "missing.pem"), "key_file": str(tmp_path / "bad.pem"),
             "ca_file": str(tmp_path / "bad.pem")}
    with pytest.raises(CredentialsError, match=r"transport.security.cert_file='.*missing.pem': no such file"):
        JobCredentials.create(config(**files))
    with pytest.raises(CredentialsError, match=r"transport.security.ca_file='.*bad.pem': not PEM certificates"):
        JobCredentials.create(config(**{**files, "cert_file": str(tmp_path / "bad.pem")}))
    with pytest.raises(CredentialsError, match=r"token_file='.*short': the token must be at least 16 printable ASCII"):
        JobCredentials.create(config(token_file=str(tmp_path / "short")))
