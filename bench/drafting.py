"""Drafting ahead (SWARM_SERVE_SPECULATIVE): tokens/s of the built-in model over 2 stages in one process
(swarm.stage.local: the real protocol and stage models, no sockets), with and without drafting, on a reply that
repeats its input (a page edit), on a code edit that the model half rewrites and on an ordinary chat. The variants take
turns, round after round, so a shared machine's swings fall on all of them alike; each greedy reply is checked to be the
same with and without drafting.

With --draft-models, prompt lookup plus a draft model beside the last stage (SWARM_SERVE_DRAFT_MODEL) as well:
``self`` is the built-in model as its own draft model (every guess right, but it costs the whole model per guessed
token: the bound of what guessing saves in passes), ``tiny`` a random 2-layer model with its tokenizer (nearly every
guess wrong: what a useless draft model costs). No smaller model of SmolLM2's tokenizer ships here.

    .venv/bin/python bench/drafting.py [--rounds 3] [--tokens 120] [--draft 4] [--stages 2] [--threads N]
                                       [--quantization int4-fast] [--draft-models self,tiny]
"""

from __future__ import annotations

import argparse
import atexit
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # tiny_llama

from swarm.leader.chat.chat_format import encode_chat
from swarm.stage import LocalRing, StageModel, StageSpec, stage_specs
from swarm.stage.draft_model import DraftModel
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

PAGE = """<html>
  <head>
    <title>Shop</title>
    <link rel="stylesheet" href="style.css">
  </head>
  <body>
    <h1>Welcome to the shop</h1>
    <ul>
      <li>Apples</li>
      <li>Bread</li>
      <li>Milk</li>
    </ul>
  </body>
</html>
"""

# Asked to change a page's title, the built-in model copies the whole page back: a reply that repeats its input. Asked
# to rename a variable in the Python code it rewrites only one of its functions, half of it copied and half its own.
CHATS = {
    "page edit": f"Change the title to 'My shop' in this page and reply with the whole page:\n\n```html\n{PAGE}```",
    "code edit": ("Rewrite this code with the variable `item` renamed to `product`. Reply with the code only."
                  f"\n\n{CODE}"),
    "ordinary chat": "Tell me about the history of the bicycle, and why it became popular in cities.",
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=120)
    parser.add_argument("--draft", type=int, default=4)
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--quantization", default="none", help="the stages' quantization (none: float32)")
    parser.add_argument("--draft-models", default="", help="comma-separated: self, tiny (see above); none by default")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    root = Path(tempfile.mkdtemp(prefix="bench-drafting-"))
    atexit.register(shutil.rmtree, root, True)  # the imported model, ~300 MB
    import_model("smollm2-135m-instruct", root)
    model_dir = root / "smollm2-135m-instruct"
    specs = stage_specs(load_manifest(model_dir).num_layers, args.stages)
    stages = [StageModel.load_dir(model_dir, s, quantization=args.quantization) for s in specs]
    for stage in stages:
        stage.warm_up()
    ring = LocalRing(stages, prefill_chunk=256)
    drafters = {name: draft_model(name, model_dir, root) for name in filter(None, args.draft_models.split(","))}
    variants = [(0, None), (args.draft, None)] + [(args.draft, name) for name in drafters]
    prompts = {name: encode_chat(model_dir, [{"role": "user", "content": text}], None) for name, text in CHATS.items()}
    eos = load_manifest(model_dir).eos_token_ids
    kind = "float32" if args.quantization == "none" else args.quantization
    print(f"{machine()}; built-in model {kind} over {args.stages} stages in one process; "
          f"{args.tokens} tokens per reply, up to {args.draft} guessed per pass, {args.rounds} rounds taking turns",
          flush=True)
    speeds: dict[tuple, list[float]] = {}
    replies: dict[tuple, list[int]] = {}
    spec: dict[tuple, tuple] = {}
    n = 0
    for _ in range(args.rounds):
        for name, prompt in prompts.items():
            for draft, drafter in variants:
                stages[-1].drafter = drafters.get(drafter)
                n += 1
                rid = f"r{n}"
                reply = ring.submit(rid, prompt, args.tokens, eos=eos, draft=draft)
                first = None  # the decode rate: from the first token (the prompt's pass, alike for both) to the end
                while ring.step():
                    if first is None and reply.tokens:
                        first = time.perf_counter()
                if reply.error:
                    raise SystemExit(f"{name}, {label(draft, drafter)}: {reply.error}")
                seconds = time.perf_counter() - first
                tokens = reply.tokens
                key = (name, draft, drafter)
                speeds.setdefault(key, []).append((len(tokens) - 1) / seconds)
                replies.setdefault(key, tokens)
                t = ring.times[rid][args.stages - 1]
                spec[key] = (t.spec_passes, t.spec_tokens, t.spec_drafted, t.spec_accepted)
                print(f"  {name}, {label(draft, drafter)}: {len(tokens)} tokens, {seconds:.1f} s after the first",
                      flush=True)
    stages[-1].drafter = None
    print(f"{'reply':<15} {'drafting':<20} {'tok/s (median)':>15} {'runs':>24}  passes/tokens/drafted/accepted")
    for name in prompts:
        base = statistics.median(speeds[(name, 0, None)])
        for draft, drafter in variants:
            s = speeds[(name, draft, drafter)]
            runs = " ".join(f"{v:.1f}" for v in s)
            gain = "" if draft == 0 else f"  {statistics.median(s) / base:.2f}x"
            counters = "" if draft == 0 else "  " + "/".join(map(str, spec[(name, draft, drafter)]))
            print(f"{name:<15} {label(draft, drafter):<20} {statistics.median(s):>15.1f} {runs:>24}{gain}{counters}")
        same = all(replies[(name, d, m)] == replies[(name, 0, None)] for d, m in variants)
        print(f"{'':<15} same reply with and without drafting: {same} ({len(replies[(name, 0, None)])} tokens)")


def machine() -> str:
    """The machine line: processor, cores, torch and its threads."""
    return (f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
            f"{torch.get_num_threads()} threads")


def label(draft: int, drafter: str | None) -> str:
    return "off" if not draft else f"on ({draft})" + (f" + {drafter}" if drafter else "")


def draft_model(name: str, model_dir: Path, root: Path) -> DraftModel:
    """The built-in model whole (``self``), or a random 2-layer Llama with its vocabulary and tokenizer (``tiny``)."""
    if name == "tiny":
        from tiny_llama import with_tokenizer_of

        model_dir = with_tokenizer_of(model_dir, root, "tiny-draft")
    elif name != "self":
        raise SystemExit(f"--draft-models takes self and tiny, not {name!r}")
    whole = StageModel.load_dir(model_dir, StageSpec(0, load_manifest(model_dir).num_layers, True, True))
    drafter = DraftModel(whole)
    drafter.warm_up()
    return drafter


if __name__ == "__main__":
    main()
