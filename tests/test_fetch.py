"""The fellow's file download against a real Hypercorn server on loopback serving swarm.leader.fleet.files."""

from __future__ import annotations

import hashlib
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path

import httpx
import pytest
import trio
from hypercorn.config import Config
from hypercorn.trio import serve
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from swarm.errors import AuthError, ChecksumMismatch, DownloadError
from swarm.fellow.downloads import CredentialRefused, FileNotOnLeader, cached_path, fetch_file, fetch_with_retries
from swarm.leader.fleet.files import file_response

TIMEOUT_S = 30
CREDENTIAL = "swn_good"
AUTH = {"Authorization": f"Bearer {CREDENTIAL}"}


class FileServer:
    """A leader stand-in: serves files of ``root`` behind a bearer credential and records every request."""

    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir()
        self.hashes: dict[str, str] = {}
        self.requests: list[dict[str, str | None]] = []
        self.cut_after: dict[str, int] = {}  # name -> bytes sent before the connection drops (next request only)
        self.ignore_range: set[str] = set()
        self.url = ""
        self.app = Starlette(routes=[Route("/files/{name}", self.serve_file, methods=["GET", "HEAD"])])

    def add(self, name: str, data: bytes, claimed_sha256: str | None = None) -> str:
        (self.root / name).write_bytes(data)
        self.hashes[name] = claimed_sha256 or hashlib.sha256(data).hexdigest()
        return self.hashes[name]

    async def serve_file(self, request: Request) -> Response:
        name = request.path_params["name"]
        self.requests.append({"name": name, "range": request.headers.get("range")})
        if request.headers.get("authorization") != f"Bearer {CREDENTIAL}":
            return PlainTextResponse("node credential refused", status_code=401)
        path = self.root / name
        if name in self.cut_after:
            return self._cut(path, self.cut_after.pop(name))
        if name in self.ignore_range and path.exists():
            return Response(path.read_bytes(), media_type="application/octet-stream")
        return file_response(path, request, sha256=self.hashes.get(name))

    @staticmethod
    def _cut(path: Path, n: int) -> Response:
        data = path.read_bytes()

        async def body() -> AsyncIterator[bytes]:
            yield data[:n]
            await trio.sleep(0.05)  # let the bytes leave before the stream breaks
            raise ConnectionAbortedError("test: the leader drops the connection")

        return StreamingResponse(body(), headers={"content-length": str(len(data))})


@asynccontextmanager
async def running(tmp_path: Path) -> AsyncIterator[tuple[FileServer, httpx.AsyncClient]]:
    server = FileServer(tmp_path / "leader-files")
    config = Config()
    config.bind = ["127.0.0.1:0"]
    config.graceful_timeout = 1
    config.accesslog = None
    config.errorlog = None
    shutdown = trio.Event()
    async with trio.open_nursery() as nursery:
        binds = await nursery.start(partial(serve, server.app, config, shutdown_trigger=shutdown.wait))
        server.url = binds[0]
        try:
            async with httpx.AsyncClient(base_url=server.url, timeout=10) as client:
                yield server, client
        finally:
            shutdown.set()


def _data(n: int) -> bytes:
    return os.urandom(n)


async def test_download_then_cache_hit(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    data = _data(3 * 1024 * 1024 + 17)
    seen: list[tuple[int, int]] = []
    with trio.fail_after(TIMEOUT_S):
        async with running(tmp_path) as (server, client):
            sha = server.add("layer-0.safetensors", data)
            path = await fetch_file(
                client, "/files/layer-0.safetensors", cache, sha, len(data), AUTH, lambda d, t: seen.append((d, t))
            )
            assert path == cache / sha[:2] / sha == cached_path(cache, sha)
            assert path.read_bytes() == data
            assert not path.with_name(sha + ".part").exists()
            assert seen[-1] == (len(data), len(data))
            assert [d for d, _ in seen] == sorted(d for d, _ in seen)
            assert len(server.requests) == 1 and server.requests[0]["range"] is None

            again = await fetch_file(client, "/files/layer-0.safetensors", cache, sha, len(data), AUTH)
            assert again == path
            assert len(server.requests) == 1  # served from the cache: no request


async def test_two_loads_wanting_the_same_file_download_it_once(tmp_path: Path) -> None:
    """A stage loaded again while its first load still downloads: one download, both get the verified file."""
    cache = tmp_path / "cache"
    data = _data(2 * 1024 * 1024 + 5)
    got: list[Path] = []
    with trio.fail_after(TIMEOUT_S):
        async with running(tmp_path) as (server, client):
            sha = server.add("embed.safetensors", data)

            async def load() -> None:
                got.append(await fetch_file(client, "/files/embed.safetensors", cache, sha, len(data), AUTH))

            async with trio.open_nursery() as nursery:
                for _ in range(3):
                    nursery.start_soon(load)
            assert got == [cached_path(cache, sha)] * 3 and got[0].read_bytes() == data
            assert len(server.requests) == 1


async def test_interrupted_download_resumes_with_range(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    data = _data(2 * 1024 * 1024 + 5)
    cut = 1024 * 1024 + 3
    with trio.fail_after(TIMEOUT_S):
        async with running(tmp_path) as (server, client):
            sha = server.add("big.bin", data)
            server.cut_after["big.bin"] = cut
            with pytest.raises(DownloadError, match="resumes") as exc:
                await fetch_file(client, "/files/big.bin", cache, sha, len(data), AUTH)
            assert not isinstance(exc.value, ChecksumMismatch)
            part = cached_path(cache, sha).with_name(sha + ".part")
            assert part.stat().st_size == cut  # what arrived is kept
            assert not cached_path(cache, sha).exists()

            path = await fetch_file(client, "/files/big.bin", cache, sha, len(data), AUTH)
            assert server.requests[-1]["range"] == f"bytes={cut}-"
            assert path.read_bytes() == data
            assert not part.exists()


async def test_retries_resume_in_one_call(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    data = _data(1024 * 1024 + 99)
    with trio.fail_after(TIMEOUT_S):
        async with running(tmp_path) as (server, client):
            sha = server.add("w.bin", data)
            server.cut_after["w.bin"] = 4096
            path = await fetch_with_retries(client, "/files/w.bin", cache, sha, len(data), AUTH, backoff_s=0)
            assert path.read_bytes() == data
            assert [r["range"] for r in server.requests] == [None, "bytes=4096-"]


async def test_server_ignoring_range_restarts_from_zero(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    data = _data(200_000)
    with trio.fail_after(TIMEOUT_S):
        async with running(tmp_path) as (server, client):
            sha = server.add("plain.bin", data)
            server.ignore_range.add("plain.bin")
            part = cached_path(cache, sha).with_name(sha + ".part")
            part.parent.mkdir(parents=True)
            part.write_bytes(b"stale bytes from an older try")
            path = await fetch_file(client, "/files/plain.bin", cache, sha, len(data), AUTH)
            assert server.requests[-1]["range"] == "bytes=29-"
            assert path.read_bytes() == data


async def test_corrupted_file_raises_checksum_mismatch(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    good = _data(100_000)
    sha = hashlib.sha256(good).hexdigest()
    bad = bytearray(good)
    bad[5000] ^= 0xFF
    with trio.fail_after(TIMEOUT_S):
        async with running(tmp_path) as (server, client):
            server.add("layer.bin", bytes(bad), claimed_sha256=sha)
            with pytest.raises(ChecksumMismatch) as exc:
                await fetch_file(client, "/files/layer.bin", cache, sha, len(good), AUTH)
            message = str(exc.value)
            assert "layer.bin" in message and sha in message and hashlib.sha256(bad).hexdigest() in message
            assert "fetched again" in message
            assert not cached_path(cache, sha).exists()
            assert list(cache.rglob("*.part")) == []
            # Retried as a whole: every try fetches from zero, and the last mismatch is raised.
            with pytest.raises(ChecksumMismatch):
                await fetch_with_retries(client, "/files/layer.bin", cache, sha, len(good), AUTH, backoff_s=0)
            assert [r["range"] for r in server.requests] == [None] * 4


async def test_refused_credential_is_a_clear_error(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    data = _data(1000)
    with trio.fail_after(TIMEOUT_S):
        async with running(tmp_path) as (server, client):
            sha = server.add("a.bin", data)
            with pytest.raises(CredentialRefused) as exc:
                await fetch_with_retries(
                    client, "/files/a.bin", cache, sha, len(data), {"Authorization": "Bearer bad"}, backoff_s=0
                )
            assert isinstance(exc.value, DownloadError) and isinstance(exc.value, AuthError)
            assert "node credential" in str(exc.value) and "swarm join" in str(exc.value)
            assert len(server.requests) == 1  # not retried
            assert not cached_path(cache, sha).exists()


async def test_missing_file_is_not_retried(tmp_path: Path) -> None:
    with trio.fail_after(TIMEOUT_S):
        async with running(tmp_path) as (server, client):
            with pytest.raises(FileNotOnLeader, match="404"):
                await fetch_with_retries(client, "/files/nope.bin", tmp_path / "c", "ab" * 32, 10, AUTH, backoff_s=0)
            assert len(server.requests) == 1


async def test_files_endpoint_ranges(tmp_path: Path) -> None:
    data = bytes(range(256)) * 40  # 10240 bytes
    with trio.fail_after(TIMEOUT_S):
        async with running(tmp_path) as (server, client):
            sha = server.add("r.bin", data)
            full = await client.get("/files/r.bin", headers=AUTH)
            assert full.status_code == 200 and full.content == data
            assert full.headers["etag"] == f'"{sha}"' and full.headers["accept-ranges"] == "bytes"

            tail = await client.get("/files/r.bin", headers={**AUTH, "Range": "bytes=10000-"})
            assert tail.status_code == 206 and tail.content == data[10000:]
            assert tail.headers["content-range"] == "bytes 10000-10239/10240"

            middle = await client.get("/files/r.bin", headers={**AUTH, "Range": "bytes=100-199"})
            assert middle.status_code == 206 and middle.content == data[100:200]
            assert middle.headers["content-range"] == "bytes 100-199/10240"

            past = await client.get("/files/r.bin", headers={**AUTH, "Range": "bytes=10240-"})
            assert past.status_code == 416 and past.headers["content-range"] == "bytes */10240"

            cached = await client.get("/files/r.bin", headers={**AUTH, "If-None-Match": f'"{sha}"'})
            assert cached.status_code == 304 and cached.content == b""

            stale = await client.get("/files/r.bin", headers={**AUTH, "Range": "bytes=100-", "If-Range": '"other"'})
            assert stale.status_code == 200 and stale.content == data  # If-Range mismatch: the whole file

            head = await client.head("/files/r.bin", headers=AUTH)
            assert head.status_code == 200 and head.headers["content-length"] == "10240"

            missing = await client.get("/files/absent.bin", headers=AUTH)
            assert missing.status_code == 404


async def test_complete_part_and_empty_file_need_no_request(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    data = _data(5000)
    sha = hashlib.sha256(data).hexdigest()
    empty_sha = hashlib.sha256(b"").hexdigest()
    with trio.fail_after(TIMEOUT_S):
        async with running(tmp_path) as (server, client):
            part = cached_path(cache, sha).with_name(sha + ".part")
            part.parent.mkdir(parents=True)
            part.write_bytes(data)  # a try that got everything but stopped before the rename
            assert (await fetch_file(client, "/files/x.bin", cache, sha, len(data), AUTH)).read_bytes() == data
            assert (await fetch_file(client, "/files/e.bin", cache, empty_sha, 0, AUTH)).read_bytes() == b""
            assert server.requests == []


async def test_a_newer_load_of_a_model_supersedes_one_in_flight_and_an_unload_stops_it() -> None:
    from swarm import control_messages as cm
    from swarm.fellow.loading import StageLoader

    loader = StageLoader(fellow=None)
    finished: list[str] = []

    def load(model: str, load_id: str) -> cm.Load:
        return cm.Load(model, load_id, cm.StageSlot(0, 1, 0, 1, True, True), {}, [])

    takes = {"first": 10, "second": 0.1, "third": 0.2, "fourth": 10}

    async def slow_load(message: cm.Load) -> None:
        await trio.sleep(takes[message.load_id])
        finished.append(message.load_id)

    loader._load = slow_load
    with trio.fail_after(TIMEOUT_S):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(loader.load, load("m", "first"))
            await trio.sleep(0.05)
            nursery.start_soon(loader.load, load("m", "second"))
            nursery.start_soon(loader.load, load("other", "third"))
        assert finished == ["second", "third"]  # the first was cut short; another model's load was not touched
        async with trio.open_nursery() as nursery:
            nursery.start_soon(loader.load, load("m", "fourth"))
            await trio.sleep(0.05)
            loader.cancel("m")
        assert finished == ["second", "third"] and loader._loading == {}
