"""Per-token time of a 2-stage ring over direct TCP, the hole-punched tunnel and the relay, in the network lab.

    sudo .venv/bin/python bench/lab_transports.py [--delay-ms 20] [--model-dir DIR]

Builds the lab of tests/netlab.py (network namespaces, NAT routers, DELAY ms each way on every WAN link), runs a real
leader on its internet and `swarm join` fellows in home networks, and prints for the built-in model:
- the per-token time of each transport: (time of a 40-token reply - time of an 8-token reply) / 32, so that the
  prompt and the first token cancel out;
- how long a hop takes to move from the relay to the tunnel once the model is ready.
Aim (the mesh issue): the tunnel within 1 ms per hop of direct TCP; the relay about one extra leader round trip.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import netlab  # noqa: E402
from test_lab_ring import MODEL, Ring  # noqa: E402

PROMPT = "Write a long story about a lighthouse keeper."


def reply_time(ring: Ring, max_tokens: int) -> float:
    body = {"model": MODEL, "messages": [{"role": "user", "content": PROMPT}], "temperature": 0,
            "max_tokens": max_tokens}
    started = time.monotonic()
    status, data = ring.api("POST", "/v1/chat/completions", body)
    elapsed = time.monotonic() - started
    assert status == 200 and data["usage"]["completion_tokens"] == max_tokens, data
    return elapsed


def per_token_ms(ring: Ring, short: int = 8, long: int = 40, rounds: int = 3) -> float:
    reply_time(ring, 4)  # warm the path
    samples = [(reply_time(ring, long) - reply_time(ring, short)) / (long - short) for _ in range(rounds)]
    return min(samples) * 1000




def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--delay-ms", type=float, default=20.0)
    parser.add_argument("--model-dir", type=Path, help="an imported smollm2-135m-instruct (default: import one)")
    args = parser.parse_args()
    reason = netlab.available()
    if reason:
        sys.exit(f"the lab cannot run here: {reason}")
    work = Path(tempfile.mkdtemp(prefix="swarm-labbench-"))
    model_dir = args.model_dir
    if model_dir is None:
        from swarm.store.importer import import_model

        import_model(MODEL, work / "models")
        model_dir = work / "models" / MODEL
    # The lab's world (tests/netlab.py): the leader on the internet, two homes behind ordinary masquerade NATs.
    with netlab.world(public=(netlab.LEADER,), homes=("nat-a", "nat-b"), delay_ms=args.delay_ms) as lab:
        ring = Ring(lab, work / "ring", model_dir)
        try:
            ring.start_leader()
            print(f"lab: {args.delay_ms:g} ms each way on every WAN link ({lab.delay_backend}); "
                  f"leader on the lab's internet; model {MODEL}, float32, greedy")
            rows = []
            for label, hosts, direct_links in (("direct (one LAN)", ("a1", "a2"), False),
                                               ("relay (two NATs)", ("a1", "b1"), False),
                                               ("tunnel (two NATs)", ("a1", "b1"), True)):
                ring.reset()  # Direct links off, nothing loaded
                ring.use(hosts)
                ring.direct_links(direct_links)
                ring.load()
                ready = time.monotonic()
                moved = None
                if direct_links:
                    ring.wait_transports({"tunnel"}, timeout=60)
                    moved = time.monotonic() - ready
                rows.append((label, per_token_ms(ring), ring.transports(), moved))
            base = rows[0][1]
            for label, ms, seen, moved in rows:
                extra = f"+{ms - base:.1f} ms" if ms is not rows[0][1] else ""
                line = f"{label:22} {ms:7.1f} ms/token {extra:>11}   hops: {'/'.join(map(str, seen))}"
                if moved is not None:
                    line += f"   relay -> tunnel after {moved:.1f} s (1 s heartbeat resolution)"
                print(line)
        finally:
            ring.close()


if __name__ == "__main__":
    main()
