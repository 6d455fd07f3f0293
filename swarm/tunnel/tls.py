"""The leader's TLS certificate, pinned by the join token (issue 10, finding 7).

`swarm leader --tls-cert --tls-key` serves HTTPS; the join tokens it mints then carry the sha256 of its certificate,
so a fellow trusts exactly that certificate -- self-signed or not -- and its node credential (file downloads, relay)
never crosses the network in clear. The fellow fetches the certificate once, checks its fingerprint against the pin,
and from then on verifies every connection to the leader against that certificate alone (the control link, file
downloads, the relay). A leader whose certificate comes from a public CA needs no pin: default verification applies.
"""

from __future__ import annotations

import base64
import hashlib
import ssl
import threading
from pathlib import Path
from urllib.parse import urlsplit

from swarm.errors import AuthError

PIN_BYTES = 32  # sha256


def cert_pin(pem: str) -> bytes:
    """The sha256 of a PEM certificate's DER bytes (the first certificate of a chain file)."""
    first = pem[pem.index("-----BEGIN CERTIFICATE-----"): pem.index("-----END CERTIFICATE-----") + 25]
    return hashlib.sha256(ssl.PEM_cert_to_DER_cert(first)).digest()


def cert_pin_of_file(path: Path) -> bytes:
    return cert_pin(Path(path).read_text())


def encode_pin(pin: bytes) -> str:
    return base64.urlsafe_b64encode(pin).decode().rstrip("=")


def decode_pin(text: str) -> bytes:
    pin = base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
    if len(pin) != PIN_BYTES:
        raise ValueError(f"a certificate pin has {PIN_BYTES} bytes, got {len(pin)}")
    return pin


def _origin(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    secure = parts.scheme in ("https", "wss")
    return parts.hostname or "", parts.port or (443 if secure else 80)


def pinned_context(url: str, pin: bytes, timeout: float = 10.0) -> ssl.SSLContext:
    """An SSL context that trusts only the leader's certificate, after checking it against ``pin`` (blocking)."""
    host, port = _origin(url)
    try:
        pem = ssl.get_server_certificate((host, port), timeout=timeout)
    except OSError as exc:
        raise AuthError(f"cannot read the TLS certificate of the leader at {host}:{port}: {exc}") from None
    if cert_pin(pem) != pin:
        raise AuthError(
            f"the leader at {host}:{port} shows a TLS certificate other than the one its join token names "
            f"(sha256 {encode_pin(cert_pin(pem))}, expected {encode_pin(pin)}): someone may be in the way, or the "
            "leader has a new certificate; ask its admin for a new join token."
        )
    context = ssl.create_default_context(cadata=pem)
    context.check_hostname = False  # the pinned certificate itself is the trust: whatever name it was made for
    return context


_contexts: dict[tuple[str, int], ssl.SSLContext] = {}
_lock = threading.Lock()


def register(url: str, context: ssl.SSLContext) -> None:
    """Use ``context`` for every connection to the leader at ``url`` (this process's fellow)."""
    with _lock:
        _contexts[_origin(url)] = context


def context_for(url: str) -> ssl.SSLContext | None:
    """The pinned context for ``url``'s leader, or None: plain HTTP, or default verification for HTTPS."""
    if urlsplit(url).scheme not in ("https", "wss"):
        return None
    with _lock:
        return _contexts.get(_origin(url))


__all__ = ["cert_pin", "cert_pin_of_file", "context_for", "decode_pin", "encode_pin", "pinned_context", "register"]
