"""Browser-test plumbing: a real swarm running in its own trio loop on a background thread (so one swarm and one
loaded model serve a whole test module), and headless Chromium from Debian driven by Playwright's sync API."""

from __future__ import annotations

import os
import shutil
import threading
from pathlib import Path

import trio

from harness import running_swarm

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]
ARTIFACTS = Path(__file__).resolve().parent.parent / "test-artifacts"


def chromium_path() -> str | None:
    return CHROMIUM if os.path.exists(CHROMIUM) else shutil.which("chromium")


class BackgroundSwarm:
    """`running_swarm` on a thread of its own. `call(fn, *args)` runs an async function in the swarm's loop."""

    def __init__(self, tmp: Path, model_dirs: list[Path], fellows: int = 2, leader_env: dict | None = None):
        self.tmp, self.model_dirs, self.fellows, self.leader_env = tmp, model_dirs, fellows, leader_env
        self.swarm = None
        self.token = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._stop: trio.Event | None = None
        self._thread = threading.Thread(target=self._run, name="swarm", daemon=True)

    def _run(self) -> None:
        async def main():
            self.token = trio.lowlevel.current_trio_token()
            self._stop = trio.Event()
            async with running_swarm(self.tmp, self.model_dirs, fellows=self.fellows,
                                     leader_env=self.leader_env) as swarm:
                self.swarm = swarm
                self._ready.set()
                await self._stop.wait()

        try:
            trio.run(main)
        except BaseException as exc:  # noqa: BLE001 - reported to the test thread
            self._error = exc
        finally:
            self._ready.set()

    def start(self, timeout: float = 120) -> BackgroundSwarm:
        self._thread.start()
        self._ready.wait(timeout)
        if self.swarm is None:
            raise RuntimeError(f"the swarm did not start: {self._error!r}")
        return self

    def call(self, fn, *args):
        return trio.from_thread.run(fn, *args, trio_token=self.token)

    def sync(self, fn, *args):
        """A plain function run inside the swarm's loop (so it sees a consistent state)."""
        async def wrapper():
            return fn(*args)
        return self.call(wrapper)

    def stop(self) -> None:
        if self._stop is not None and self.token is not None:
            try:
                trio.from_thread.run_sync(self._stop.set, trio_token=self.token)
            except trio.RunFinishedError:
                pass
        self._thread.join(30)
