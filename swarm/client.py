"""A small synchronous client for CLI commands that talk to a leader (--leader URL --token T)."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator

import httpx

from swarm.config import Settings
from swarm.errors import AuthError, ConfigError, SwarmError


class LeaderClient:
    def __init__(self, url: str, token: str, timeout: float = 60.0):
        self.url = url.rstrip("/")
        self.http = httpx.Client(base_url=self.url, headers={"authorization": f"Bearer {token}"}, timeout=timeout)

    @classmethod
    def from_options(cls, leader: str | None, token: str | None, settings: Settings) -> LeaderClient:
        url = leader or settings.leader_url
        token = token or settings.token
        if not url:
            raise ConfigError("which leader? Pass --leader http://HOST:PORT or set SWARM_LEADER.")
        if not token:
            raise ConfigError("this needs an API token: pass --token or set SWARM_TOKEN (the leader printed the "
                              "admin's on its first start).")
        return cls(url, token)

    def _check(self, response: httpx.Response) -> dict:
        try:
            data = response.json()
        except ValueError:
            data = {}
        if response.status_code == 401:
            raise AuthError(f"the leader refused the token: {_message(data)}")
        if response.status_code >= 400:
            raise SwarmError(_message(data) or f"the leader answered {response.status_code}")
        return data

    def _call(self, method: str, path: str, body: dict | None = None) -> dict:
        try:
            return self._check(self.http.request(method, path, json=body))
        except httpx.TransportError as exc:
            raise SwarmError(f"cannot reach the leader at {self.url}: {exc}. Is `swarm leader` running?") from None

    def get(self, path: str) -> dict:
        return self._call("GET", path)

    def get_text(self, path: str) -> str:
        """A GET whose answer is text (CSV); errors as ``get``'s."""
        try:
            response = self.http.get(path)
        except httpx.TransportError as exc:
            raise SwarmError(f"cannot reach the leader at {self.url}: {exc}. Is `swarm leader` running?") from None
        if response.status_code >= 400:
            self._check(response)
        return response.text

    def post(self, path: str, body: dict | None = None) -> dict:
        return self._call("POST", path, body if body is not None else {})

    def put(self, path: str, body: dict) -> dict:
        return self._call("PUT", path, body)

    def delete(self, path: str) -> dict:
        return self._call("DELETE", path)

    def chat_stream(self, body: dict) -> Iterator[dict]:
        """The chunks of a streamed chat completion (POST /v1/chat/completions with stream), as they come; a refusal
        or a reply that fails on the way is a SwarmError in the leader's words."""
        body = {**body, "stream": True, "stream_options": {"include_usage": True}}
        # No read timeout of our own: the leader ends a reply whose ring went silent (SWARM_REQUEST_STALL_S).
        timeout = httpx.Timeout(self.http.timeout.connect, read=None)
        try:
            with self.http.stream("POST", "/v1/chat/completions", json=body, timeout=timeout) as response:
                if response.status_code >= 400:
                    response.read()
                    self._check(response)
                for line in response.iter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        return
                    try:
                        chunk = json.loads(data)
                    except ValueError:
                        raise SwarmError(f"the leader sent a stream event that is not JSON: {data[:80]!r}") from None
                    if isinstance(chunk, dict) and chunk.get("error"):
                        raise SwarmError(_message(chunk) or "the reply failed on the ring")
                    yield chunk
        except httpx.TransportError as exc:
            raise SwarmError(f"the connection to the leader at {self.url} broke: {exc}. Is `swarm leader` "
                             "running?") from None

    def wait_ready(self, model: str, timeout: float = 1800.0, show_progress: bool = False) -> dict:
        deadline = time.monotonic() + timeout
        last = None
        while time.monotonic() < deadline:
            view = self.get(f"/api/v1/models/{model}")
            if view["status"] == "ready":
                if show_progress and last is not None:
                    print(file=sys.stderr)
                return view
            if view["status"] in ("failed", "not_loaded"):
                raise SwarmError(f"loading {model} failed: {view.get('error') or view['status']}")
            if show_progress:
                stages = view.get("progress", {}).get("stages", [])
                line = " | ".join(f"stage {s['index']} {s['phase']} {s['fraction'] * 100:3.0f}%" for s in stages)
                if line != last:
                    print(f"\rloading {model}: {line}", end="", file=sys.stderr, flush=True)
                    last = line
            time.sleep(0.3)
        raise SwarmError(f"{model} did not become ready within {timeout:.0f} s")


def _message(data: dict) -> str:
    error = data.get("error") if isinstance(data, dict) else None
    if isinstance(error, dict):
        return str(error.get("message", ""))
    return str(error or "")


def speed_line(tokens: int, tokens_per_s: float | None, ttft_s: float | None, timing: dict | None) -> str:
    """The speed line under a reply, as the chat page draws it: ``12.5 tokens/s · 80 tokens · 0.42 s to first token``,
    then where each token's time went when the fellows measured it (``stage 0 4 ms/token · link 152 ms · stage 1 5
    ms``, or ``compute 12 ms/token`` on one fellow)."""
    parts = []
    if tokens_per_s is not None:
        parts.append(f"{tokens_per_s:.1f} tokens/s")
    parts.append(f"{tokens} token{'' if tokens == 1 else 's'}")
    if ttft_s is not None:
        parts.append(f"{ttft_s:.2f} s to first token")
    return " · ".join(parts + split_parts(timing))


def _ms(value: float) -> str:
    return f"{value:.0f}" if value >= 1 else f"{value:.1f}"  # whole ms as in the seed; a tenth below 1 ms


def split_parts(timing: dict | None) -> list[str]:
    """swarm.timing's split of a token's time, in the speed line's words ([] when the fellows did not report it)."""
    stages = timing.get("stages") if isinstance(timing, dict) and timing.get("split") == "fellows" else None
    if not stages or any(not isinstance(s.get("compute_ms_per_token"), (int, float)) for s in stages):
        return []
    assert timing is not None  # the stages came from it
    if len(stages) == 1:
        return [f"compute {_ms(stages[0]['compute_ms_per_token'])} ms/token"]
    parts = [f"stage {stages[0]['stage']} {_ms(stages[0]['compute_ms_per_token'])} ms/token"]
    if isinstance(timing.get("link_ms_per_token"), (int, float)):
        parts.append(f"link {_ms(timing['link_ms_per_token'])} ms")
    parts += [f"stage {s['stage']} {_ms(s['compute_ms_per_token'])} ms" for s in stages[1:]]
    return parts
