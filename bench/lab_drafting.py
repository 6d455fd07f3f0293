"""Drafting ahead over slow links: tokens/s of a 2-stage ring in the network lab with and without drafting.

    sudo .venv/bin/python bench/lab_drafting.py [--delay-ms 20] [--rounds 2] [--tokens 120] [--draft 4]
                                                [--model-dir DIR]

The lab of tests/netlab.py as bench/lab_transports.py builds it (the leader on the internet, DELAY ms each way on
every WAN link), the built-in model over 2 stages on two `swarm join` fellows in two homes behind NATs, with Direct
links on (the hops move from the relay to a hole-punched tunnel between the homes before anything is measured),
greedy. Drafting ahead is the leader's setting at load time (SWARM_SERVE_SPECULATIVE), so each variant restarts the
leader with its setting and loads the model afresh; the variants (off, and ``--draft`` tokens guessed per pass) take
turns for ``--rounds`` rounds, each round asking bench/drafting.py's chats: a page edit whose reply repeats its
input, a code edit the model half rewrites, and an ordinary chat. Printed per reply: the decode rate (``swarm.timing``'s
tokens_per_s: the steady rate after the first token), the ring's passes per token (spec_passes / spec_tokens), the
guesses made and kept, the speed-up of drafting, and whether each reply was token for token the same with and without
it. Each reply's line also gives the stages' compute and the links' time per token (``swarm.timing``'s
compute_ms_per_token and link_ms_per_token).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

# lab_transports puts tests/ on the path (netlab, test_lab_ring)
from drafting import CHATS, machine
from lab_transports import chat, model_dir, netlab
from test_lab_ring import MODEL, Ring

HOSTS = ("a1", "b1")  # two homes, each behind an ordinary masquerade NAT


def restart_leader(ring: Ring, speculative: int) -> None:
    """Stop the fellows and the leader; start the leader with SWARM_SERVE_SPECULATIVE=``speculative`` (read at its
    start, applied at each load) and the two fellows again, Direct links on, the model loaded, both hops on the
    tunnel."""
    if ring.leader is not None:
        ring.reset()
        for host in list(ring.fellows):
            ring.lab.stop(ring.fellows.pop(host))
        ring.lab.stop(ring.leader)
        ring.proxy.close()
        ring.leader_up = False
    os.environ["SWARM_SERVE_SPECULATIVE"] = str(speculative)  # the lab runs the leader with this process's env
    ring.start_leader()
    ring.use(HOSTS)
    ring.direct_links(True)
    ring.load()
    ring.wait_transports({"tunnel"}, timeout=90)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--delay-ms", type=float, default=20.0, help="each way on every WAN link")
    parser.add_argument("--rounds", type=int, default=2, help="rounds in which the variants take turns")
    parser.add_argument("--tokens", type=int, default=120, help="at most this many tokens per reply")
    parser.add_argument("--draft", type=int, default=4, help="SWARM_SERVE_SPECULATIVE of the drafting variant")
    parser.add_argument("--model-dir", type=Path, help="an imported smollm2-135m-instruct (default: import one)")
    args = parser.parse_args()
    reason = netlab.available()
    if reason:
        sys.exit(f"the lab cannot run here: {reason}")
    work = Path(tempfile.mkdtemp(prefix="swarm-labdrafting-"))
    variants = (0, args.draft)
    speeds: dict[tuple[str, int], list[float]] = {}
    counters: dict[tuple[str, int], list[tuple[int, int, int, int]]] = {}
    replies: dict[tuple[str, int], list[list[int]]] = {}
    try:
        model = model_dir(args.model_dir, work)
        with netlab.world(public=(netlab.LEADER,), homes=("nat-a", "nat-b"), delay_ms=args.delay_ms,
                          far=("nat-b",)) as lab:
            ring = Ring(lab, work / "ring", model)
            try:
                print(f"{machine()}; lab: {args.delay_ms:g} ms each way on every WAN link, fellows {HOSTS[0]} and "
                      f"{HOSTS[1]} in two homes over the tunnel; model {MODEL} float32 over 2 stages, greedy, up to "
                      f"{args.tokens} tokens per reply; drafting off and SWARM_SERVE_SPECULATIVE={args.draft} taking "
                      f"turns over {args.rounds} rounds", flush=True)
                for rnd in range(args.rounds):
                    for draft in variants:
                        restart_leader(ring, draft)
                        chat(ring, "Hello", 4)  # warm the path
                        for name, text in CHATS.items():
                            _, data = chat(ring, text, args.tokens, return_token_ids=True)
                            timing = data["swarm"]["timing"]
                            key = (name, draft)
                            speeds.setdefault(key, []).append(timing["tokens_per_s"])
                            counters.setdefault(key, []).append(tuple(timing[k] for k in (
                                "spec_passes", "spec_tokens", "spec_drafted", "spec_accepted")))
                            replies.setdefault(key, []).append(data["choices"][0]["token_ids"])
                            print(f"  round {rnd + 1}, {name}, drafting {draft or 'off'}: {timing['tokens']} tokens, "
                                  f"{timing['tokens_per_s']:.1f} tok/s, passes/tokens/guessed/kept "
                                  f"{'/'.join(map(str, counters[key][-1]))}, per token: stages' compute "
                                  f"{sum(s['compute_ms_per_token'] or 0 for s in timing['stages']):.0f} ms, links "
                                  f"{timing['link_ms_per_token'] or 0:.0f} ms; hops {ring.transports()}", flush=True)
            finally:
                ring.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)  # the model copy, the fellows' caches, the logs
    report(speeds, counters, replies, variants)


def report(speeds: dict, counters: dict, replies: dict, variants: tuple[int, int]) -> None:
    off, on = variants
    print("\n| reply | drafting | decode tok/s (median; runs) | passes per token | guessed / kept "
          "| speed-up of the medians (per round) |")
    print("|---|---|---|---|---|---|")
    for name in CHATS:
        base = statistics.median(speeds[(name, off)])
        for draft in variants:
            runs = speeds[(name, draft)]
            passes, tokens, guessed, kept = (sum(c[i] for c in counters[(name, draft)]) for i in range(4))
            per_token = f"{passes / tokens:.2f}" if tokens else "1 (no drafting)"
            rounds = " ".join(f"{v / b:.2f}" for v, b in zip(runs, speeds[(name, off)]))  # the same round's pair
            gain = f"{statistics.median(runs) / base:.2f}x (per round {rounds})" if draft else ""
            print(f"| {name} | {draft or 'off'} | {statistics.median(runs):.1f}; "
                  f"{' '.join(f'{v:.1f}' for v in runs)} | {per_token} | {guessed} / {kept} | {gain} |")
    for name in CHATS:
        every = replies[(name, off)] + replies[(name, on)]
        same = all(r == every[0] for r in every)
        print(f"{name}: the same reply with and without drafting in every round: {same} ({len(every[0])} tokens)")


if __name__ == "__main__":
    main()
