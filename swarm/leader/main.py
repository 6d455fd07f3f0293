"""`swarm leader`: run the leader until Ctrl-C or SIGTERM."""

from __future__ import annotations

import signal
from pathlib import Path

import trio

from swarm.config import Settings
from swarm.leader.app import Leader


def run_leader(host: str, port: int, data_dir: Path, settings: Settings, tls_cert: Path | None = None,
               tls_key: Path | None = None) -> None:
    leader = Leader(data_dir, settings, tls_cert=tls_cert, tls_key=tls_key)
    first = leader.first_start
    shown_host = "127.0.0.1" if host in ("0.0.0.0", "::") else host
    scheme = "https" if leader.tls else "http"

    async def main():
        stop = trio.Event()
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async with trio.open_nursery() as nursery:
                async def watch():
                    async for _ in signals:
                        stop.set()
                        return

                nursery.start_soon(watch)
                await nursery.start(lambda task_status: leader.serve(host, port, shutdown_trigger=stop.wait,
                                                                     task_status=task_status))
                print(f"Leader: {scheme}://{shown_host}:{port}", flush=True)
                if first is not None:
                    print(f"Admin password: {first.admin_password}", flush=True)
                    print(f"Admin API token: {first.admin_token}", flush=True)
                    print(f"Join token: {first.join_token}", flush=True)
                    print("(it lets one fellow join, within 24 h; for more: swarm admin join-token --uses N)",
                          flush=True)
                await stop.wait()
                nursery.cancel_scope.cancel()

    trio.run(main)
