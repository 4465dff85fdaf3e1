"""RUN_DIR/control/: how `sparrow pool` finds a running job's coordinator and authenticates to it.

    RUN_DIR/control/endpoint.json   address, tls, server_name, client_auth, pid, host, start time (written last)
    RUN_DIR/control/token           the job token (mode 0600)
    RUN_DIR/control/ca.crt          the CA certificate clients trust (TLS only; never the CA key)
    RUN_DIR/control/client.crt, client.key
                                    tls=job with client_auth: a client certificate minted for control (key 0600)

The coordinator (`JobControlServer`) writes them when its control server serves and removes them when
it stops. The folder is mode 0700: whoever can read it can control the job, and, since it holds the
job token, call every RPC of the job. With tls=files and client_auth the client certificate is the
operator's `cert_file`/`key_file`: endpoint.json records their paths and the client must read them
there (on Kubernetes: in a pod that mounts the Secret), so the server key is never copied.
"""

import json
import os
import secrets
import socket
import time
from dataclasses import dataclass, replace
from pathlib import Path

import psutil

from .config import WILDCARD_HOSTS, TransportConfig
from .security import JobCredentials

CONTROL_DIR = "control"
ENDPOINT_FILE = "endpoint.json"
TOKEN_FILE = "token"
CA_FILE = "ca.crt"
CLIENT_CERT_FILE = "client.crt"
CLIENT_KEY_FILE = "client.key"
FORMAT = 1
"""endpoint.json's `format`; a reader refuses others (a job of another Sparrow version)."""
CONTROL_PORT_OFFSET = 2
"""With a fixed transport.port P the control server listens on P + 2 (the trajectory server on P). P + 1,
the statistics server's until the job's control plane moved to Ray, stays unused, so firewall rules and
port-forwards written for P + 2 keep working."""


class EndpointError(RuntimeError):
    """The control endpoint of RUN_DIR cannot be found or used; the message says why and what to do."""


def control_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / CONTROL_DIR


def _write(path: Path, data: bytes, mode: int) -> None:
    """Replace `path` atomically; the data is never readable with a wider mode than `mode`."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "wb") as f:
        os.fchmod(f.fileno(), mode)
        f.write(data)
    os.replace(tmp, path)


def _guess_host() -> str:
    """An address of this node for a server bound to every interface: its first non-loopback IPv4."""
    for addresses in psutil.net_if_addrs().values():
        for a in addresses:
            if a.family == socket.AF_INET and not a.address.startswith("127."):
                return a.address
    return "127.0.0.1"


def write_endpoint(run_dir: str | Path, address: str, config: TransportConfig, credentials: JobCredentials) -> dict:
    """Write RUN_DIR/control/ for a control server at `address`; returns endpoint.json's content."""
    folder = control_dir(run_dir)
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(folder, 0o700)
    info = {
        "format": FORMAT, "address": address, "tls": credentials.tls, "server_name": credentials.server_name,
        "client_auth": credentials.client_auth, "pid": os.getpid(), "host": socket.gethostname(),
        "started": time.time(), "instance": secrets.token_hex(8),
    }
    _write(folder / TOKEN_FILE, credentials.token.encode() + b"\n", 0o600)
    for name in (CA_FILE, CLIENT_CERT_FILE, CLIENT_KEY_FILE):
        (folder / name).unlink(missing_ok=True)
    if credentials.tls:
        _write(folder / CA_FILE, credentials.ca_pem, 0o644)
    if credentials.client_auth:
        if credentials.ca_key_pem is not None:  # tls=job: a client certificate of its own, from the job CA
            from . import pki  # TLS only: cryptography

            cert, key = pki.issue(credentials.ca_pem, credentials.ca_key_pem, "sparrow control client", server=False, client=True)
            _write(folder / CLIENT_CERT_FILE, cert, 0o644)
            _write(folder / CLIENT_KEY_FILE, key, 0o600)
        else:  # tls=files: the operator's certificate, read where the client runs
            info["client_cert_file"] = config.security.cert_file
            info["client_key_file"] = config.security.key_file
    _write(folder / ENDPOINT_FILE, (json.dumps(info, indent=1) + "\n").encode(), 0o644)
    return info


def remove_endpoint(run_dir: str | Path, instance: str | None = None) -> None:
    """Remove RUN_DIR/control/ (only if its endpoint.json is `instance`'s, when given: a newer job keeps its own)."""
    folder = control_dir(run_dir)
    endpoint = folder / ENDPOINT_FILE
    if instance is not None:
        try:
            if json.loads(endpoint.read_text()).get("instance") != instance:
                return
        except (OSError, ValueError):
            return
    for name in (ENDPOINT_FILE, TOKEN_FILE, CLIENT_KEY_FILE, CLIENT_CERT_FILE, CA_FILE):
        (folder / name).unlink(missing_ok=True)
    try:
        folder.rmdir()
    except OSError:
        pass


@dataclass(frozen=True, repr=False)
class Endpoint:
    """A running job's control endpoint, as read from RUN_DIR/control/."""

    run_dir: Path
    address: str
    credentials: JobCredentials
    info: dict

    def __repr__(self) -> str:
        return f"Endpoint({self.address!r}, tls={self.credentials.tls}, server_name={self.credentials.server_name!r})"

    def at(self, address: str) -> "Endpoint":
        """The same job dialled at another address (a port-forward); TLS still verifies `server_name`."""
        return replace(self, address=address)

    def describe(self) -> str:
        """Who wrote it, for error messages."""
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.info.get("started", 0)))
        return f"written by pid {self.info.get('pid')} on {self.info.get('host')} at {started}"

    def process_gone(self) -> bool:
        """True when the writing process ran on this host and no longer exists (a job killed before cleaning up)."""
        return self.info.get("host") == socket.gethostname() and not psutil.pid_exists(int(self.info.get("pid", -1)))


def _read_bytes(path: Path, what: str) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise EndpointError(f"{path}: cannot read {what} ({exc.strerror}); the job's control files are readable by "
                            "the user that runs the job (mode 0700)") from None


def read_endpoint(run_dir: str | Path) -> Endpoint:
    """The endpoint of the job running in `run_dir`; EndpointError says why there is none."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise EndpointError(f"{run_dir}: no such run directory")
    folder = control_dir(run_dir)
    endpoint = folder / ENDPOINT_FILE
    if not endpoint.is_file():
        if not (run_dir / "config.yaml").is_file():
            raise EndpointError(f"{run_dir}: not a run directory (no config.yaml)")
        raise EndpointError(
            f"{run_dir}: no {CONTROL_DIR}/{ENDPOINT_FILE}, so no job is running there: a running `sparrow train` "
            "keeps that file from start to exit (a job started by a Sparrow without the control server has none)"
        )
    try:
        info = json.loads(_read_bytes(endpoint, "the endpoint"))
        if info.get("format") != FORMAT:
            raise EndpointError(f"{endpoint}: format {info.get('format')!r}, this Sparrow reads format {FORMAT}; "
                                "use the Sparrow version that runs the job")
        address, tls, client_auth = str(info["address"]), bool(info["tls"]), bool(info["client_auth"])
        server_name = str(info["server_name"])
    except (ValueError, KeyError, TypeError) as exc:
        raise EndpointError(f"{endpoint}: not a control endpoint ({exc.__class__.__name__}: {exc})") from None
    token = _read_bytes(folder / TOKEN_FILE, "the job token").decode(errors="replace").strip()
    ca = _read_bytes(folder / CA_FILE, "the CA certificate") if tls else None
    client = None
    if client_auth:
        if "client_cert_file" in info:
            paths = (Path(info["client_cert_file"]), Path(info["client_key_file"]))
            try:
                client = (paths[0].read_bytes(), paths[1].read_bytes())
            except OSError as exc:
                raise EndpointError(
                    f"the job uses mutual TLS with the certificate {paths[0]} and key {paths[1]} "
                    f"(transport.security.cert_file/key_file) and {exc.filename} is not readable here ({exc.strerror}); "
                    "run this where they are mounted (on Kubernetes: in the head pod) as a user that may read them"
                ) from None
        else:
            client = (_read_bytes(folder / CLIENT_CERT_FILE, "the client certificate"),
                      _read_bytes(folder / CLIENT_KEY_FILE, "the client key"))
    credentials = JobCredentials(token, tls, client_auth, ca, None, None, client, server_name, verify_server_name=tls)
    return Endpoint(run_dir, address, credentials, info)


class JobControlServer:
    """The coordinator's ControlServer (the driver is its handler) plus RUN_DIR/control/ while it serves."""

    def __init__(self, run_dir: str | Path, config: TransportConfig, credentials: JobCredentials, handler,
                 advertise_host: str | None = None):
        from .servers import ControlServer

        port = config.port + CONTROL_PORT_OFFSET if config.port else 0
        self.run_dir, self.config, self.credentials = Path(run_dir), config, credentials
        self.server = ControlServer(config.model_copy(update={"port": port}), credentials, handler)
        self.server.component = "coordinator-control"
        host = advertise_host or (config.host if config.host not in WILDCARD_HOSTS else _guess_host())
        self._host = f"[{host}]" if ":" in host and not host.startswith("[") else host
        self.address: str | None = None
        self._instance: str | None = None

    def start(self) -> str:
        """Serve, then write RUN_DIR/control/; returns the address written there."""
        port = self.server.start()
        try:
            self.address = f"{self._host}:{port}"
            self._instance = write_endpoint(self.run_dir, self.address, self.config, self.credentials)["instance"]
        except BaseException:
            self.server.stop(grace=0)
            raise
        return self.address

    def close(self) -> None:
        """Remove RUN_DIR/control/ (clients then read "not running"), then stop serving."""
        if self._instance is not None:
            remove_endpoint(self.run_dir, self._instance)
            self._instance = None
        self.server.stop(grace=1.0)

    def __enter__(self) -> "JobControlServer":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()
