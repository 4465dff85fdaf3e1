"""`sparrow pool resize|status RUN_DIR` end to end against a real coordinator control server
(`JobControlServer` around a handler that records resizes, as the driver will be): the files in
RUN_DIR/control/, the CLI, the token, validation, refusals and the errors a user meets."""

import json
import os
import stat
import subprocess
import sys
import threading

import grpc
import pytest

from sparrow.bench.fuzz.harness import PoolRecorder
from sparrow.cli.main import main
from sparrow.coordinator.transport import (
    ControlClient,
    JobCredentials,
    JobControlServer,
    ResizeRequests,
    TrajectoryServer,
    TransportConfig,
    TransportError,
    read_endpoint,
)
from sparrow.coordinator.transport.endpoint import CONTROL_DIR, EndpointError
from sparrow.coordinator.transport.pki import issue, new_ca
from sparrow.protos import sparrow_v1_pb2 as pb
from sparrow.protos import sparrow_v1_pb2_grpc as pb_grpc


def transport(tmp_path, tls: str) -> TransportConfig:
    """Loopback servers under each TLS mode (files: one certificate naming only the server name, mutual TLS)."""
    if tls == "files":
        ca, ca_key = new_ca("site CA")
        cert, key = issue(ca, ca_key, "sparrow", ["sparrow-transport"], server=True, client=True)
        for name, data in (("ca.pem", ca), ("cert.pem", cert), ("key.pem", key)):
            (tmp_path / name).write_bytes(data)
        security = {"tls": "files", "cert_file": str(tmp_path / "cert.pem"), "key_file": str(tmp_path / "key.pem"),
                    "ca_file": str(tmp_path / "ca.pem"), "client_auth": True}
    else:
        security = {"tls": tls, "client_auth": tls == "job"}
    return TransportConfig(port=0, security=security)


@pytest.fixture
def run_dir(tmp_path):
    path = tmp_path / "runs" / "train-1"
    path.mkdir(parents=True)
    (path / "config.yaml").write_text("run: {steps: 3}\n")
    return path


def sparrow(capsys, *argv) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize("tls", ["off", "job", "files"])
def test_resize_and_status_through_the_run_directory(tls, tmp_path, run_dir, capsys):
    config = transport(tmp_path, tls)
    credentials = JobCredentials.create(config)
    recorder = PoolRecorder(rollout=2, trainer=1)
    with JobControlServer(run_dir, config, credentials, recorder) as server:
        control = run_dir / CONTROL_DIR
        endpoint = json.loads((control / "endpoint.json").read_text())
        assert endpoint["address"] == server.address and endpoint["address"].startswith("127.0.0.1:")
        assert (endpoint["tls"], endpoint["server_name"], endpoint["pid"]) == (tls != "off", "sparrow-transport", os.getpid())
        assert stat.S_IMODE(control.stat().st_mode) == 0o700
        assert stat.S_IMODE((control / "token").stat().st_mode) == 0o600
        assert (control / "token").read_text().strip() == credentials.token
        files = {p.name for p in control.iterdir()}
        expected = {"endpoint.json", "token"} | ({"ca.crt"} if tls != "off" else set())
        expected |= {"client.crt", "client.key"} if tls == "job" else set()  # files: the operator's, by path
        assert files == expected
        if tls == "job":
            assert stat.S_IMODE((control / "client.key").stat().st_mode) == 0o600
            written = b"".join(p.read_bytes() for p in control.iterdir())
            assert credentials.ca_key_pem.strip() not in written  # never the CA key
        if tls == "files":
            assert (endpoint["client_cert_file"], endpoint["client_key_file"]) == (config.security.cert_file, config.security.key_file)

        code, out, err = sparrow(capsys, "pool", "resize", run_dir, "--rollout", 3)
        assert (code, err) == (0, "")
        assert out == "rollout pool: target 3; was 2; new workers join at the next weights version\n"
        assert recorder.resizes == [("rollout", 3)]

        code, out, _ = sparrow(capsys, "pool", "status", run_dir)
        assert code == 0
        lines = out.splitlines()
        assert lines[0] == f"{run_dir}: coordinator at {server.address}, serving, policy version 7, schedule v3"
        assert lines[3].split() == ["rollout", "3", "3", "0", "0", "yes"]
        assert lines[4].split() == ["trainer", "1", "1", "0", "0", "no"]
        code, out, _ = sparrow(capsys, "pool", "status", run_dir, "--json")
        status = json.loads(out)
        assert status["pools"][0] == {"pool": "rollout", "target": 3, "serving": 3, "joining": 0, "retiring": 0, "resizable": True}

        # Another address for the same server (a port-forward): TLS verifies the server name, not the address.
        port = server.address.rsplit(":", 1)[1]
        code, out, _ = sparrow(capsys, "pool", "resize", run_dir, "--rollout", 4, "--address", f"localhost:{port}")
        assert code == 0 and recorder.resizes[-1] == ("rollout", 4)
    assert not control.exists()  # removed at close: the job is not running any more
    code, _, err = sparrow(capsys, "pool", "status", run_dir)
    assert code == 2 and "no control/endpoint.json, so no job is running there" in err


def test_the_cli_imports_no_torch_and_refuses_bad_requests_naming_the_field(tmp_path, run_dir, capsys):
    config = transport(tmp_path, "job")
    credentials = JobCredentials.create(config)
    recorder = PoolRecorder()
    with JobControlServer(run_dir, config, credentials, recorder):
        code = ("import sys; from sparrow.cli.main import main; rc = main(sys.argv[1:]); "
                "print(sorted(m for m in ('torch', 'ray', 'deepspeed', 'transformers') if m in sys.modules)); sys.exit(rc)")
        done = subprocess.run([sys.executable, "-c", code, "pool", "resize", str(run_dir), "--rollout", "5"],
                              capture_output=True, text=True, timeout=120)
        assert (done.returncode, done.stdout.splitlines()[-1]) == (0, "[]"), done.stderr
        assert recorder.resizes == [("rollout", 5)]

        for size, reason in ((0, "size: =0 must be in [1, 1024]"), (-3, "size: =-3 must be in [1, 1024]"),
                             (1025, "size: =1025 must be in [1, 1024]")):
            code, out, err = sparrow(capsys, "pool", "resize", run_dir, "--rollout", size)
            assert (code, out) == (2, "")
            assert err.startswith(f"sparrow pool: error: the job refused the request: {reason} (workers in the pool)")
        code, _, err = sparrow(capsys, "pool", "resize", run_dir, "--trainer", 4)
        assert code == 2 and ("the job refused the request: pool: 'trainer' cannot be resized while the job runs"
                              in err) and "--set trainer.pool.size=N" in err
        assert recorder.resizes == [("rollout", 5)]  # nothing invalid reached the handler


def test_calls_without_or_with_a_wrong_token_are_refused(tmp_path, run_dir, capsys):
    config = transport(tmp_path, "off")
    credentials = JobCredentials.create(config)
    recorder = PoolRecorder()
    with JobControlServer(run_dir, config, credentials, recorder) as server:
        with grpc.insecure_channel(server.address) as bare:
            with pytest.raises(grpc.RpcError) as exc:
                pb_grpc.ControlServiceStub(bare).ResizePool(pb.ResizePoolRequest(pool="rollout", size=3), timeout=5)
        assert exc.value.code() == grpc.StatusCode.UNAUTHENTICATED and "missing 'authorization' metadata" in exc.value.details()

        (run_dir / CONTROL_DIR / "token").write_text("a-token-of-another-job-0123456789\n")
        code, out, err = sparrow(capsys, "pool", "resize", run_dir, "--rollout", 3)
        assert (code, out) == (2, "")
        assert f"the job's control server at {server.address} refused the token in {run_dir}/control/token" in err
        assert "not this job's token" in err
        assert recorder.resizes == [] and server.server.unauthenticated == 2


def test_components_that_cannot_resize_answer_unimplemented():
    config = TransportConfig(port=0)
    credentials = JobCredentials.create(config)
    with TrajectoryServer(config, credentials) as server, ControlClient(server.address, config, credentials) as control:
        with pytest.raises(TransportError) as exc:
            control.resize_pool("rollout", 3)
        assert exc.value.code == grpc.StatusCode.UNIMPLEMENTED
        assert exc.value.details == ("ResizePool: this component (trajectory-server) does not resize pools; the coordinator "
                                     "does: `sparrow pool resize RUN_DIR --rollout N` dials the address in "
                                     "RUN_DIR/control/endpoint.json")
        assert control.health().pools == []


def test_the_coordinator_refuses_what_it_does_not_serve_and_may_decline_a_resize(tmp_path, run_dir, capsys):
    class Declines(PoolRecorder):
        def resize_pool(self, pool, size):
            return False, self.pools[pool], f"the cluster has GPUs for 6 rollout workers, not {size}"

    config = transport(tmp_path, "off")
    credentials = JobCredentials.create(config)
    with JobControlServer(run_dir, config, credentials, Declines()) as server:
        code, out, _ = sparrow(capsys, "pool", "resize", run_dir, "--rollout", 9)
        assert code == 1
        assert out == ("sparrow pool resize: not done: the cluster has GPUs for 6 rollout workers, not 9 "
                       "(rollout pool target stays 2)\n")
        with ControlClient(server.address, config, credentials) as control:
            with pytest.raises(TransportError) as exc:
                control.drain(0.0)
            assert (exc.value.code, exc.value.details) == (
                grpc.StatusCode.UNIMPLEMENTED, "Drain: the coordinator does not drain; stop the job instead")


def test_errors_when_the_job_is_not_there(tmp_path, run_dir, capsys):
    code, _, err = sparrow(capsys, "pool", "status", tmp_path / "nowhere")
    assert code == 2 and err == f"sparrow pool: error: {tmp_path / 'nowhere'}: no such run directory\n"
    code, _, err = sparrow(capsys, "pool", "status", tmp_path)
    assert code == 2 and f"{tmp_path}: not a run directory (no config.yaml)" in err

    # A job killed before it could clean up: its endpoint is left behind, nothing listens there.
    config = transport(tmp_path, "off")
    server = JobControlServer(run_dir, config, JobCredentials.create(config), PoolRecorder())
    server.start()
    server.server.stop(grace=0)
    endpoint = run_dir / CONTROL_DIR / "endpoint.json"
    info = json.loads(endpoint.read_text())
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    endpoint.write_text(json.dumps({**info, "pid": dead.pid}))
    code, _, err = sparrow(capsys, "pool", "resize", run_dir, "--rollout", 2, "--timeout", 2)
    assert code == 2
    assert err.startswith(f"sparrow pool: error: cannot reach the job's control server at {info['address']}: ")
    assert f"RUN_DIR/control/endpoint.json was written by pid {dead.pid} on " in err
    assert "(that process no longer exists: the job was stopped without cleaning up)" in err

    endpoint.write_text(json.dumps({**info, "format": 99}))
    with pytest.raises(EndpointError, match="format 99, this Sparrow reads format 1"):
        read_endpoint(run_dir)


def test_files_mode_with_client_auth_reads_the_operators_certificate_where_the_cli_runs(tmp_path, run_dir, capsys):
    config = transport(tmp_path, "files")
    with JobControlServer(run_dir, config, JobCredentials.create(config), PoolRecorder()):
        os.rename(tmp_path / "key.pem", tmp_path / "key.moved")  # not mounted where the CLI runs
        code, _, err = sparrow(capsys, "pool", "status", run_dir)
        assert code == 2
        assert (f"the job uses mutual TLS with the certificate {tmp_path / 'cert.pem'} and key {tmp_path / 'key.pem'} "
                "(transport.security.cert_file/key_file)") in err
        assert "run this where they are mounted (on Kubernetes: in the head pod)" in err


def test_resize_requests_hand_over_the_latest_size_once():
    requests = ResizeRequests()
    assert requests.take("rollout") is None
    threads = [threading.Thread(target=requests.put, args=("rollout", n)) for n in range(1, 9)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert requests.take("rollout") in range(1, 9) and requests.take("rollout") is None
    requests.put("rollout", 3)
    requests.put("rollout", 5)
    assert requests.take("rollout") == 5 and requests.take("rollout") is None
