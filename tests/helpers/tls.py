"""Real certificates made at test time (``trustme``): a CA, a server certificate for loopback, and
client certificates by name, written as PEM files."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import trustme


@dataclass(frozen=True)
class Pem:
    cert: str
    key: str


@dataclass(frozen=True)
class Certificates:
    ca: str
    """The CA bundle that signed every certificate here."""
    server: Pem
    """For 127.0.0.1 and localhost."""
    clients: dict[str, Pem]
    """Client certificates by name (the name is the certificate's common name and SAN)."""


def make_certificates(
    directory: Path, clients: tuple[str, ...] = ("worker.specdraft", "admin.specdraft")
) -> Certificates:
    ca = trustme.CA()
    directory.mkdir(parents=True, exist_ok=True)
    ca_path = directory / "ca.pem"
    ca.cert_pem.write_to_path(str(ca_path))

    def issue(name: str, *identities: str) -> Pem:
        cert = ca.issue_cert(*identities, common_name=identities[0])
        cert_path, key_path = directory / f"{name}.pem", directory / f"{name}.key"
        cert_path.write_bytes(b"".join(blob.bytes() for blob in cert.cert_chain_pems))
        cert.private_key_pem.write_to_path(str(key_path))
        return Pem(str(cert_path), str(key_path))

    server = issue("server", "127.0.0.1", "localhost")
    return Certificates(str(ca_path), server, {name: issue(name, name) for name in clients})
