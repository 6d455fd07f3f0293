"""Per-token time of a 2-stage ring over direct TCP, the relay and the hole-punched tunnel, in the network lab.

    sudo .venv/bin/python bench/lab_transports.py [--delay-ms 20] [--leader-delay-ms 0] [--depth 1] [--rounds 3]
                                                  [--replies 3] [--tokens 48] [--model-dir DIR]

Builds the lab of tests/netlab.py (network namespaces, NAT routers, DELAY ms each way on every WAN link), runs a real
leader on its internet and `swarm join` fellows in home networks, and measures the built-in model on three paths:
direct TCP between two fellows on one LAN, the relay (two homes, Direct links off: each hop goes through the leader)
and the tunnel (the same two fellows, Direct links on, measured only once both hops report the tunnel).

The rows take turns for ``--rounds`` rounds (each round loads the model afresh for each row), so that the swings of a
shared machine fall on every row alike. Each measured reply gives ``swarm.timing`` (swarm/leader/serving/timing.py): the
leader's steady time per token, each stage's compute per token and the links' time per token (stage 0's round trip
less the other stage's compute), split over the two hops. A reply counts only if both hops were on the row's path
before and after it (a hop that moved or fell back during a reply is reported, not averaged in). Also printed: the
wall-clock per-token time, (time of a long reply - time of a 8-token reply) / the difference in tokens, and for the
tunnel row how long the hops took to move from the relay to the tunnel once the model was ready.

``--leader-delay-ms 40`` puts the leader on a link of its own that far (each way) from the internet's core, so the
relay pays those legs and the tunnel does not; ``--depth`` makes the internet that many routers deep.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import netlab
from test_lab_ring import MODEL, Ring

PROMPT = "Write a long story about a lighthouse keeper."
SHORT = 8
# (label, hosts, Direct links on, the transport every hop must be on while the row is measured)
ROWS = (("direct (one LAN)", ("a1", "a2"), False, "direct"),
        ("relay (two NATs)", ("a1", "b1"), False, "relay"),
        ("tunnel (two NATs)", ("a1", "b1"), True, "tunnel"))


def chat(ring: Ring, content: str, max_tokens: int, **extra) -> tuple[float, dict]:
    """One greedy reply to ``content`` (``extra``: more fields of the request): its wall-clock time and the answer."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "temperature": 0,
            "max_tokens": max_tokens, **extra}
    started = time.monotonic()
    status, data = ring.api("POST", "/v1/chat/completions", body)
    elapsed = time.monotonic() - started
    assert status == 200, data
    return elapsed, data


def reply(ring: Ring, max_tokens: int) -> tuple[float, dict]:
    """One greedy reply of exactly ``max_tokens`` tokens: its wall-clock time and its ``swarm.timing``."""
    elapsed, data = chat(ring, PROMPT, max_tokens, ignore_eos=True)
    assert data["usage"]["completion_tokens"] == max_tokens, data
    return elapsed, data["swarm"]["timing"]


def model_dir(given: Path | None, work: Path) -> Path:
    """``given`` (an imported built-in model), or the built-in model imported under ``work``."""
    if given is not None:
        return given
    from swarm.store.importer import import_model

    import_model(MODEL, work / "models")
    return work / "models" / MODEL


def measure(ring: Ring, want: str, replies: int, tokens: int) -> dict:
    """``replies`` long replies (each after a short one) with every hop on ``want``; what each one's timing says."""
    out = {"ms_per_token": [], "link_ms": [], "hop_ms": [], "compute_ms": [], "wall_ms": [], "off_path": 0}
    reply(ring, 4)  # warm the path
    for _ in range(replies):
        before = ring.transports()
        short, _ = reply(ring, SHORT)
        long, timing = reply(ring, tokens)
        after = ring.transports()
        if set(before) != {want} or set(after) != {want}:
            out["off_path"] += 1  # a hop moved during the reply: not a measurement of this path
            continue
        out["wall_ms"].append((long - short) / (tokens - SHORT) * 1000)
        if timing.get("ms_per_token") is not None:
            out["ms_per_token"].append(timing["ms_per_token"])
        if timing.get("link_ms_per_token") is not None:
            out["link_ms"].append(timing["link_ms_per_token"])
            out["hop_ms"].append([link["ms_per_token"] for link in timing["links"]])
        if timing.get("stages"):
            out["compute_ms"].append(sum(s["compute_ms_per_token"] or 0 for s in timing["stages"]))
    out["rtt_ms"] = [h.get("rtt_ms") for h in ring.hops()]
    return out


def _median(values: list[float]) -> str:
    return f"{statistics.median(values):.1f}" if values else "-"


def _range(values: list[float]) -> str:
    return f"{min(values):.0f}-{max(values):.0f}" if values else "-"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--delay-ms", type=float, default=20.0)
    parser.add_argument("--leader-delay-ms", type=float, default=0.0)
    parser.add_argument("--depth", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3, help="rounds in which the rows take turns")
    parser.add_argument("--replies", type=int, default=3, help="measured replies per row and round")
    parser.add_argument("--tokens", type=int, default=48, help="tokens of each measured reply")
    parser.add_argument("--model-dir", type=Path, help="an imported smollm2-135m-instruct (default: import one)")
    args = parser.parse_args()
    reason = netlab.available()
    if reason:
        sys.exit(f"the lab cannot run here: {reason}")
    work = Path(tempfile.mkdtemp(prefix="swarm-labbench-"))
    model = model_dir(args.model_dir, work)
    # The lab's world (tests/netlab.py): the leader on the internet, two homes behind ordinary masquerade NATs.
    with netlab.world(public=(netlab.LEADER,), homes=("nat-a", "nat-b"), delay_ms=args.delay_ms, depth=args.depth,
                      far=("nat-b",), public_delay_ms=args.leader_delay_ms) as lab:
        ring = Ring(lab, work / "ring", model)
        try:
            ring.start_leader()
            where = (f"{args.leader_delay_ms:g} ms each way from the core" if args.leader_delay_ms
                     else "on the core")
            print(f"lab: {args.delay_ms:g} ms each way on every WAN link ({lab.delay_backend}), internet "
                  f"{args.depth} router(s) deep; leader {where}; model {MODEL}, float32, greedy, "
                  f"{args.tokens}-token replies; logs in {work / 'ring'}", flush=True)
            results = {label: {"ms_per_token": [], "link_ms": [], "hop_ms": [], "compute_ms": [], "wall_ms": [],
                               "off_path": 0, "moved": [], "rtt_ms": []} for label, *_ in ROWS}
            for rnd in range(args.rounds):
                for label, hosts, direct_links, want in ROWS:
                    ring.reset()  # Direct links off, nothing loaded
                    ring.use(hosts)
                    ring.direct_links(direct_links)
                    ring.load()
                    ready = time.monotonic()
                    if direct_links:
                        ring.wait_transports({"tunnel"}, timeout=60)
                        results[label]["moved"].append(time.monotonic() - ready)
                    else:
                        ring.wait_transports({want}, timeout=30)
                    got = measure(ring, want, args.replies, args.tokens)
                    row = results[label]
                    for key in ("ms_per_token", "link_ms", "hop_ms", "compute_ms", "wall_ms"):
                        row[key] += got[key]
                    row["off_path"] += got["off_path"]
                    row["rtt_ms"].append(got["rtt_ms"])
                    print(f"  round {rnd + 1} {label:18} ms/token {_median(got['ms_per_token']):>6}  links "
                          f"{_median(got['link_ms']):>6}  compute {_median(got['compute_ms']):>5}  wall "
                          f"{_median(got['wall_ms']):>6}  hop rtt {got['rtt_ms']}"
                          + (f"  ({got['off_path']} replies off the path)" if got["off_path"] else ""), flush=True)
            print("\n| path | ms/token (leader's steady rate), median / range | links ms/token (hop 0->1 + "
                  "1->0) | stages' compute ms/token | wall-clock ms/token | replies |")
            print("|---|---|---|---|---|---|")
            for label, *_ in ROWS:
                row = results[label]
                hops = ([statistics.median(h[i] for h in row["hop_ms"]) for i in range(len(row["hop_ms"][0]))]
                        if row["hop_ms"] else [])
                split = " + ".join(f"{h:.1f}" for h in hops)
                print(f"| {label} | {_median(row['ms_per_token'])} / {_range(row['ms_per_token'])} | "
                      f"{_median(row['link_ms'])} ({split}) | {_median(row['compute_ms'])} | "
                      f"{_median(row['wall_ms'])} | {len(row['ms_per_token'])}"
                      + (f" ({row['off_path']} off the path)" if row["off_path"] else "") + " |")
            moved = results[ROWS[2][0]]["moved"]
            if moved:
                print("relay -> tunnel after " + ", ".join(f"{m:.1f}" for m in moved)
                      + " s from ready (1 s heartbeat resolution)")
        finally:
            ring.close()
            for copy in (work / "models", work / "ring" / "fellows"):  # the model and the fellows' caches of it
                shutil.rmtree(copy, ignore_errors=True)


if __name__ == "__main__":
    main()
