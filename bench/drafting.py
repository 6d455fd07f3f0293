"""Drafting ahead (SWARM_SERVE_SPECULATIVE): tokens/s of the built-in model over 2 stages in one process
(swarm.stage.local: the real protocol and stage models, no sockets), with and without drafting, on a reply that
repeats its input (a code edit) and on an ordinary chat. The variants take turns, round after round, so a shared
machine's swings fall on all of them alike; each greedy reply is checked to be the same with and without drafting.

    .venv/bin/python bench/drafting.py [--rounds 3] [--tokens 120] [--draft 4] [--stages 2] [--threads N]
"""

from __future__ import annotations

import argparse
import atexit
import os
import platform
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from swarm.leader.chat_format import encode_chat
from swarm.stage import LocalRing, StageModel, stage_specs
from swarm.store.importer import import_model
from swarm.store.manifest import load_manifest

CODE = '''def total_price(items, tax_rate):
    subtotal = 0
    for item in items:
        subtotal += item.price * item.quantity
    tax = subtotal * tax_rate
    return subtotal + tax


def cheapest(items):
    best = None
    for item in items:
        if best is None or item.price < best.price:
            best = item
    return best
'''

CHATS = {
    "code edit": f"Rewrite this code with the variable `item` renamed to `product`. Reply with the code only.\n\n{CODE}",
    "ordinary chat": "Tell me about the history of the bicycle, and why it became popular in cities.",
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=120)
    parser.add_argument("--draft", type=int, default=4)
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    root = Path(tempfile.mkdtemp(prefix="bench-drafting-"))
    atexit.register(shutil.rmtree, root, True)  # the imported model, ~300 MB
    import_model("smollm2-135m-instruct", root)
    model_dir = root / "smollm2-135m-instruct"
    specs = stage_specs(load_manifest(model_dir).num_layers, args.stages)
    stages = [StageModel.load_dir(model_dir, s) for s in specs]
    for stage in stages:
        stage.warm_up()
    ring = LocalRing(stages, prefill_chunk=256)
    prompts = {name: encode_chat(model_dir, [{"role": "user", "content": text}], None) for name, text in CHATS.items()}
    eos = load_manifest(model_dir).eos_token_ids
    print(f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads; built-in model float32 over {args.stages} stages in one process; "
          f"{args.tokens} tokens per reply, up to {args.draft} guessed per pass, {args.rounds} rounds taking turns",
          flush=True)
    speeds: dict[tuple[str, int], list[float]] = {}
    replies: dict[tuple[str, int], list[int]] = {}
    spec: dict[tuple[str, int], tuple] = {}
    n = 0
    for _ in range(args.rounds):
        for name, prompt in prompts.items():
            for draft in (0, args.draft):
                n += 1
                rid = f"r{n}"
                reply = ring.submit(rid, prompt, args.tokens, eos=eos, draft=draft)
                first = None  # the decode rate: from the first token (the prompt's pass, alike for both) to the end
                while ring.step():
                    if first is None and reply.tokens:
                        first = time.perf_counter()
                seconds = time.perf_counter() - first
                tokens = reply.tokens
                speeds.setdefault((name, draft), []).append((len(tokens) - 1) / seconds)
                replies.setdefault((name, draft), tokens)
                t = ring.times[rid][args.stages - 1]
                spec[(name, draft)] = (t.spec_passes, t.spec_tokens, t.spec_drafted, t.spec_accepted)
                print(f"  {name}, drafting {draft}: {len(tokens)} tokens, {seconds:.1f} s after the first", flush=True)
    print(f"{'reply':<15} {'drafting':<9} {'tok/s (median)':>15} {'runs':>24}  passes/tokens/drafted/accepted")
    for name in prompts:
        base = statistics.median(speeds[(name, 0)])
        for draft in (0, args.draft):
            s = speeds[(name, draft)]
            runs = " ".join(f"{v:.1f}" for v in s)
            gain = "" if draft == 0 else f"  {statistics.median(s) / base:.2f}x"
            counters = "" if draft == 0 else "  " + "/".join(map(str, spec[(name, draft)]))
            print(f"{name:<15} {('off' if not draft else f'on ({draft})'):<9} {statistics.median(s):>15.1f} "
                  f"{runs:>24}{gain}{counters}")
        same = replies[(name, 0)] == replies[(name, args.draft)]
        print(f"{'':<15} same reply with and without drafting: {same} ({len(replies[(name, 0)])} tokens)")


if __name__ == "__main__":
    main()
