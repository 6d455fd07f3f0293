"""The fellow's download client for model files: content-addressed cache, resume with HTTP Range, sha256 check.

A file lives at ``cache / sha256[:2] / sha256`` once verified, so a stage placed again on this fellow (or another
model sharing a file) reuses it without a request. While downloading it is ``<final>.part``; a broken connection
keeps the part, and the next call asks only for the rest (``Range: bytes=<len>-``). The hash is computed while the
bytes arrive (the part already on disk is hashed first, in a worker thread), so the final check costs nothing extra.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Awaitable, Callable
from pathlib import Path

import httpx
import trio

from swarm.errors import AuthError, ChecksumMismatch, DownloadError

__all__ = ["CredentialRefused", "FileNotOnLeader", "cached_path", "fetch_file", "fetch_with_retries"]

CHUNK = 1 << 20  # 1 MiB: few enough thread hops for file writes, small enough for smooth progress
HASH_BLOCK = 4 << 20
RETRY_ATTEMPTS = 3
RETRY_BACKOFF_S = 1.0  # then 2 s: a leader restart or a Wi-Fi blip is usually over by then


class CredentialRefused(DownloadError, AuthError):
    """The leader refused this fellow's node credential for a file download."""


class FileNotOnLeader(DownloadError):
    """The leader has no file at that address (404)."""


def cached_path(dest_cache: Path, sha256: str) -> Path:
    """Where the verified file with this hash lives in the cache."""
    return Path(dest_cache) / sha256[:2] / sha256


def _hash_file(path: Path) -> hashlib._Hash:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(HASH_BLOCK):
            digest.update(block)
    return digest


# one download of a file at a time in this process: a second load wanting the same file (a stage loaded again
# while its first load still downloads, two models sharing a file) waits for the first and then finds it cached,
# instead of writing the same part file at the same time
_downloading: dict[str, trio.Lock] = {}


async def fetch_file(
    client: httpx.AsyncClient,
    url: str,
    dest_cache: Path,
    sha256: str,
    size: int,
    headers: dict[str, str],
    progress: Callable[[int, int], None] | None = None,
) -> Path:
    """Download ``url`` into the cache, resuming a part left by an earlier try, and return the verified path.

    Raises CredentialRefused (401/403), FileNotOnLeader (404), ChecksumMismatch (the part is deleted), or
    DownloadError (connection lost: the part is kept for the next call).
    """
    sha256 = sha256.lower()
    key = str(cached_path(dest_cache, sha256))
    lock = _downloading.setdefault(key, trio.Lock())
    try:
        async with lock:
            return await _fetch(client, url, dest_cache, sha256, size, headers, progress)
    finally:
        if not lock.locked() and lock.statistics().tasks_waiting == 0:
            _downloading.pop(key, None)


async def _fetch(client, url, dest_cache, sha256, size, headers, progress) -> Path:
    final = cached_path(dest_cache, sha256)
    name = url.rsplit("/", 1)[-1] or url
    if final.is_file():
        if final.stat().st_size == size:
            return final
        final.unlink()  # a stray file of the wrong size is no cache hit
    part = final.with_name(final.name + ".part")
    final.parent.mkdir(parents=True, exist_ok=True)

    offset = part.stat().st_size if part.exists() else 0
    if offset > size:
        part.unlink()
        offset = 0
    digest = await trio.to_thread.run_sync(_hash_file, part) if offset else hashlib.sha256()

    if offset < size:
        digest = await _download_rest(client, url, headers, part, offset, digest, size, name, progress)
    if size == 0:
        part.touch()
    actual = digest.hexdigest()
    if actual != sha256:
        part.unlink(missing_ok=True)
        raise ChecksumMismatch(
            f"{name} from {url} has sha256 {actual}, but the model's manifest says {sha256}; the download was "
            "deleted and it will be fetched again."
        )
    os.replace(part, final)  # atomic: the cache never holds an unverified file under its final name
    return final


async def _download_rest(client, url, headers, part, offset, digest, size, name, progress) -> hashlib._Hash:
    """Ask for the bytes from ``offset`` on and append them to the part; the digest of the whole part."""
    request_headers = dict(headers)
    if offset:
        request_headers["Range"] = f"bytes={offset}-"
    try:
        async with client.stream("GET", url, headers=request_headers) as response:
            _check_status(response, url, offset, part)
            if offset and response.status_code == 200:
                # The leader sent the whole file instead of the rest: start again from zero.
                offset, digest = 0, hashlib.sha256()
            done = await _write_part(response, part, offset, digest, size, name, progress)
    except httpx.TransportError as exc:
        raise DownloadError(
            f"the download of {name} from {url} broke off ({type(exc).__name__}: {exc}); what arrived is kept "
            "and the next try resumes from there."
        ) from exc
    if done < size:
        raise DownloadError(f"the leader ended {name} after {done} of {size} bytes; the next try resumes from there.")
    return digest


async def _write_part(
    response: httpx.Response,
    part: Path,
    offset: int,
    digest: hashlib._Hash,
    size: int,
    name: str,
    progress: Callable[[int, int], None] | None,
) -> int:
    """Append the body to ``part`` (truncated first when ``offset`` is 0) and to ``digest``; the byte count on disk.

    Network chunks (~64 KiB) are gathered into CHUNK-sized writes, one worker-thread hop each. When the connection
    breaks, the gathered bytes are written before the error goes up, so the part holds everything that arrived.
    """
    done, buffer = offset, bytearray()

    async def flush() -> None:
        nonlocal done
        if buffer:
            data = bytes(buffer)
            buffer.clear()
            await f.write(data)
            digest.update(data)
            done += len(data)

    async with await trio.open_file(part, "ab" if offset else "wb") as f:
        try:
            async for chunk in response.aiter_bytes():
                if done + len(buffer) + len(chunk) > size:
                    await f.aclose()
                    part.unlink(missing_ok=True)
                    raise DownloadError(
                        f"the leader sent more than the {size} bytes the manifest gives for {name}; "
                        "the part was deleted and it will be fetched again."
                    )
                buffer += chunk
                if len(buffer) >= CHUNK:
                    await flush()
                if progress is not None:
                    progress(done + len(buffer), size)
        except httpx.TransportError:
            await flush()
            raise
        await flush()
        await f.flush()
        await trio.to_thread.run_sync(os.fsync, f.wrapped.fileno())
    return done


def _check_status(response: httpx.Response, url: str, offset: int, part: Path) -> None:
    status = response.status_code
    if status in (401, 403):
        raise CredentialRefused(
            f"the leader refused this fellow's node credential when fetching {url} (HTTP {status}); "
            "run swarm join again with a current join token."
        )
    if status == 404:
        raise FileNotOnLeader(
            f"the leader has no file at {url} (HTTP 404); the model may have been deleted or re-imported."
        )
    if status == 200 or (status == 206 and offset):
        if status == 206:
            content_range = response.headers.get("content-range", "")
            if not content_range.startswith(f"bytes {offset}-"):
                part.unlink(missing_ok=True)
                raise DownloadError(
                    f"the leader answered a resume of {url} from byte {offset} with {content_range!r}; "
                    "the next try starts again."
                )
        return
    if status == 416:
        part.unlink(missing_ok=True)
        raise DownloadError(
            f"the leader could not resume {url} from byte {offset} (HTTP 416): the file there is shorter; "
            "the next try starts again from zero."
        )
    raise DownloadError(f"the leader answered HTTP {status} for {url}; the next try starts again.")


async def fetch_with_retries(
    client: httpx.AsyncClient,
    url: str,
    dest_cache: Path,
    sha256: str,
    size: int,
    headers: dict[str, str] | Callable[[], dict[str, str]],
    progress: Callable[[int, int], None] | None = None,
    *,
    attempts: int = RETRY_ATTEMPTS,
    backoff_s: float = RETRY_BACKOFF_S,
    renew_credential: Callable[[], Awaitable[None]] | None = None,
) -> Path:
    """``fetch_file``, tried up to ``attempts`` times with doubling backoff; each try resumes the last one's part.

    A missing file is not retried: trying again cannot fix it. A refused credential is retried once after
    ``renew_credential`` returns (the fellow's control link was re-made and the leader issued a new one), with
    ``headers`` called again for it; without ``renew_credential`` it is final.
    """
    headers_now = headers if callable(headers) else (lambda: headers)
    renewed = False
    failures = 0
    while True:
        try:
            return await fetch_file(client, url, dest_cache, sha256, size, headers_now(), progress)
        except FileNotOnLeader:
            raise
        except CredentialRefused:
            if renewed or renew_credential is None:
                raise
            renewed = True
            await renew_credential()
        except DownloadError:
            failures += 1
            if failures >= attempts:
                raise
            await trio.sleep(backoff_s * 2 ** (failures - 1))
