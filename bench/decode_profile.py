"""Where one decode step's time goes in a stage of the built-in model: the layers' parts, the stage's own per-pass
work, the protocol and the wire.

    .venv/bin/python bench/decode_profile.py [--kinds none,int8,int4-fast] [--steps 48] [--rounds 3] [--threads N]
                                             [--torch-int4]

The model is split over 2 in-process stages (swarm.stage.StageModel, as a fellow loads them) for each quantization
kind. Every round times, for each kind in turn (the machine is shared: the kinds take turns so a swing in its load
falls on all alike):

- ``step``: one decode step of a request through each stage as the fellow's driver computes it (``run_batch``: the
  forward pass, the wire tensor off stage 0, sampling on the last stage), plain -- no instrumentation -- with the
  lean decode step where the stages took it (swarm.stage.lean_decode), and again through the library's layers;
- the same steps through the library's layers with every part of a decoder layer timed by wrappers (exclusive wall
  time of each part: the linear layers, the attention kernel, rotary, the KV cache's update, the norms, the MLP's
  activation and product, and what remains in the layer's and attention's own Python), the stage's masks and rotary
  tables, the head;
- the protocol's per-pass work (receive, next_batch, computed) and the wire (encoding and decoding a Hidden message
  of one row, and a Sampled message);
- ``ring``: tokens/s of one request over the 2 stages in one process (swarm.stage.LocalRing, no sockets).

The wrappers cost a little themselves (~1-2 us each): the instrumented total is printed beside the plain one.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from ring_speed import machine

PROMPT = "Write a long story about a lighthouse keeper and a storm."


class Clock:
    """Exclusive wall time per part, with nesting: a part's time does not include the parts called inside it."""

    def __init__(self):
        self.exclusive: dict[str, float] = collections.defaultdict(float)
        self.calls: dict[str, int] = collections.defaultdict(int)
        self.stack: list[list] = []
        self.on = False

    def wrap(self, name: str, fn):
        clock = self

        def timed(*args, **kwargs):
            if not clock.on:
                return fn(*args, **kwargs)
            frame = [time.perf_counter(), 0.0]
            clock.stack.append(frame)
            try:
                return fn(*args, **kwargs)
            finally:
                clock.stack.pop()
                elapsed = time.perf_counter() - frame[0]
                clock.exclusive[name] += elapsed - frame[1]
                clock.calls[name] += 1
                if clock.stack:
                    clock.stack[-1][1] += elapsed

        return timed

    def reset(self):
        self.exclusive.clear()
        self.calls.clear()


def instrument(clock: Clock) -> None:
    """Wrap the parts of the Llama decoder layer, the stage and the quantized linears (class-level: every stage)."""
    import torch
    from torch import nn
    from transformers import cache_utils
    from transformers.integrations import sdpa_attention
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    from transformers.models.llama import modeling_llama as ml

    from swarm.stage import execute
    from swarm.stage import slice as stage_slice
    from swarm.stage.quantize import Int4Linear, Int8Linear

    for cls, name in ((nn.Linear, "linear (float32)"), (Int8Linear, "linear (int8)"), (Int4Linear, "linear (int4)")):
        cls.forward = clock.wrap(name, cls.forward)
    ml.LlamaRMSNorm.forward = clock.wrap("rmsnorm", ml.LlamaRMSNorm.forward)
    ml.LlamaMLP.forward = clock.wrap("mlp: act, product", ml.LlamaMLP.forward)
    ml.LlamaAttention.forward = clock.wrap("attention: views, Python", ml.LlamaAttention.forward)
    ml.LlamaDecoderLayer.forward = clock.wrap("layer: residuals, Python", ml.LlamaDecoderLayer.forward)
    ml.apply_rotary_pos_emb = clock.wrap("rotary: apply", ml.apply_rotary_pos_emb)
    for layer_cls in (cache_utils.DynamicLayer, cache_utils.DynamicSlidingWindowLayer):
        layer_cls.update = clock.wrap("kv cache update", layer_cls.update)
    cache_utils.DynamicCache.update = clock.wrap("kv cache: Python", cache_utils.DynamicCache.update)
    sdpa = clock.wrap("attention kernel (sdpa)", sdpa_attention.sdpa_attention_forward)
    ALL_ATTENTION_FUNCTIONS["sdpa"] = sdpa
    for kind, fn in list(stage_slice._MASK_FUNCTIONS.items()):
        stage_slice._MASK_FUNCTIONS[kind] = clock.wrap("stage: masks", fn)
    model_cls = stage_slice.StageModel
    model_cls.position_embeddings = clock.wrap("stage: rotary tables", model_cls.position_embeddings)
    model_cls.forward = clock.wrap("stage: forward's own", model_cls.forward)
    torch.nn.Embedding.forward = clock.wrap("embedding", torch.nn.Embedding.forward)
    execute.run_batch = clock.wrap("stage: run_batch's own (ids, sampling, wire tensor)", execute.run_batch)


def load_stages(model_dir: Path, kind: str):
    from swarm.stage import StageModel, stage_specs

    stages = [StageModel.load_dir(model_dir, spec, quantization=kind) for spec in stage_specs(30, 2)]
    for stage in stages:
        stage.warm_up()
    return stages


def decode_steps(stages, prompt: list[int], steps: int, clock: Clock | None = None) -> list[float]:
    """Per-token seconds of each stage's run_batch over ``steps`` decode steps of one greedy request (protocol-made
    Work, so run_batch computes exactly what it computes on a fellow)."""
    from swarm import messages
    from swarm.stage import execute
    from swarm.stage.protocol import StageProtocol

    protocols = [StageProtocol(model="m", index=i, num_stages=len(stages), prefill_chunk=256)
                 for i in range(len(stages))]
    spent = [0.0] * len(stages)
    inbox = [messages.Generate("m", "r", list(prompt), steps + 1, [], messages.Sampling())]
    done = 0
    decoding = False
    while inbox and done <= steps:
        message = inbox.pop(0)
        i = 0 if isinstance(message, (messages.Generate, messages.Sampled)) else 1
        protocols[i].receive(message)
        batch = protocols[i].next_batch()
        began = time.perf_counter()
        output = execute.run_batch(stages[i], batch)
        if decoding:
            spent[i] += time.perf_counter() - began
        for action in protocols[i].computed(batch, output):
            if hasattr(action, "message"):
                inbox.append(action.message)
            if type(action).__name__ == "Stream":
                done += 1
                decoding = True
                if clock is not None:  # the parts of decode steps only, not the prompt's
                    clock.on = True
    if clock is not None:
        clock.on = False
    for stage in stages:
        stage.drop("r")
    return [s / steps for s in spent]


def protocol_and_wire(stages, prompt: list[int], steps: int) -> dict[str, float]:
    """Seconds per decode step of the protocol's own work on both stages and of the wire encoding, without compute
    (the outputs are made once and reused)."""
    import torch

    from swarm import messages, wire
    from swarm.stage.protocol import StageProtocol
    from swarm.stage.protocol_records import Output, Send

    hidden = wire.tensor_to_wire(torch.zeros((1, 1, stages[0].config.hidden_size)))
    protocols = [StageProtocol(model="m", index=i, num_stages=2, prefill_chunk=256) for i in range(2)]
    inbox = [messages.Generate("m", "r", list(prompt), steps + 2, [], messages.Sampling())]
    times = collections.defaultdict(float)
    token = 1
    while inbox:
        message = inbox.pop(0)
        i = 0 if isinstance(message, (messages.Generate, messages.Sampled)) else 1
        t0 = time.perf_counter()
        protocols[i].receive(message)
        batch = protocols[i].next_batch()
        output = Output(hidden=hidden) if i == 0 else Output(tokens=[token] * len(batch))
        actions = protocols[i].computed(batch, output)
        t2 = time.perf_counter()
        times["protocol"] += t2 - t0
        for action in actions:
            if isinstance(action, Send):
                t3 = time.perf_counter()
                data = wire.encode(action.message)
                back = wire.decode_message(data)
                if isinstance(back, messages.Hidden):
                    wire.tensor_from_wire(back.x)
                times["wire: encode + decode"] += time.perf_counter() - t3
                inbox.append(action.message)
    return {k: v / steps for k, v in times.items()}


def ring_rate(stages, prompt: list[int], steps: int) -> float:
    from swarm.stage import LocalRing

    ring = LocalRing(stages)
    ring.generate(prompt, 2)
    t0 = time.perf_counter()
    ring.generate(prompt, 1)
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    tokens = ring.generate(prompt, steps + 1)
    return (len(tokens) - 1) / (time.perf_counter() - t0 - first)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kinds", default="none,int8,int4-fast")
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's own choice)")
    parser.add_argument("--torch-int4", action="store_true",
                        help="int4-fast on torch's int4 kernel and the library's layers (SWARM_INT4_KERNEL=0), "
                             "not swarm's kernel and compiled decode step")
    parser.add_argument("--data-dir", type=Path, default=Path("/tmp/swarm-bench"))
    args = parser.parse_args()

    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.torch_int4:
        from swarm.stage import int4_kernel

        int4_kernel.use(False)
    from swarm.leader.chat.chat_format import encode_chat
    from swarm.model_import import ensure_imported

    ensure_imported("smollm2-135m-instruct", args.data_dir / "leader", "smollm2-135m-instruct", show_progress=False)
    model_dir = args.data_dir / "leader" / "models" / "smollm2-135m-instruct"
    prompt = encode_chat(model_dir, [{"role": "user", "content": PROMPT}], None)
    kinds = args.kinds.split(",")
    print(f"machine: {machine()}", flush=True)
    print(f"model: SmolLM2-135M-Instruct over 2 in-process stages, {args.steps} decode steps, best of {args.rounds} "
          "rounds, kinds taking turns", flush=True)
    stages = {kind: load_stages(model_dir, kind) for kind in kinds}
    clock = Clock()
    instrument(clock)
    plain = {k: [] for k in kinds}
    parts = {k: [] for k in kinds}
    overhead = {k: [] for k in kinds}
    rings = {k: [] for k in kinds}
    library = {k: [] for k in kinds}
    leans = {k: [stage.lean for stage in stages[k]] for k in kinds}
    for _ in range(args.rounds):
        for kind in kinds:
            plain[kind].append(decode_steps(stages[kind], prompt, args.steps))
            for stage in stages[kind]:  # the library's layers: the parts below are theirs
                stage.lean = None
            library[kind].append(decode_steps(stages[kind], prompt, args.steps))
            clock.reset()
            instrumented = decode_steps(stages[kind], prompt, args.steps, clock)
            for stage, lean in zip(stages[kind], leans[kind]):
                stage.lean = lean
            parts[kind].append((sum(instrumented), {k: v / args.steps for k, v in clock.exclusive.items()}))
            overhead[kind].append(protocol_and_wire(stages[kind], prompt, args.steps))
            rings[kind].append(ring_rate(stages[kind], prompt, args.steps))
    for kind in kinds:
        best = min(range(args.rounds), key=lambda r: sum(plain[kind][r]))
        per_stage = plain[kind][best]
        total, split = min(parts[kind], key=lambda p: p[0])
        extra = min(overhead[kind], key=lambda o: sum(o.values()))
        print(f"\n== {kind}: decode step {sum(per_stage) * 1e3:.2f} ms over both stages (stage 0 "
              f"{per_stage[0] * 1e3:.2f}, stage 1 {per_stage[1] * 1e3:.2f}); in-process ring "
              f"{max(rings[kind]):.1f} tok/s (median {statistics.median(rings[kind]):.1f})")
        lean_on = [lean is not None for lean in leans[kind]]
        print(f"   lean decode step (swarm.stage.lean_decode) on the stages: {lean_on}; the library's layers instead: "
              f"{min(sum(r) for r in library[kind]) * 1e3:.2f} ms (median "
              f"{statistics.median(sum(r) for r in library[kind]) * 1e3:.2f}, lean median "
              f"{statistics.median(sum(r) for r in plain[kind]) * 1e3:.2f})")
        print(f"   instrumented (the library's layers): {total * 1e3:.2f} ms; exclusive time per token, both stages:")
        for name, seconds in sorted(split.items(), key=lambda kv: -kv[1]):
            print(f"   {name:56s} {seconds * 1e3:7.3f} ms {100 * seconds / total:5.1f} %")
        for name, seconds in extra.items():
            print(f"   {name:56s} {seconds * 1e3:7.3f} ms (outside the stage's compute)")


if __name__ == "__main__":
    main()
