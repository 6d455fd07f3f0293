"""Join tokens carry the leader's public key, so `swarm join URL --token T` pins the leader from the first byte.

Format: ``swj1.<leader key, url-safe base64>.<secret>[.<sha256 of the leader's TLS certificate>]``; the last part
only when the leader serves HTTPS (swarm.tunnel.tls). The leader stores only a hash of the secret.
"""

from __future__ import annotations

from swarm.errors import AuthError, ProtocolError
from swarm.tunnel.keys import decode_key, encode_key
from swarm.tunnel.tls import decode_pin, encode_pin

PREFIX = "swj1"


def make_join_token(leader_public: bytes, secret: str, cert_pin: bytes | None = None) -> str:
    token = f"{PREFIX}.{encode_key(leader_public)}.{secret}"
    return f"{token}.{encode_pin(cert_pin)}" if cert_pin else token


def parse_join_token(token: str) -> tuple[bytes, str]:
    """-> (leader public key, secret). Raises AuthError for anything that is not a join token."""
    parts = token.strip().split(".")
    if len(parts) not in (3, 4) or parts[0] != PREFIX or not parts[2]:
        raise AuthError(
            "that is not a swarm join token (it starts with 'swj1.'). Copy the 'Join token:' line the leader "
            "printed on its first start, or create one on the admin page."
        )
    try:
        key = decode_key(parts[1])
    except ProtocolError:
        raise AuthError("the join token's leader key is damaged; copy the whole token again.") from None
    return key, parts[2]


def join_token_cert_pin(token: str) -> bytes | None:
    """The leader's TLS certificate pin a join token carries, or None (a leader on plain HTTP, or a real CA)."""
    parts = token.strip().split(".")
    if len(parts) != 4:
        return None
    try:
        return decode_pin(parts[3])
    except ValueError:  # not url-safe base64 (binascii.Error is one), or not a pin's length
        raise AuthError("the join token's certificate pin is damaged; copy the whole token again.") from None
