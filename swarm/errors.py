"""One exception tree for the whole product.

Every error a user can meet derives from :class:`SwarmError`; its message says what happened, what is needed and
what to do. Code at the boundaries (CLI, HTTP routes, the fellow's control loop) maps these to exit codes, OpenAI-shaped
errors or control messages, and never shows a stack trace to a user.
"""

from __future__ import annotations


class SwarmError(Exception):
    """Something went wrong in swarm; the message tells the user what to do."""


class ConfigError(SwarmError):
    """A setting (SWARM_* variable or command-line option) has a value swarm cannot use."""


# --- wire and tunnel -------------------------------------------------------------------------------------------------


class ProtocolError(SwarmError):
    """A peer sent a message that does not follow the swarm wire protocol."""


class TunnelError(SwarmError):
    """An encrypted link between two swarm processes failed."""


class HandshakeFailed(TunnelError):
    """The Noise handshake did not complete."""


class PeerRejected(TunnelError):
    """The peer's key is not the one the leader vouched for."""


class FrameCorrupted(TunnelError):
    """A frame failed authentication: it was changed on the way, or the link lost a frame."""


class LinkClosed(TunnelError):
    """The other end closed the link."""


# --- models ----------------------------------------------------------------------------------------------------------


class ModelError(SwarmError):
    """A model cannot be imported, found, loaded or run."""


class UnsupportedArchitecture(ModelError):
    """The model's architecture is not one the stage code can slice into layers."""


class KernelMismatch(ModelError, ValueError):
    """swarm's compiled kernel was handed a tensor of the wrong shape, dtype, layout or device, or was built with
    another struct layout than its Python mirror: a bug in swarm, refused before the C code could corrupt memory.
    A ValueError too, as torch's own operations raise one for such inputs."""


class ModelNotFound(ModelError):
    """No model of that name is in the catalogue."""


class ResponseNotFound(SwarmError):
    """No stored response of that id belongs to the caller (the Responses API)."""


class PoolNotFound(SwarmError):
    """No pool of that name (or id) on this leader."""


class ModelNotLoaded(ModelError):
    """The model is in the catalogue but not loaded on any fellow."""


class ImportFailed(ModelError):
    """Importing a model from a folder, a GGUF file or a built-in name failed."""


class PlacementError(ModelError):
    """The fellows of the pool cannot hold the model as asked."""


class DrainRefused(PlacementError):
    """A fellow cannot leave without a pause: no other fellow can take one of its stages (or the handover failed)."""


class DownloadError(SwarmError):
    """A model file could not be fetched from the leader."""


class ChecksumMismatch(DownloadError):
    """A downloaded file's sha256 is not the one in the model's manifest."""


# --- leader ----------------------------------------------------------------------------------------------------------


class AuthError(SwarmError):
    """A password, session, API token, join token or node credential was missing or wrong."""


class Forbidden(AuthError):
    """Signed in, but this account may not do that (it needs an admin, or it is someone else's)."""


class TooManyAttempts(SwarmError):
    """Sign-in attempts come too fast; the message says how long to wait (``retry_after`` seconds)."""

    def __init__(self, message: str, retry_after: float):
        super().__init__(message)
        self.retry_after = retry_after


class BodyTooLarge(SwarmError):
    """A request body is larger than its route accepts."""


class StoreError(SwarmError):
    """The leader's database or model files could not be read or written."""


class UpdateError(SwarmError):
    """The leader's version of swarm could not be built, fetched or installed on a fellow (`swarm update`)."""


class BadRequest(SwarmError):
    """A request to the leader is malformed or asks for something that cannot be; the message says what to fix."""

    def __init__(self, message: str, code: str = "bad_request"):
        super().__init__(message)
        self.code = code


class RequestFailed(SwarmError):
    """A chat request could not be completed by the ring."""


class ContextTooLong(RequestFailed):
    """The conversation does not fit in the model's context."""


class PoolBusy(RequestFailed):
    """The queue of requests waiting for a model is full; the client may try again after ``retry_after`` seconds."""

    def __init__(self, message: str, retry_after: int):
        super().__init__(message)
        self.retry_after = retry_after


class QuotaExceeded(RequestFailed):
    """A user or API token is over one of its quotas (swarm.leader.serving.quotas); ``retry_after`` seconds until the
    request would pass, None when it never can (a prompt larger than a limit)."""

    def __init__(self, message: str, retry_after: int | None):
        super().__init__(message)
        self.retry_after = retry_after


class QueueTimeout(RequestFailed):
    """A request waited longer than SWARM_SERVE_QUEUE_TIMEOUT_S to start and was given up."""


def counted(n: int, noun: str, plural: str | None = None) -> str:
    """``n`` and its noun in the right number, for messages: "1 request", "2 requests", "0 other requests"."""
    return f"{n} {noun if n == 1 else plural or noun + 's'}"


def first_leaf(exc: BaseException) -> BaseException:
    """The first real exception inside (nested) exception groups: trio nurseries wrap even a single failure, and a
    user should read what failed, not "Exceptions from Trio nursery"."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return exc
