"""What both ends of a punched QUIC link agree on, written once: ALPN, datagram size, the TLS they skip, and what
the server takes for its client's first datagram. Sans-IO: nothing here touches a socket.

QUIC's TLS does not authenticate fellows here — the Noise session inside the stream does, with the keys the leader
pinned — so the server shows a throwaway self-signed certificate and the client does not verify it (aioquic cannot
ask for a client certificate anyway). Everything else must match on both sides, hence one function for either.
"""

from __future__ import annotations

import datetime
import ssl

from aioquic.buffer import Buffer
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.packet import QuicHeader, QuicPacketType, pull_quic_header
from cryptography import x509
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

ALPN = "swarm/1"
# QUIC's minimum (RFC 9000 §14): every path on the internet carries it, so no PMTU discovery is needed.
DEFAULT_MAX_DATAGRAM_SIZE = 1200
# The name the client asks for and the certificate carries; nobody checks it (see the module docstring).
_SERVER_NAME = "swarm"


def quic_configuration(
    *, is_client: bool, idle_timeout: float, max_datagram_size: int = DEFAULT_MAX_DATAGRAM_SIZE
) -> QuicConfiguration:
    """The configuration of the client (``is_client=True``) or the server end of a swarm QUIC link."""
    configuration = QuicConfiguration(
        is_client=is_client,
        alpn_protocols=[ALPN],
        idle_timeout=idle_timeout,
        max_datagram_size=max_datagram_size,
    )
    if is_client:
        configuration.verify_mode = ssl.CERT_NONE  # the Noise handshake inside the stream authenticates the peer
        configuration.server_name = _SERVER_NAME
    else:
        configuration.private_key, configuration.certificate = throwaway_certificate()
    return configuration


def throwaway_certificate():
    """A fresh P-256 key and a self-signed certificate for it: QUIC needs one, nobody checks it."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, _SERVER_NAME)])
    now = datetime.datetime.now(datetime.UTC)
    certificate = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=30))
        .sign(key, hashes.SHA256())
    )
    return key, certificate


def client_initial_header(data: bytes, configuration: QuicConfiguration) -> QuicHeader | None:
    """The header of ``data`` if it is a client's first datagram (an Initial of a version we speak), else None."""
    try:
        header = pull_quic_header(Buffer(data=data), host_cid_length=configuration.connection_id_length)
    except ValueError:
        return None  # a late punch packet, or garbage
    if (
        header.packet_type == QuicPacketType.INITIAL
        and header.version in configuration.supported_versions
        and len(data) >= 1200  # RFC 9000 §14.1: a client's Initial datagram is padded to 1200 bytes
    ):
        return header
    return None


__all__ = [
    "ALPN",
    "DEFAULT_MAX_DATAGRAM_SIZE",
    "quic_configuration",
    "throwaway_certificate",
    "client_initial_header",
]
