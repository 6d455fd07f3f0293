"""Quantized loads on this machine's CPU: decode speed and perplexity of the built-in model at each kind, and the
other CPU paths torch offers, measured to choose between them (swarm/stage/quantize.py).

    .venv/bin/python bench/quantized.py [--tokens 48] [--repeats 2] [--paths all|kinds] [--threads N]

Each row is the whole model in one process (transformers `generate`, greedy, from a short chat prompt) with its
linear layers replaced as the row says; the kinds' rows are exactly what a ring's stages compute
(swarm.stage.quantize.quantize_model). Perplexity is over a fixed English text (below), one forward pass. Prints the
machine first. The VM is shared: the rows take turns for --repeats rounds and each keeps its best.
"""

from __future__ import annotations

import argparse
import copy
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from ring_speed import machine

# A fixed text for perplexity: plain encyclopaedic English, ~330 tokens with SmolLM2's tokenizer.
TEXT = (
    "The lighthouse stands on a rocky point at the mouth of the harbour. It was built in 1858 from granite quarried "
    "on the island, and its light could be seen twenty miles out to sea. For more than a century a keeper and his "
    "family lived in the small cottage beside the tower. Every evening at sunset the keeper climbed the one hundred "
    "and twelve steps to light the lamp, and every morning he climbed them again to put it out and polish the great "
    "glass lens. In storms he stayed awake all night, watching for ships in trouble and sounding the fog horn when "
    "the rain and mist hid the light. The work was hard and lonely, but the keepers were proud of it: in all those "
    "years no ship was lost on the rocks below the point. In 1965 the light was made automatic and the last keeper "
    "left the island. Today the cottage is a small museum. Visitors can see the keeper's logbooks, in which he wrote "
    "down the weather, the ships that passed and the supplies that came by boat each month. The tower itself is "
    "still in use. Its modern lamp is powered by solar panels and batteries, and it flashes white every ten seconds, "
    "as the old light did. On clear summer days the museum opens the gallery at the top of the tower, and from there "
    "one can see the whole coast, from the cliffs in the north to the long sandy beaches in the south."
)


def perplexity(model, tokenizer) -> float:
    import torch

    ids = tokenizer(TEXT, return_tensors="pt").input_ids
    with torch.inference_mode():
        out = model(ids, labels=ids)
    return math.exp(float(out.loss))


def decode_speed(model, prompt_ids, tokens: int, repeats: int) -> float:
    import torch

    ids = torch.tensor([prompt_ids])
    kwargs = {"attention_mask": torch.ones_like(ids), "do_sample": False, "pad_token_id": 2}
    with torch.inference_mode():
        model.generate(ids, max_new_tokens=4, min_new_tokens=4, **kwargs)  # warm-up: kernels, allocator
        best = 0.0
        for _ in range(repeats):
            start = time.perf_counter()
            model.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, **kwargs)
            best = max(best, tokens / (time.perf_counter() - start))
    return best


def weight_bytes(model) -> int:
    from swarm.stage.quantize import module_bytes

    return module_bytes(model)


def other_paths(base):
    """The CPU paths measured but not chosen, each as a function that returns a quantized copy of ``base``."""
    import torch
    from torch import nn

    from swarm.stage.quantize import quantize_linears


    def dynamic_int8():  # torch.ao: int8 weights, activations quantized per pass (fbgemm/oneDNN)
        model = copy.deepcopy(base)
        model.model = torch.ao.quantization.quantize_dynamic(model.model, {nn.Linear}, dtype=torch.qint8)
        return model

    def dynamic_int8_head():
        return torch.ao.quantization.quantize_dynamic(copy.deepcopy(base), {nn.Linear}, dtype=torch.qint8)

    def int8_layers_only():
        model = copy.deepcopy(base)
        for layer in model.model.layers:
            quantize_linears(layer, "int8")
        return model

    def int4_head_too():  # every linear at 4 bits, the head included
        model = copy.deepcopy(base)
        for layer in model.model.layers:
            quantize_linears(layer, "int4-fast")
        head = nn.Linear(base.lm_head.in_features, base.lm_head.out_features, bias=False)
        head.weight = nn.Parameter(base.lm_head.weight.detach().clone(), requires_grad=False)
        model.lm_head = quantize_linears(head, "int4-fast")
        model.config.tie_word_embeddings = False
        return model

    def nf4_dequantized():  # the NF4 code book, dequantized to float32 for every pass (no CPU kernel for it)
        model = copy.deepcopy(base)
        for layer in model.model.layers:
            for parent in list(layer.modules()):
                for name, child in list(parent.named_children()):
                    if isinstance(child, nn.Linear):
                        setattr(parent, name, _NF4Dequantized(child))
        return model

    def bfloat16():
        return copy.deepcopy(base).to(torch.bfloat16)

    return {
        "bfloat16 (not a kind)": bfloat16,
        "int8 dynamic (torch.ao), layers": dynamic_int8,
        "int8 dynamic (torch.ao), layers + head": dynamic_int8_head,
        "int8 weight-only, layers only": int8_layers_only,
        "int4 weight-only, head at 4 bits too": int4_head_too,
        "nf4 code book, dequantized per pass": nf4_dequantized,
    }


def torch_int4(base, kind: str):
    """``base`` quantized to ``kind`` with its 4-bit layers on torch's int4 kernel instead of swarm's."""
    from swarm.stage import int4_kernel
    from swarm.stage.quantize import quantize_model

    int4_kernel.use(False)
    try:
        return quantize_model(copy.deepcopy(base), kind)
    finally:
        int4_kernel.use(True)


def _nf4_module():
    import torch
    from torch import nn

    # bitsandbytes' NF4 levels (Dettmers et al. 2023, QLoRA, appendix E)
    levels = torch.tensor([-1.0, -0.6961928, -0.5250731, -0.3949175, -0.2844414, -0.1847734, -0.0910500, 0.0,
                           0.0795803, 0.1609302, 0.2461123, 0.3379152, 0.4407098, 0.5626170, 0.7229568, 1.0])

    class NF4Dequantized(nn.Module):
        def __init__(self, linear, block: int = 64):
            super().__init__()
            w = linear.weight.detach().float()
            self.shape = w.shape
            blocks = w.reshape(-1, block)
            absmax = blocks.abs().amax(-1, keepdim=True).clamp(min=1e-12)
            codes = (blocks / absmax).unsqueeze(-1).sub(levels).abs().argmin(-1).to(torch.uint8)
            self.register_buffer("codes", codes)
            self.register_buffer("absmax", absmax)

        def forward(self, x):
            w = (levels[self.codes.long()] * self.absmax).reshape(self.shape)
            return nn.functional.linear(x, w)

    return NF4Dequantized


def _NF4Dequantized(linear):
    return _nf4_module()(linear)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--paths", choices=["all", "kinds"], default="all")
    parser.add_argument("--data-dir", type=Path, default=Path("/tmp/swarm-bench"))
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's own choice)")
    args = parser.parse_args()

    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer

    from reference_model import load_reference_model
    from swarm.leader.chat.chat_format import encode_chat
    from swarm.model_import import ensure_imported
    from swarm.stage import int4_kernel
    from swarm.stage.quantize import KINDS, quantize_model

    ensure_imported("smollm2-135m-instruct", args.data_dir / "leader", "smollm2-135m-instruct", show_progress=False)
    model_dir = args.data_dir / "leader" / "models" / "smollm2-135m-instruct"
    print(f"machine: {machine()}", flush=True)
    print(f"model: SmolLM2-135M-Instruct, float32 compute, greedy, {args.tokens} new tokens, best of {args.repeats}",
          flush=True)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompt = encode_chat(model_dir, [{"role": "user", "content": "Write a story about a lighthouse keeper."}], None)
    base = load_reference_model(model_dir, dtype=torch.float32)
    print(f"{'path':42s} {'tok/s':>7s} {'vs f32':>7s} {'weights MB':>11s} {'perplexity':>11s}", flush=True)
    rows = [(f"kind {kind}" if kind != "none" else "kind none (float32)",
             lambda kind=kind: quantize_model(copy.deepcopy(base), kind)) for kind in KINDS]
    if int4_kernel.kernel() is not None:  # the 4-bit kinds again on torch's int4 kernel (SWARM_INT4_KERNEL=0)
        rows += [(f"kind {kind}, torch's int4 kernel", lambda kind=kind: torch_int4(base, kind))
                 for kind in ("nf4", "int4-fast")]
    if args.paths == "all":
        rows += list(other_paths(base).items())
    # Every model is built first and the rounds go over all of them in turn, so a swing in the shared VM's load
    # falls on every row alike; each row keeps its best round.
    built = []
    for name, build in rows:
        model = build()
        built.append((name, model, weight_bytes(model), perplexity(model, tokenizer)))
    best = {name: 0.0 for name, *_ in built}
    for _ in range(args.repeats):
        for name, model, *_ in built:
            best[name] = max(best[name], decode_speed(model, prompt, args.tokens, 1))
    reference_speed = best[built[0][0]]
    for name, _, size, ppl in built:
        print(f"{name:42s} {best[name]:7.1f} {best[name] / reference_speed:6.2f}x {size / 1e6:11.0f} {ppl:11.2f}",
              flush=True)

if __name__ == "__main__":
    main()
