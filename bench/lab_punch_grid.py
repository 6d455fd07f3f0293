"""Hole punching across a grid of network shapes in the lab: how often the first attempt punches, how often one of
three does, and how long it takes. No model: each end runs the fellow's own punching code (tests/lab_punch.py).

    sudo .venv/bin/python bench/lab_punch_grid.py [--trials 20] [--fixed-ttl 3] [--quick]

Grid: the internet 1, 2 or 3 routers deep between the two homes; no added delay, or 10 ms each way on every link
(home WANs and the internet's own); NAT pairs: port-preserving x port-preserving, routers that answer strangers on
both ends, a carrier-grade NAT in front of a home x a router that answers strangers, fully random x
port-preserving, UDP blocked x port-preserving; and the leader far away (40 ms each way) from two homes 5 ms apart.
Each cell runs ``--trials`` trials of up to 3 attempts (what an end learned carries to its next attempt, as in a
fellow); pairs that cannot punch run their trials at once. ``--fixed-ttl 3`` replays the old fixed TTL instead of
the traced one. Prints a table (markdown) at the end.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import lab_punch
import netlab

HOMES = ("nat-a", "nat-b", "nat-p", "nat-q", "nat-c", "nat-r", "nat-u")
FAR = ("nat-b", "nat-q", "nat-r")  # the second home of each pair hangs off the far end of the internet
# (label, hosts, can a tunnel be punched)
PAIRS = (
    ("port-preserving x port-preserving", ("a1", "b1"), True),
    ("answer strangers x answer strangers", ("p1", "q1"), True),
    ("CGNAT+home x answers strangers", ("c1", "q1"), True),
    ("fully random x port-preserving", ("r1", "b1"), False),
    ("UDP blocked x port-preserving", ("u1", "b1"), False),
)
ATTEMPTS = 3


def run_cell(lab, hosts, possible: bool, trials: int, fixed_ttl: int | None) -> dict:
    first = within = 0
    totals, punches, ttls, failures = [], [], set(), []
    with lab_punch.Punchers(lab, *hosts, fixed_ttl=fixed_ttl) as p:
        if possible:
            for _ in range(trials):
                p.reset()
                for attempt in range(1, ATTEMPTS + 1):
                    out = p.attempt()[0]
                    ttls.add(out["low_ttl"])
                    if out["ok"]:
                        first += attempt == 1
                        within += 1
                        totals.append(out["total"])
                        punches.append(out["seconds"])
                        break
                    failures.append(out["messages"][0] if out["messages"] else "?")
        else:
            ok = [False] * trials
            for attempt in range(1, ATTEMPTS + 1):
                outs = p.attempt(concurrent=trials)
                for i, out in enumerate(outs):
                    ttls.add(out["low_ttl"])
                    if out["ok"] and not ok[i]:
                        ok[i] = True
                        first += attempt == 1
                    elif not out["ok"]:
                        failures.extend(out["messages"][:1])
            within = sum(ok)
    return {"first": first, "within": within, "trials": trials, "totals": totals, "punches": punches,
            "ttls": sorted(ttls), "failure": failures[0] if failures else ""}


def fmt_times(values: list[float]) -> str:
    if not values:
        return "-"
    return f"{statistics.median(values):.2f} / {max(values):.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--fixed-ttl", type=int, default=None, help="replay a fixed TTL instead of tracing it")
    parser.add_argument("--quick", action="store_true", help="only the no-delay cells")
    parser.add_argument("--pairs", default="", help="comma-separated pair hosts to run, e.g. p1-q1 (default: all)")
    args = parser.parse_args()
    reason = netlab.available()
    if reason:
        sys.exit(f"the lab cannot run here: {reason}")
    shapes = [(d, delay, 0.0) for delay in ((0.0,) if args.quick else (0.0, 10.0)) for d in (1, 2, 3)]
    if not args.quick:
        shapes.append((1, 2.5, 40.0))  # the leader 40 ms away, the homes 5 ms apart
    wanted = {tuple(x.split("-")) for x in args.pairs.split(",") if x}
    rows = []
    for depth, delay, leader_ms in shapes:
        started = time.monotonic()
        with netlab.world(public=(netlab.LEADER,), homes=HOMES, far=FAR, delay_ms=delay, depth=depth,
                          public_delay_ms=leader_ms) as lab:
            for label, hosts, possible in PAIRS:
                if wanted and hosts not in wanted:
                    continue
                if leader_ms and not possible:
                    continue
                cell = run_cell(lab, hosts, possible, args.trials, args.fixed_ttl)
                shape = f"{depth} router{'s' if depth > 1 else ''}, {delay:g} ms/link" + (
                    f", leader {leader_ms:g} ms away" if leader_ms else "")
                row = (shape, label, "yes" if possible else "no", f"{cell['first']}/{cell['trials']}",
                       f"{cell['within']}/{cell['trials']}", fmt_times(cell["totals"]), fmt_times(cell["punches"]),
                       " ".join(f"{a}/{b}" for a, b in cell["ttls"]))
                rows.append(row)
                print(" | ".join(row), flush=True)
                if cell["failure"] and possible:
                    print("   first failure:", cell["failure"], flush=True)
        print(f"   ({time.monotonic() - started:.0f} s for this shape)", flush=True)
    print()
    print("| internet between the homes | NAT pair | tunnel possible | first attempt | within 3 attempts | "
          "prepare to tunnel, median / max (s) | start to locked, median / max (s) | low TTL (a/b) |")
    print("|---|---|---|---|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
