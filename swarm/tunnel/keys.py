"""X25519 static identities: the long-lived keys that name a leader or a fellow.

Keys travel as raw 32-byte strings inside the tunnel code (that is what Noise wants), as url-safe base64 in join
tokens and JSON, and as a short base32 fingerprint wherever a person has to read or compare one.
"""

from __future__ import annotations

import base64
import hashlib
import os
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import x25519

from swarm.errors import ProtocolError, TunnelError

KEY_SIZE = 32  # RFC 7748 §5: X25519 scalars and u-coordinates are 32 bytes.

# 16 bytes of sha256 = 128 bits: enough that nobody can grind a key to collide with a given fingerprint, and short
# enough (26 base32 characters) to read aloud or compare on two screens.
_FINGERPRINT_BYTES = 16


def generate_private_key() -> bytes:
    """A fresh X25519 private key, as 32 raw bytes."""
    return x25519.X25519PrivateKey.generate().private_bytes(
        serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption()
    )


def public_key(private: bytes) -> bytes:
    """The 32-byte public key that belongs to ``private``."""
    if len(private) != KEY_SIZE:
        raise TunnelError(f"a private key has {KEY_SIZE} bytes, this one has {len(private)}")
    return (
        x25519.X25519PrivateKey.from_private_bytes(private)
        .public_key()
        .public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    )


def fingerprint(public: bytes) -> str:
    """A short printable name for a public key, for logs and the admin page (not for pinning: pin the whole key)."""
    digest = hashlib.sha256(public).digest()[:_FINGERPRINT_BYTES]
    return base64.b32encode(digest).decode("ascii").rstrip("=").lower()


def encode_key(public: bytes) -> str:
    """A public key as url-safe base64 without padding, to put in a join token, a URL or JSON."""
    return base64.urlsafe_b64encode(public).decode("ascii").rstrip("=")


def decode_key(text: str) -> bytes:
    """The 32 raw bytes of a key written by :func:`encode_key`; ProtocolError if the text is not one."""
    if not isinstance(text, str):
        raise ProtocolError(f"a public key must be text (url-safe base64), got {type(text).__name__}")
    padded = text + "=" * (-len(text) % 4)
    try:
        # validate=True would reject the url-safe alphabet, so check the characters by hand instead.
        if not all(c.isascii() and (c.isalnum() or c in "-_=") for c in padded):
            raise ValueError("unexpected character")
        raw = base64.urlsafe_b64decode(padded)
    except ValueError:
        raise ProtocolError(
            f"public key {text[:60]!r} is not url-safe base64; copy the whole key or join token again"
        ) from None
    if len(raw) != KEY_SIZE:
        raise ProtocolError(
            f"public key {text[:60]!r} decodes to {len(raw)} bytes, a key has {KEY_SIZE}; "
            "copy the whole key or join token again"
        )
    return raw


def load_or_create_identity(path: Path) -> tuple[bytes, bytes]:
    """(private, public) from the key file at ``path``, creating it with mode 0600 on first use."""
    path = Path(path)
    try:
        private = path.read_bytes()
    except FileNotFoundError:
        private = _create_key_file(path)
    except OSError as exc:
        raise TunnelError(f"cannot read the identity key {path}: {exc.strerror}; check its permissions") from exc
    if len(private) != KEY_SIZE:
        raise TunnelError(
            f"identity key {path} has {len(private)} bytes, a key has {KEY_SIZE}; the file is damaged or is "
            "not a swarm key. Move it away to make a new identity (the leader must then vouch for the new key)"
        )
    return private, public_key(private)


def _create_key_file(path: Path) -> bytes:
    private = generate_private_key()
    path.parent.mkdir(parents=True, exist_ok=True)
    # Write a temporary file created 0600 from the start (never chmod afterwards: the key would be readable for a
    # moment), then rename: a crash leaves either no key or a whole one, never a truncated one.
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(private)
            f.flush()
            os.fsync(f.fileno())
        # link() fails if another process created the key meanwhile; then that key wins and we read it.
        try:
            os.link(tmp, path)
        except FileExistsError:
            return path.read_bytes()
        except OSError:
            # A file system without hard links (some USB sticks, network shares): replace is still atomic.
            os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return private
