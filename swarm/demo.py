"""`swarm demo`: a leader and N fellows on this machine, serving the built-in model, until Ctrl-C or SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import webbrowser
from pathlib import Path

import httpx

from swarm.client import LeaderClient
from swarm.errors import SwarmError
from swarm.model_import import ensure_imported
from swarm.store.db import Store
from swarm.tunnel.join_token import make_join_token
from swarm.tunnel.keys import load_or_create_identity

BUILTIN = "smollm2-135m-instruct"


class Processes:
    """The children this demo started; all of them are stopped on the way out, whatever happens."""

    def __init__(self, log_dir: Path):
        self.log_dir = log_dir
        self.children: list[tuple[str, subprocess.Popen]] = []

    def start(self, name: str, args: list[str], env: dict | None = None) -> subprocess.Popen:
        log = open(self.log_dir / f"{name}.log", "ab")
        proc = subprocess.Popen([sys.executable, "-m", "swarm", *args], stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, **(env or {})}, start_new_session=True)
        self.children.append((name, proc))
        return proc

    def check(self) -> None:
        for name, proc in self.children:
            if proc.poll() is not None:
                raise SwarmError(f"the {name} process stopped (exit {proc.returncode}); its log is "
                                 f"{self.log_dir / (name + '.log')}:\n{self.tail(name)}")

    def tail(self, name: str, lines: int = 15) -> str:
        try:
            return "\n".join((self.log_dir / f"{name}.log").read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self) -> None:
        for _, proc in self.children:
            if proc.poll() is None:
                proc.terminate()
        deadline = time.monotonic() + 10
        for _, proc in self.children:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def wait_http(url: str, procs: Processes, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        procs.check()
        try:
            if httpx.get(url + "/healthz", timeout=2).status_code == 200:
                return
        except httpx.TransportError:  # the leader is not listening yet: ask again until the deadline
            pass
        time.sleep(0.2)
    raise SwarmError(f"the leader did not answer at {url} within {timeout:.0f} s")


def run_demo(port: int, stages: int, open_browser: bool, data_dir: Path) -> int:
    if stages < 1:
        raise SwarmError("--stages must be at least 1")
    leader_dir = data_dir / "leader"
    leader_dir.mkdir(parents=True, exist_ok=True)
    # The demo keeps its whole store in its data dir (leader.db), whatever database a real leader here uses: its
    # import, its leader process and its sign-in link never touch SWARM_DATABASE_URL's.
    os.environ.pop("SWARM_DATABASE_URL", None)
    print(f"Demo data: {data_dir}", flush=True)
    ensure_imported(BUILTIN, leader_dir, BUILTIN)

    stop_requested = False

    def on_signal(signum, frame):
        nonlocal stop_requested
        stop_requested = True
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, on_signal)
    procs = Processes(data_dir)
    url = f"http://127.0.0.1:{port}"
    try:
        procs.start("leader", ["leader", "--host", "127.0.0.1", "--port", str(port), "--data-dir", str(leader_dir)])
        wait_http(url, procs)
        token, join_token, login = credentials(leader_dir, fellows=stages)
        for i in range(stages):
            procs.start(f"fellow-{i}", ["join", url, "--token", join_token, "--name", f"fellow-{i}",
                                        "--data-dir", str(data_dir / f"fellow-{i}")],
                        env={"SWARM_SERVE_PORT": "0"})
        client = LeaderClient(url, token)
        wait_fellows(client, procs, stages)
        print(f"Loading {BUILTIN} over {stages} stage{'s' if stages > 1 else ''}...", flush=True)
        client.post(f"/api/v1/models/{BUILTIN}/load", {"num_stages": stages})
        view = client.wait_ready(BUILTIN, show_progress=True)
        for s in view["stages"]:
            print(f"Stage {s['index']}: {s['fellow']} · L{s['layers'][0]}-{s['layers'][1] - 1} · "
                  f"{s['memory_bytes'] / 1e6:.0f} MB", flush=True)
        chat_url = f"{url}/auth/link?token={login}"
        print(f"Chat: {chat_url}", flush=True)
        print(f"API base: {url}/v1", flush=True)
        print(f"API token: {token}", flush=True)
        print("Press Ctrl-C to stop.", flush=True)
        if open_browser:
            webbrowser.open(chat_url)
        while True:
            procs.check()
            time.sleep(0.5)
    except KeyboardInterrupt:
        print("\nStopping the demo...", flush=True)
        return 0
    finally:
        signal.signal(signal.SIGTERM, previous)
        procs.stop()


def credentials(leader_dir: Path, fellows: int = 2) -> tuple[str, str, str]:
    """A fresh API token, join token (for ``fellows`` fellows, within the hour) and sign-in link for this run, made
    by the demo in the leader's store."""
    store = Store(leader_dir / "leader.db")
    try:
        admin = next(u for u in store.list_users() if u.is_admin)
        token, _ = store.create_api_token(admin.id, "demo")
        login = store.create_login_link(admin.id, ttl_s=24 * 3600)
    finally:
        store.close()
    return token, mint_join_token(leader_dir, uses=fellows, ttl_s=3600), login


def mint_join_token(leader_dir: Path, uses: int = 1, ttl_s: float = 3600) -> str:
    """A join token for ``uses`` fellows, written straight into a (running or stopped) leader's store -- as the
    demo and the tests do; an admin uses `swarm admin join-token` or the admin page."""
    store = Store(leader_dir / "leader.db")
    try:
        admin = next(u for u in store.list_users() if u.is_admin)
        pool = store.ensure_default_pool(admin.id)
        _, public = load_or_create_identity(leader_dir / "leader.key")
        return make_join_token(public, store.create_join_token(pool.id, ttl_s=ttl_s, uses=uses))
    finally:
        store.close()


def wait_fellows(client: LeaderClient, procs: Processes, count: int, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        procs.check()
        online = [f for f in client.get("/api/v1/fellows")["fellows"] if f["state"] == "online"]
        if len(online) >= count:
            return
        time.sleep(0.3)
    raise SwarmError(f"only some of the {count} fellows joined within {timeout:.0f} s; see the fellow-*.log files")
