"""Per-token time of a 2-stage ring over direct TCP, the hole-punched tunnel and the relay, in the network lab.

    sudo .venv/bin/python bench/lab_transports.py [--delay-ms 20] [--leader-delay-ms 0] [--depth 1] [--repeat 1]
                                                  [--model-dir DIR]

Builds the lab of tests/netlab.py (network namespaces, NAT routers, DELAY ms each way on every WAN link), runs a real
leader on its internet and `swarm join` fellows in home networks, and prints for the built-in model:
- the per-token time of each transport: (time of a 40-token reply - time of an 8-token reply) / 32, so that the
  prompt and the first token cancel out;
- how long a hop takes to move from the relay to the tunnel once the model is ready (``--repeat`` loads).
``--leader-delay-ms 40`` puts the leader on a link of its own that far (each way) from the internet's core, so the
relay pays those legs and the tunnel does not; ``--depth`` makes the internet that many routers deep.
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
    parser.add_argument("--leader-delay-ms", type=float, default=0.0)
    parser.add_argument("--depth", type=int, default=1)
    parser.add_argument("--repeat", type=int, default=1, help="loads with Direct links on (ready -> tunnel times)")
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
    with netlab.world(public=(netlab.LEADER,), homes=("nat-a", "nat-b"), delay_ms=args.delay_ms, depth=args.depth,
                      far=("nat-b",), public_delay_ms=args.leader_delay_ms) as lab:
        ring = Ring(lab, work / "ring", model_dir)
        try:
            ring.start_leader()
            where = (f"{args.leader_delay_ms:g} ms each way from the core" if args.leader_delay_ms
                     else "on the core")
            print(f"lab: {args.delay_ms:g} ms each way on every WAN link ({lab.delay_backend}), internet "
                  f"{args.depth} router(s) deep; leader {where}; model {MODEL}, float32, greedy")
            rows = []
            for label, hosts, direct_links in (("direct (one LAN)", ("a1", "a2"), False),
                                               ("relay (two NATs)", ("a1", "b1"), False),
                                               ("tunnel (two NATs)", ("a1", "b1"), True)):
                ring.reset()  # Direct links off, nothing loaded
                ring.use(hosts)
                ring.direct_links(direct_links)
                moved = []
                for i in range(args.repeat if direct_links else 1):
                    if i:
                        ring.unload()
                    ring.load()
                    ready = time.monotonic()
                    if direct_links:
                        ring.wait_transports({"tunnel"}, timeout=60)
                        moved.append(time.monotonic() - ready)
                rows.append((label, per_token_ms(ring), ring.transports(), moved or None))
            base = rows[0][1]
            for label, ms, seen, moved in rows:
                extra = f"+{ms - base:.1f} ms" if ms is not rows[0][1] else ""
                line = f"{label:22} {ms:7.1f} ms/token {extra:>11}   hops: {'/'.join(map(str, seen))}"
                if moved is not None:
                    line += ("   relay -> tunnel after " + ", ".join(f"{m:.1f}" for m in moved)
                             + " s (1 s heartbeat resolution)")
                print(line)
        finally:
            ring.close()


if __name__ == "__main__":
    main()
