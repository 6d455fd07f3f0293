"""Join tokens carry the leader's public key, so `swarm join URL --token T` pins the leader from the first byte.

Format: ``swj1.<leader key, url-safe base64>.<secret>``. The leader stores only a hash of the secret.
"""

from __future__ import annotations

from swarm.errors import AuthError
from swarm.tunnel.keys import decode_key, encode_key

PREFIX = "swj1"


def make_join_token(leader_public: bytes, secret: str) -> str:
    return f"{PREFIX}.{encode_key(leader_public)}.{secret}"


def parse_join_token(token: str) -> tuple[bytes, str]:
    """-> (leader public key, secret). Raises AuthError for anything that is not a join token."""
    parts = token.strip().split(".")
    if len(parts) != 3 or parts[0] != PREFIX or not parts[2]:
        raise AuthError(
            "that is not a swarm join token (it starts with 'swj1.'). Copy the 'Join token:' line the leader "
            "printed on its first start, or create one on the admin page."
        )
    try:
        key = decode_key(parts[1])
    except Exception:
        raise AuthError("the join token's leader key is damaged; copy the whole token again.") from None
    return key, parts[2]
