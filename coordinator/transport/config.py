"""Settings of the gRPC transport (servers and clients)."""

import ipaddress
import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

WILDCARD_HOSTS = ("0.0.0.0", "::", "")
"""Bind addresses that mean "every interface of this node"."""
DEFAULT_SERVER_NAME = "sparrow-transport"
"""The DNS name every server certificate carries (docs/deploy.md makes the tls=files certificate with it)."""
_DNS_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_DNS_NAME = re.compile(rf"{_DNS_LABEL}(?:\.{_DNS_LABEL})*")


def is_loopback(host: str) -> bool:
    """True for localhost and loopback IPs: nothing off this node can connect there."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class RetryConfig(BaseModel):
    """Client retries: exponential backoff on UNAVAILABLE and other transient stream failures."""

    model_config = ConfigDict(extra="forbid")

    max_attempts: int = Field(8, ge=1, description="streams opened per send() before giving up")
    initial_backoff_s: float = Field(0.05, gt=0, description="wait before the first retry")
    max_backoff_s: float = Field(2.0, gt=0, description="cap of the doubling backoff")

    @model_validator(mode="after")
    def _backoff_order(self):
        if self.max_backoff_s < self.initial_backoff_s:
            raise ValueError(
                f"retry.max_backoff_s={self.max_backoff_s} is below retry.initial_backoff_s={self.initial_backoff_s}; "
                "raise max_backoff_s or lower initial_backoff_s"
            )
        return self


class SecurityConfig(BaseModel):
    """TLS and the job token (docs/reliability.md, Security model). The token is checked on every call."""

    model_config = ConfigDict(extra="forbid")

    tls: Literal["auto", "off", "job", "files"] = Field(
        "auto", description="auto = job off loopback, off on loopback; job = a CA made per job; files = cert/key/ca files"
    )
    cert_file: str | None = Field(None, description="tls=files: server certificate (PEM); also the client certificate with client_auth")
    key_file: str | None = Field(None, description="tls=files: private key of cert_file (PEM)")
    ca_file: str | None = Field(None, description="tls=files: CA that signed the server (and, for mTLS, client) certificates")
    client_auth: bool = Field(False, description="mutual TLS: servers accept only clients with a certificate of the job CA")
    token_file: str | None = Field(None, description="file holding the job's bearer token; None = generated per job")
    allow_insecure: bool = Field(False, description="allow tls=off on a non-loopback host (plaintext on the network)")
    server_name: str = Field(
        DEFAULT_SERVER_NAME, description="DNS name in every server certificate; with tls=files clients verify it instead "
        "of the address they dial (pod IPs are unknown in advance), so cert_file must list it (subjectAltName DNS)",
    )

    @field_validator("tls", mode="before")
    @classmethod
    def _yaml_off(cls, value):
        """YAML reads an unquoted `tls: off` as false."""
        return "off" if value is False else value

    @field_validator("server_name")
    @classmethod
    def _dns_name(cls, value: str) -> str:
        try:
            ipaddress.ip_address(value)
        except ValueError:
            pass
        else:
            raise ValueError(
                f"server_name={value!r} is an IP address; give a DNS name (any fixed name, e.g. "
                f"{DEFAULT_SERVER_NAME!r}) that the certificate lists as subjectAltName DNS:<name>"
            )
        if len(value) > 253 or not _DNS_NAME.fullmatch(value):
            raise ValueError(
                f"server_name={value!r} is not a DNS name (labels of letters, digits and inner hyphens, joined by "
                f"dots, at most 253 characters); e.g. {DEFAULT_SERVER_NAME!r}"
            )
        return value

    @model_validator(mode="after")
    def _files(self):
        files = {"cert_file": self.cert_file, "key_file": self.key_file, "ca_file": self.ca_file}
        if self.tls == "files":
            missing = [k for k, v in files.items() if not v]
            if missing:
                raise ValueError(
                    f"tls='files' needs cert_file, key_file and ca_file (PEM paths); set {', '.join(missing)}, "
                    "or use tls='job' to generate them per job"
                )
        else:
            given = [f"{k}={v!r}" for k, v in files.items() if v]
            if given:
                verb = "is" if len(given) == 1 else "are"
                raise ValueError(f"{', '.join(given)} {verb} read only with tls='files' (tls={self.tls!r}); set tls: files or remove them")
        return self


class TransportConfig(BaseModel):
    """Trajectory and control endpoints. Defaults suit one trainer host; see docs/grpc_api.md."""

    model_config = ConfigDict(extra="forbid")

    host: str = Field("127.0.0.1", description="bind address of servers (0.0.0.0 to serve other hosts)")
    port: int = Field(50051, ge=0, le=65535, description="listen port; 0 picks a free one")
    queue_capacity: int = Field(1024, ge=1, description="messages buffered server-side before senders wait")
    stream_window: int = Field(32, ge=1, description="unacknowledged messages a client may have in flight per stream")
    dedupe_window: int = Field(200_000, ge=1, description="most recent accepted ids remembered to detect resends")
    vocab_size: int | None = Field(None, ge=1, description="when set, token ids must lie in [0, vocab_size)")
    max_sample_tokens: int = Field(131_072, ge=1, description="longest prompt or response accepted, in tokens")
    max_top_k: int = Field(64, ge=0, description="largest top-k width accepted")
    max_message_mb: int = Field(64, ge=1, description="gRPC message size limit (a 38K-token sample with top-20 is ~5 MB)")
    max_streams: int = Field(1024, ge=1, description="concurrent streams per server; more are refused with RESOURCE_EXHAUSTED")
    stream_idle_timeout_s: float = Field(
        120.0, gt=0, description="a stream that sends nothing this long is closed (the client reopens one when it has more)"
    )
    ingest_threads: int = Field(2, ge=1, description="threads that validate and convert received messages; streams hold none")
    keepalive_time_s: float = Field(30.0, gt=0, le=86_400, description="idle seconds before a connection is pinged (both ends)")
    keepalive_timeout_s: float = Field(10.0, gt=0, le=86_400, description="a ping unanswered this long drops the connection")
    retry: RetryConfig = Field(default_factory=RetryConfig)
    security: SecurityConfig = Field(default_factory=SecurityConfig)

    @model_validator(mode="after")
    def _security(self):
        if self.tls_mode == "off" and not is_loopback(self.host) and not self.security.allow_insecure:
            raise ValueError(
                f"security.tls={self.security.tls!r} with host={self.host!r} (not loopback) would carry samples and the "
                "job token in plaintext over the network; use tls: auto, job or files, or set "
                "security.allow_insecure: true on a network you trust"
            )
        if self.security.client_auth and self.tls_mode == "off":
            raise ValueError(
                f"security.client_auth=true needs TLS (client certificates are checked in the TLS handshake) but "
                f"security.tls={self.security.tls!r} with host={self.host!r} is plaintext; set security.tls: job or files"
            )
        return self

    @property
    def tls_mode(self) -> Literal["off", "job", "files"]:
        """`security.tls` with auto resolved: job credentials off loopback, plaintext on loopback."""
        if self.security.tls == "auto":
            return "off" if is_loopback(self.host) else "job"
        return self.security.tls

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def grpc_options(self) -> list[tuple[str, int]]:
        """Channel options of clients: message size and keepalive pings."""
        size = self.max_message_mb * 1024 * 1024
        return [
            ("grpc.max_send_message_length", size),
            ("grpc.max_receive_message_length", size),
            ("grpc.keepalive_time_ms", int(self.keepalive_time_s * 1000)),
            ("grpc.keepalive_timeout_ms", int(self.keepalive_timeout_s * 1000)),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.max_pings_without_data", 0),
        ]

    def server_options(self) -> list[tuple[str, int]]:
        """Server options: the clients' options, and clients may ping as often as they are configured to."""
        return self.grpc_options() + [
            ("grpc.http2.min_ping_interval_without_data_ms", int(self.keepalive_time_s * 1000) // 2),
            ("grpc.http2.max_ping_strikes", 2),
        ]
