"""Hole punching between two lab hosts with the fellow's own code, without a model or a leader process.

Each end runs this file as a script inside its namespace (``python tests/lab_punch.py agent ...``): per attempt it
opens a UDP socket, plans its punch exactly as a fellow does (``swarm.mesh.punch_plan.plan_punch``: rendezvous
with the lab's leader host, path trace, what earlier failures taught it), and punches (``swarm.mesh.hole_punch``).
The driving process plays the leader's coordinator over the agents' stdin/stdout (JSON lines): it swaps the
candidates, hands both the same secret and tells both to start at the same moment. A rendezvous server
(``serve_rendezvous``, any token accepted) runs on the leader's host.

    with netlab.world(homes=["nat-a", "nat-b"]) as lab, Punchers(lab, "a1", "b1") as p:
        outcome = p.attempt()        # {"ok": bool, "seconds": time from start to both locked, "messages": [...]}

Used by tests/test_lab_punch.py and bench/lab_punch_grid.py.
"""

from __future__ import annotations

import json
import secrets
import selectors
import subprocess
import sys
import time
from pathlib import Path

import netlab

RENDEZVOUS_PORT = 3479
START_IN_S = 0.3  # pipes carry the start message in well under a millisecond to both ends

_SERVER = r"""
import sys, trio
from swarm.mesh.rendezvous import serve_rendezvous
async def main():
    async with trio.open_nursery() as n:
        await n.start(serve_rendezvous, "0.0.0.0", int(sys.argv[1]), lambda who: True)
        print("ready", flush=True)
trio.run(main)
"""


class Punchers:
    """The rendezvous server on the lab's leader and one punching agent on each of two hosts."""

    def __init__(self, lab: netlab.Lab, host_a: str, host_b: str, *, fixed_ttl: int | None = None,
                 leader: str = netlab.LEADER, timeout: float | None = None):
        self.lab = lab
        self.logs = {name: lab.workdir / f"punch-{name}.log" for name in ("rendezvous", host_a, host_b)}
        self._files = [open(path, "ab") for path in self.logs.values()]  # closed by close()
        self.server = lab.run(leader, [sys.executable, "-c", _SERVER, str(RENDEZVOUS_PORT)], stdin=subprocess.DEVNULL,
                              stdout=subprocess.PIPE, stderr=self._files[0], text=True)
        _expect_ready(self.server, "the rendezvous server", self.logs["rendezvous"])
        args = [lab.address(leader), str(RENDEZVOUS_PORT), str(fixed_ttl or 0), str(timeout or 0)]
        self.agents = {}
        for i, (role, host) in enumerate((("a", host_a), ("b", host_b))):
            proc = lab.run(host, [sys.executable, str(Path(__file__).resolve()), "agent", role, *args],
                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._files[1 + i], text=True)
            self.agents[role] = proc
            self.hosts = (host_a, host_b)
            _expect_ready(proc, f"the punch agent on {host}", self.logs[host])

    def _say(self, role: str, message: dict) -> None:
        proc = self.agents[role]
        proc.stdin.write(json.dumps(message) + "\n")
        proc.stdin.flush()

    def _hear(self, role: str, timeout: float) -> dict:
        proc = self.agents[role]
        with selectors.DefaultSelector() as sel:
            sel.register(proc.stdout, selectors.EVENT_READ)
            if not sel.select(timeout):
                raise TimeoutError(f"agent {role}: no answer within {timeout} s")
        line = proc.stdout.readline()
        if not line:
            host = self.hosts[0 if role == "a" else 1]
            raise RuntimeError(f"agent {role} exited: {self.logs[host].read_text(errors='replace')[-2000:]}")
        return json.loads(line)

    def reset(self) -> None:
        """Both ends forget what earlier attempts taught them (the next attempt is a first one again)."""
        for role in "ab":
            self._say(role, {"t": "reset"})
        for role in "ab":
            self._hear(role, 30)

    def attempt(self, concurrent: int = 1, b_late_s: float = 0.0) -> list[dict]:
        """``concurrent`` punches at once (fresh sockets each; what each end learned so far carries over). Returns
        one outcome per punch: ok, seconds (the common start to both locked), total (asking both ends to prepare to
        both locked: rendezvous, trace, START_IN_S and the punch), low_ttl of each end and how, messages.

        ``b_late_s`` starts the second end that much later, as two PCs whose start messages crossed the internet in
        different times do (the first end's opening probes then reach the far NAT before its own mapping exists)."""
        started = time.monotonic()
        for role in "ab":
            self._say(role, {"t": "prepare", "n": concurrent})
        plans = {role: self._hear(role, 30)["plans"] for role in "ab"}
        secret = [secrets.token_hex(32) for _ in range(concurrent)]
        for role, other in (("a", "b"), ("b", "a")):
            self._say(role, {"t": "start", "start_in_s": START_IN_S + (b_late_s if role == "b" else 0.0),
                             "secret": secret,
                             "peer_candidates": [p["candidates"] for p in plans[other]]})
        results = {role: self._hear(role, 60)["results"] for role in "ab"}
        total = time.monotonic() - started
        out = []
        for i in range(concurrent):
            a, b = results["a"][i], results["b"][i]
            out.append({"ok": a["ok"] and b["ok"], "seconds": max(a.get("seconds", 0), b.get("seconds", 0)),
                        "total": total,
                        "low_ttl": (plans["a"][i]["low_ttl"], plans["b"][i]["low_ttl"]),
                        "how": (plans["a"][i]["note"], plans["b"][i]["note"]),
                        "messages": [r["message"] for r in (a, b) if not r["ok"]]})
        return out

    def close(self) -> None:
        for proc in [*self.agents.values(), self.server]:
            self.lab.stop(proc, timeout=3)
            for pipe in (proc.stdin, proc.stdout):
                if pipe is not None:
                    pipe.close()
        for f in self._files:
            f.close()

    def __enter__(self) -> Punchers:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _expect_ready(proc: subprocess.Popen, what: str, log: Path) -> None:
    line = proc.stdout.readline()
    if line.strip() != "ready":
        proc.kill()
        raise netlab.NetlabError(f"{what} did not start: {line}{log.read_text(errors='replace')[-2000:]}")


def _agent(role: str, leader: str, port: str, fixed_ttl: str, timeout: str) -> None:
    import logging

    import trio

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    from swarm.mesh.punch_plan import Learned

    learned = Learned()
    server = (leader, int(port))

    async def main():
        lines = iter(sys.stdin)
        print("ready", flush=True)
        while True:
            line = await trio.to_thread.run_sync(next, lines, None)
            if line is None:
                return
            if json.loads(line)["t"] == "reset":  # a new trial: forget what earlier attempts taught
                learned.failures = 0
                print(json.dumps({"reset": True}), flush=True)
                continue
            await _attempt(role, server, int(fixed_ttl), float(timeout), learned, json.loads(line)["n"], lines)

    trio.run(main)


async def _attempt(role: str, server, fixed_ttl: int, timeout: float, learned, n: int, lines) -> None:
    """One attempt of ``n`` punches at once: plan each (printed), wait for the start line, punch, print results."""
    import logging
    import socket

    import trio

    from swarm.mesh import hole_punch
    from swarm.mesh.punch_plan import Plan, next_attempt, plan_punch

    log = logging.getLogger("lab_punch")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:  # as swarm.fellow.net.outbound_ip
        probe.connect((server[0], 9))
        lan_ip = probe.getsockname()[0]
    socks = []
    for _ in range(n):
        sock = trio.socket.socket(trio.socket.AF_INET, trio.socket.SOCK_DGRAM)
        await sock.bind(("0.0.0.0", 0))
        socks.append(sock)
    plans: list[Plan] = [None] * n
    results: list[dict] = [None] * n

    async def plan_one(i):
        plans[i] = await plan_punch(socks[i], server, b"lab", lan_ip, learned)
        if fixed_ttl:  # the old behaviour, for comparison: one TTL whatever the path
            plans[i] = Plan(plans[i].candidates, plans[i].reflexive, fixed_ttl, hole_punch.LOW_TTL_ROUNDS, "fixed")

    async with trio.open_nursery() as nursery:
        for i in range(n):
            nursery.start_soon(plan_one, i)
    print(json.dumps({"plans": [{"candidates": p.candidates, "low_ttl": p.low_ttl, "note": p.note} for p in plans]}),
          flush=True)
    start = json.loads(await trio.to_thread.run_sync(next, lines))
    start_at = trio.current_time() + start["start_in_s"]

    async def punch_one(i):
        try:
            peer = await hole_punch.punch(
                socks[i], [tuple(c) for c in start["peer_candidates"][i]], bytes.fromhex(start["secret"][i]), role,
                start_at, timeout or hole_punch.DEFAULT_TIMEOUT_S, plans[i].low_ttl,
                low_ttl_rounds=plans[i].low_ttl_rounds, ttl_note=plans[i].note)
            results[i] = {"ok": True, "peer": list(peer), "seconds": trio.current_time() - start_at}
        except hole_punch.PunchFailed as exc:
            results[i] = {"ok": False, "message": str(exc)}
        log.info("punch %d (IP TTL %d, %s): %s", i, plans[i].low_ttl, plans[i].note, results[i])

    async with trio.open_nursery() as nursery:
        for i in range(n):
            nursery.start_soon(punch_one, i)
    if all(r["ok"] for r in results):
        learned.failures = 0
    else:
        suffix = next_attempt(learned)
        for r in results:
            if not r["ok"]:
                r["message"] += suffix
    for sock in socks:
        sock.close()
    print(json.dumps({"results": results}), flush=True)


if __name__ == "__main__":
    if sys.argv[1:2] == ["agent"]:
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
        _agent(*sys.argv[2:7])
    else:
        print(__doc__)
        raise SystemExit(2)
