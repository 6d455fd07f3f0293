"""A small synchronous client for CLI commands that talk to a leader (--leader URL --token T)."""

from __future__ import annotations

import sys
import time

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

    def post(self, path: str, body: dict | None = None) -> dict:
        return self._call("POST", path, body if body is not None else {})

    def put(self, path: str, body: dict) -> dict:
        return self._call("PUT", path, body)

    def delete(self, path: str) -> dict:
        return self._call("DELETE", path)

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
