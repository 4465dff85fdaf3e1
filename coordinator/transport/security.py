"""`JobCredentials`: the job's bearer token and TLS material (docs/reliability.md, Security model).

The coordinator creates them once per job and hands them to every actor as a Ray argument (they are a
plain picklable dataclass). With `tls: job` they hold the job CA's private key, so each server issues
its own certificate on its own node, for the addresses clients dial there and `server_name`. With
`tls: files` every server uses the one certificate, which cannot list pod IPs assigned at start, so
clients verify `server_name` (which the certificate must list) instead of the address they dial.
"""

import secrets
import socket
from dataclasses import dataclass
from pathlib import Path

import grpc
import psutil

from .auth import TokenMetadata
from .config import DEFAULT_SERVER_NAME, WILDCARD_HOSTS, TransportConfig

TOKEN_BYTES = 32
MIN_TOKEN_CHARS = 16
CONFIG_KEY = "transport.security"
"""Where these settings live in a job config, for error messages."""


class CredentialsError(ValueError):
    """A security setting that cannot be used: names the key, the value and the fix."""


def node_names(host: str) -> list[str]:
    """The names and addresses clients may dial a server bound to `host` at (a server certificate's SAN):
    with a wildcard host every interface address of the node (what Ray reports as the node IP), its host
    name and localhost. No DNS lookup: a server starts as fast without a resolver."""
    if host not in WILDCARD_HOSTS:
        return ["localhost", "127.0.0.1", "::1"] if host == "localhost" else [host]
    names = [socket.gethostname(), "localhost"]
    for addresses in psutil.net_if_addrs().values():
        names += [a.address.split("%")[0] for a in addresses if a.family in (socket.AF_INET, socket.AF_INET6)]
    return list(dict.fromkeys(names))


def _read(key: str, path: str) -> bytes:
    file = Path(path)
    if not file.is_file():
        raise CredentialsError(f"{CONFIG_KEY}.{key}={path!r}: no such file; give a path readable on the coordinator's node")
    return file.read_bytes()


def _read_token(path: str | None) -> str:
    if path is None:
        return secrets.token_urlsafe(TOKEN_BYTES)
    token = _read("token_file", path).decode(errors="replace").strip()
    if len(token) < MIN_TOKEN_CHARS or not token.isascii() or not token.isprintable() or " " in token:
        raise CredentialsError(
            f"{CONFIG_KEY}.token_file={path!r}: the token must be at least {MIN_TOKEN_CHARS} printable ASCII characters "
            "without spaces; write a random one, e.g. `openssl rand -hex 32 > token`, or remove token_file"
        )
    return token


def certificate_names(cert_pem: bytes) -> list[str]:
    """The DNS names a server certificate (the first in `cert_pem`) is valid for: its subjectAltName DNS
    entries, or its common name when it has none (as gRPC's name check does)."""
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    cert = x509.load_pem_x509_certificates(cert_pem)[0]
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        names = san.get_values_for_type(x509.DNSName)
    except x509.ExtensionNotFound:
        names = []
    if not names:
        names = [str(a.value) for a in cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)]
    return names


def name_matches(name: str, pattern: str) -> bool:
    """Whether certificate name `pattern` (possibly `*.domain`, one label) covers DNS name `name`."""
    name, pattern = name.lower().rstrip("."), pattern.lower().rstrip(".")
    if pattern.startswith("*."):
        head, _, rest = name.partition(".")
        return bool(head) and rest == pattern[2:]
    return name == pattern


def _check_server_name(security, cert: bytes) -> None:
    names = certificate_names(cert)
    if not any(name_matches(security.server_name, n) for n in names):
        listed = ", ".join(names) if names else "no DNS name"
        raise CredentialsError(
            f"{CONFIG_KEY}.cert_file={security.cert_file!r} names {listed} but not server_name={security.server_name!r}: "
            "with tls=files clients verify that name, not the address they dial (pod IPs are assigned at start); "
            f"reissue the certificate with subjectAltName=DNS:{security.server_name} (docs/deploy.md) or set "
            f"{CONFIG_KEY}.server_name to one of its names"
        )


def _read_files(security) -> tuple[bytes, bytes, bytes]:
    """(ca, cert, key) PEM of tls=files, each checked to parse as what its key says it is."""
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    ca, cert, key = _read("ca_file", security.ca_file), _read("cert_file", security.cert_file), _read("key_file", security.key_file)
    for name, path, data, load in (
        ("ca_file", security.ca_file, ca, x509.load_pem_x509_certificates),
        ("cert_file", security.cert_file, cert, x509.load_pem_x509_certificates),
        ("key_file", security.key_file, key, lambda d: serialization.load_pem_private_key(d, password=None)),
    ):
        try:
            load(data)
        except (ValueError, TypeError) as exc:
            kind = "an unencrypted PEM private key" if name == "key_file" else "PEM certificates"
            raise CredentialsError(f"{CONFIG_KEY}.{name}={path!r}: not {kind} ({exc})") from None
    _check_server_name(security, cert)
    return ca, cert, key


@dataclass(frozen=True, repr=False)
class JobCredentials:
    """Token and TLS material of one job. `tls=False`: plaintext channels, the token is still checked."""

    token: str
    tls: bool = False
    client_auth: bool = False
    ca_pem: bytes | None = None
    ca_key_pem: bytes | None = None
    """tls=job only: signs each server's certificate on its node (so it travels to the job's actors)."""
    server_identity: tuple[bytes, bytes] | None = None
    """tls=files: (certificate, key) PEM of every server."""
    client_identity: tuple[bytes, bytes] | None = None
    """client_auth: (certificate, key) PEM that clients present."""
    server_name: str = DEFAULT_SERVER_NAME
    """A DNS name every server certificate lists (tls=job: besides the node's addresses)."""
    verify_server_name: bool = False
    """Clients verify `server_name` instead of the address they dial (tls=files; the `sparrow pool` client)."""

    @classmethod
    def create(cls, config: TransportConfig) -> "JobCredentials":
        """Per job, on the coordinator: read or generate the token, generate a CA or read the files."""
        security, mode = config.security, config.tls_mode
        token = _read_token(security.token_file)
        if mode == "off":
            return cls(token, server_name=security.server_name)
        if mode == "job":
            from . import pki  # cryptography is needed with TLS only

            ca, ca_key = pki.new_ca("sparrow job CA")
            client = pki.issue(ca, ca_key, "sparrow job client", server=False, client=True) if security.client_auth else None
            return cls(token, True, security.client_auth, ca, ca_key, None, client, security.server_name)
        ca, cert, key = _read_files(security)
        return cls(token, True, security.client_auth, ca, None, (cert, key), (cert, key) if security.client_auth else None,
                   security.server_name, verify_server_name=True)

    def __repr__(self) -> str:  # never print the token or keys (Ray logs actor arguments on errors)
        mode = "off" if not self.tls else "files" if self.server_identity else "job"
        return f"JobCredentials(tls={mode!r}, client_auth={self.client_auth}, token=<{len(self.token)} chars>)"

    def server_credentials(self, host: str) -> grpc.ServerCredentials | None:
        """TLS credentials of a server bound to `host` on this node (None = plaintext)."""
        if not self.tls:
            return None
        if self.server_identity is not None:
            cert, key = self.server_identity
        else:
            from . import pki

            cert, key = pki.issue(self.ca_pem, self.ca_key_pem, socket.gethostname(), [*node_names(host), self.server_name],
                                  server=True)
        return grpc.ssl_server_credentials(
            [(key, cert)], root_certificates=self.ca_pem if self.client_auth else None, require_client_auth=self.client_auth
        )

    def channel_credentials(self) -> grpc.ChannelCredentials | None:
        """TLS trusting the job CA (with the client certificate under mTLS) plus the token (None = plaintext)."""
        if not self.tls:
            return None
        cert, key = self.client_identity or (None, None)
        return grpc.composite_channel_credentials(
            grpc.ssl_channel_credentials(root_certificates=self.ca_pem, private_key=key, certificate_chain=cert),
            grpc.access_token_call_credentials(self.token),
        )

    def channel_options(self, options: list[tuple[str, int]] = ()) -> list[tuple]:
        """`options` plus, when clients verify `server_name`, the option that makes them check it."""
        if self.tls and self.verify_server_name:
            return [*options, ("grpc.ssl_target_name_override", self.server_name)]
        return list(options)

    def channel(self, address: str, options: list[tuple[str, int]] = ()) -> grpc.Channel:
        """A client channel to `address` that presents this job's token (over TLS when the job uses it)."""
        if self.tls:
            return grpc.secure_channel(address, self.channel_credentials(), options=self.channel_options(options))
        return grpc.intercept_channel(grpc.insecure_channel(address, options=options), TokenMetadata(self.token))
