"""The lab mode of bench/plan_vs_measured.py (``--lab``): link-blind against link-aware placement in the network lab.

The leader and three `swarm join` fellows on the lab's internet (tests/netlab.py), one of them --far-ms each way
from the others. The fellows calibrate (SWARM_CALIBRATE=1) and probe each other's links (swarm.fellow.link_probe);
once the plan leaves the far fellow out, two placements take turns for --rounds rounds:

- link-blind: all three fellows (``num_stages`` 3, as a load placed them by memory alone), two of the ring's hops
  crossing the far link each token;
- link-aware: the leader's choice (no ``num_stages``): the far fellow left out.

Per round: the plan (after the load, the ring's own hops measured), a greedy reply of --tokens tokens (its
``swarm.timing`` decode tokens/s), and their ratio. Needs root.
"""

from __future__ import annotations

import argparse
import os
import statistics
from pathlib import Path

from builtin_swarm import COUNT  # first: puts tests/ on the import path
from drafting import machine
from harness import wait_for
from netlab import LEADER, available, lab
from test_lab_ring import MODEL, Ring

NEAR, FAR = ("f1", "f2"), "f3"
VARIANTS = (("link-blind (all 3 fellows)", {"num_stages": 3}, "?num_stages=3"),
            ("link-aware (leader's choice)", {}, ""))


def ready(ring: Ring) -> dict:
    def loaded():
        _, view = ring.api("GET", f"/api/v1/models/{MODEL}")
        assert view["status"] not in ("failed", "not_loaded"), view
        return view if view["status"] == "ready" else None

    return wait_for(loaded, 240, interval=0.5, message=lambda: str(ring.api("GET", f"/api/v1/models/{MODEL}")))


def one_variant(ring: Ring, label: str, body: dict, query: str, tokens: int,
                quantization: dict) -> tuple[float, float, str]:
    """Load as ``body`` asks, warm up, then one timed reply: (predicted tok/s, measured tok/s, the line told)."""
    status, answer = ring.api("POST", f"/api/v1/models/{MODEL}/load", {**body, **quantization})
    assert status == 202, answer
    view = ready(ring)
    chat = {"model": MODEL, "messages": COUNT, "temperature": 0}
    ring.api("POST", "/v1/chat/completions", {**chat, "max_tokens": 4})  # warm-up: the ring's hops report figures
    status, data = ring.api("POST", "/v1/chat/completions", {**chat, "max_tokens": tokens, "ignore_eos": True})
    assert status == 200, data
    measured = data["swarm"]["timing"]
    status, plan = ring.api("GET", f"/api/v1/models/{MODEL}/plan{query}")
    assert status == 200, plan
    stages = " -> ".join(s["fellow"] for s in view["stages"])
    line = (f"  {label:30} {stages:15} predicted {plan['tokens_per_s']:5.1f} tok/s "
            f"({plan['ms_per_token']:.0f} ms/token: compute {sum(s['decode_ms'] for s in plan['stages']):.0f}, "
            f"links {sum(k['ms_per_token'] for k in plan['links']):.0f}), measured {measured['tokens_per_s']:5.1f} "
            f"tok/s ({measured['ms_per_token']:.0f} ms/token), predicted/measured "
            f"{plan['tokens_per_s'] / measured['tokens_per_s']:.2f}")
    status, answer = ring.api("POST", f"/api/v1/models/{MODEL}/unload")
    assert status == 200, answer
    return plan["tokens_per_s"], measured["tokens_per_s"], line


def run(model_dir: Path, tmp: Path, args: argparse.Namespace) -> None:
    reason = available()
    if reason:
        raise SystemExit(f"the lab cannot run here: {reason}")
    os.environ.update(SWARM_CALIBRATE="1")  # the fellows inherit it: the planner needs their speed
    if args.threads:
        os.environ["SWARM_THREADS"] = str(args.threads)
    print(f"{machine()}; lab: fellows {', '.join(NEAR)} beside the leader, {FAR} {args.far_ms:g} ms each way from "
          "every other host", flush=True)
    quantization = {"quantization": args.quantization} if args.quantization else {}
    print(f"stages at {args.quantization or 'full precision'}, SWARM_THREADS={args.threads or 'every core'}",
          flush=True)
    with lab(delay_ms=0) as the_lab:
        the_lab.add_public_host(LEADER)
        for host in NEAR:
            the_lab.add_public_host(host)
        the_lab.add_public_host(FAR, delay_ms=args.far_ms)
        ring = Ring(the_lab, tmp / "ring", model_dir)
        try:
            ring.start_leader()
            ring.use((*NEAR, FAR))

            def planned():
                status, plan = ring.api("GET", f"/api/v1/models/{MODEL}/plan")
                return plan if status == 200 and plan.get("left_out") else None

            plan = wait_for(planned, 240, interval=1,
                            message=lambda: str(ring.api("GET", f"/api/v1/models/{MODEL}/plan")))
            print(f"plan before loading: {plan['text']}", flush=True)
            results: dict[str, list[tuple[float, float]]] = {label: [] for label, _, _ in VARIANTS}
            for round_ in range(args.rounds):
                print(f"round {round_ + 1}", flush=True)
                for label, body, query in VARIANTS:
                    predicted, measured, line = one_variant(ring, label, body, query, args.tokens, quantization)
                    results[label].append((predicted, measured))
                    print(line, flush=True)
            for label, figures in results.items():
                measured = statistics.median(m for _, m in figures)
                ratio = statistics.median(p / m for p, m in figures)
                print(f"{label}: measured {measured:.1f} tok/s (median), predicted/measured {ratio:.2f}", flush=True)
            blind, aware = (statistics.median(m for _, m in results[label]) for label, _, _ in VARIANTS)
            print(f"link-aware / link-blind decode speed: {aware / blind:.2f}x", flush=True)
        finally:
            ring.close()
