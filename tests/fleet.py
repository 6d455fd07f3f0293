"""Fellows as real `swarm join` processes, for tests that kill, freeze or restart them (kill -9, SIGSTOP)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from harness import install_model, wait_for, wait_until


class FellowProcess:
    def __init__(self, url: str, join_token: str, data_dir: Path, name: str, *, standby: bool = False,
                 env: dict | None = None, cpus: str | None = None):
        self.url, self.join_token, self.data_dir, self.name = url, join_token, data_dir, name
        self.standby = standby
        self.cpus = cpus  # taskset's list ("0", "1-3"): the process and every thread it starts run only there
        # ``env`` adds to (or, with None, takes out of) these
        env = {**os.environ, "SWARM_SERVE_PORT": "0", "SWARM_HEARTBEAT_S": "1", "OMP_NUM_THREADS": "1", **(env or {})}
        self.env = {k: v for k, v in env.items() if v is not None}
        self.log_path = data_dir.parent / f"{name}.log"
        self.proc: subprocess.Popen | None = None

    def start(self) -> FellowProcess:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        args = ["taskset", "-c", self.cpus] if self.cpus else []
        args += [sys.executable, "-m", "swarm", "join", self.url, "--token", self.join_token, "--name", self.name,
                "--data-dir", str(self.data_dir)]
        if self.standby:
            args.append("--standby")
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                     start_new_session=True)
        log.close()
        return self

    def kill(self) -> None:
        """kill -9: no goodbye on any socket."""
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def freeze(self) -> None:
        """SIGSTOP: the process and its sockets go silent without closing (a power cut, a laptop lid shut)."""
        self.proc.send_signal(signal.SIGSTOP)

    def thaw(self) -> None:
        self.proc.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        _stop(self.proc, thaw=True)

    def log(self, lines: int = 40) -> str:
        return _tail(self.log_path, lines)


def logs(fellows: list[FellowProcess], lines: int = 40) -> str:
    return "\n".join(f"--- {f.name} ---\n{f.log(lines)}" for f in fellows)


class LeaderProcess:
    """`swarm leader` as a real process: its first-start secrets come from what it prints."""

    def __init__(self, data_dir: Path, port: int, env: dict | None = None):
        self.data_dir, self.port = data_dir, port
        self.env = {**os.environ, **(env or {})}
        self.out_path = data_dir.parent / "leader.out"
        self.log_path = data_dir.parent / "leader.log"
        self.proc: subprocess.Popen | None = None
        self.url = f"http://127.0.0.1:{port}"

    def start(self) -> LeaderProcess:
        with open(self.out_path, "ab") as out, open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "swarm", "leader", "--host", "127.0.0.1", "--port", str(self.port),
                 "--data-dir", str(self.data_dir)], stdout=out, stderr=log, env=self.env, start_new_session=True)
        return self

    def join_token(self, uses: int = 1) -> str:
        """A join token for ``uses`` fellows (the one it printed admits one)."""
        from swarm.demo import mint_join_token

        return mint_join_token(self.data_dir, uses=uses)

    def printed(self, prefix: str) -> str | None:
        for line in self.out_path.read_text().splitlines() if self.out_path.exists() else []:
            if line.startswith(prefix):
                return line[len(prefix):].strip()
        return None

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> None:
        _stop(self.proc)

    def log(self, lines: int = 60) -> str:
        return _tail(self.log_path, lines)


def _stop(proc: subprocess.Popen | None, thaw: bool = False) -> None:
    """Terminate ``proc`` (SIGCONT first if it may be frozen), killing it if it has not gone in 10 s. A fellow takes
    SIGTERM as "hand my stages over, then leave" (swarm.fellow.leave); a second SIGTERM a moment later has it go at
    once, so a fleet's teardown does not wait for drains."""
    stop_all([proc], thaw)


def stop_all(procs: list[subprocess.Popen | None], thaw: bool = False) -> None:
    """``_stop`` for several processes at once: each is told to go, then each given the same second: a fleet of
    three fellows holding stages went in ~1 s instead of 1 s each."""
    alive = [p for p in procs if p is not None and p.poll() is None]
    for proc in alive:
        if thaw:
            proc.send_signal(signal.SIGCONT)
        proc.terminate()
    for wait_s, then in ((1.0, "terminate"), (10.0, "kill")):
        deadline = time.monotonic() + wait_s
        for proc in alive:
            try:
                proc.wait(max(deadline - time.monotonic(), 0.01))
            except subprocess.TimeoutExpired:
                pass
        alive = [p for p in alive if p.poll() is None]
        for proc in alive:
            getattr(proc, then)()
    for proc in alive:
        proc.wait()


def _tail(path: Path, lines: int) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Pool:
    """A `swarm leader` process with ``count`` `swarm join` fellows online, serving nothing yet; ``model_dir`` is in
    its catalogue as ``name``. ``http`` is a client signed in with the admin API token. ``stop()`` ends them all.
    ``leader_env`` and ``fellow_env`` add to their environments (a None value takes a variable out: the benches run
    fellows with torch's own thread count, ``{"OMP_NUM_THREADS": None}``)."""

    def __init__(self, tmp: Path, model_dir: Path, count: int = 2, *, leader_env: dict | None = None,
                 fellow_env: dict | None = None, fellow_cpus: list[str] | None = None):
        self.name = install_model(tmp / "leader", model_dir)
        self.fellow_cpus = fellow_cpus  # fellow i runs on fellow_cpus[i] only (taskset): a PC of its own, emulated
        self.leader = LeaderProcess(tmp / "leader", free_port(), env=leader_env).start()
        self.fellows: list[FellowProcess] = []
        self.http = None
        try:
            self._start(tmp, count, fellow_env)
        except BaseException:
            self.stop()
            raise

    def _start(self, tmp: Path, count: int, fellow_env: dict | None) -> None:
        self.token = wait_for(lambda: self.leader.printed("Admin API token:"), 60, message=self.leader.log)
        join = self.leader.join_token(uses=count)
        cpus = self.fellow_cpus or [None] * count
        self.fellows = [FellowProcess(self.leader.url, join, tmp / f"fellow-{i}", f"fellow-{i}", env=fellow_env,
                                      cpus=cpus[i]).start() for i in range(count)]
        self.http = httpx.Client(base_url=self.leader.url, headers={"authorization": f"Bearer {self.token}"},
                                 timeout=120)
        wait_for(lambda: len(self.online()) == count, 120, message=lambda: logs(self.fellows))

    def online(self) -> list[dict]:
        return [f for f in self.http.get("/api/v1/fellows").json()["fellows"] if f["state"] == "online"]

    def load(self, num_stages: int = 2, timeout: float = 180, quantization: str = "none") -> None:
        """Load at ``quantization``: none by default, what the exactness tests compare with (a GGUF's own: gguf)."""
        body = {"num_stages": num_stages, "quantization": quantization}
        assert self.http.post(f"/api/v1/models/{self.name}/load", json=body).status_code == 202
        wait_for(lambda: self.status() == "ready", timeout, interval=0.01, message=lambda: logs(self.fellows))

    def status(self) -> str | None:
        try:
            return self.http.get(f"/api/v1/models/{self.name}", timeout=5).json()["status"]
        except (httpx.HTTPError, ValueError):
            return None

    def logs(self) -> dict[str, Path]:
        return {"leader": self.leader.log_path, **{f.name: f.log_path for f in self.fellows}}

    def pids(self) -> dict[str, int]:
        return {"leader": self.leader.proc.pid, **{f.name: f.proc.pid for f in self.fellows}}

    def stop(self) -> None:
        stop_all([f.proc for f in self.fellows], thaw=True)
        self.leader.stop()


def fellows_for(swarm, tmp_path: Path, count: int, standby: set[int] = frozenset(),
                env: dict | None = None) -> list[FellowProcess]:
    """``count`` fellows started as processes joining ``swarm`` (tests/harness.py), fellow-0, fellow-1, ... (those
    numbered in ``standby`` as standbys)."""
    join = swarm.join_token(uses=count)
    return [FellowProcess(swarm.url, join, tmp_path / f"fellow-{i}", f"fellow-{i}", standby=i in standby,
                          env=env).start() for i in range(count)]


async def start_fleet(swarm, fellows: list[FellowProcess]) -> None:
    """Until every one of ``fellows`` is online at the leader."""
    await wait_until(lambda: len(swarm.leader.hub.online) == len(fellows), 120, message=lambda: logs(fellows))


@contextlib.asynccontextmanager
async def fellow_fleet(swarm, tmp_path: Path, count: int, standby: set[int] = frozenset(), env: dict | None = None):
    """``count`` fellow processes online at ``swarm``; their logs are printed if the test fails, and they are stopped
    when it ends."""
    fellows = fellows_for(swarm, tmp_path, count, standby, env)
    try:
        await start_fleet(swarm, fellows)
        yield fellows
    except BaseException:
        print(logs(fellows))
        raise
    finally:
        stop_all([f.proc for f in fellows], thaw=True)
