"""What holding the KV cache at another kind costs (``--kv-cache``, swarm.stage.kv_cache): perplexity of the built-in
model on bench/quantized.py's fixed English text with its keys and values held at each kind, against float32 keys
and values, and the bytes a token's cache takes.

    .venv/bin/python bench/kv_cache.py [--chunk 64]

The text goes through the whole model in one process (float32 compute), in prompt chunks of --chunk tokens as a
stage prefills, every chunk attending to the keys and values the cache holds -- at q8, int8 with a float16 scale
per 32 elements (llama.cpp's q8_0 layout; its reference cost is under 0.5 % perplexity). Prints the machine first.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from quantized import TEXT
from ring_speed import machine


def chunked_perplexity(model, ids, kind: str, chunk: int) -> tuple[float, int]:
    """(perplexity of ``ids``, bytes its cache holds) with the cache at ``kind``, fed ``chunk`` tokens a pass."""
    import torch

    from swarm.stage.kv_cache import held_bytes, new_cache

    cache = new_cache(model.config, kind, torch.float32)
    logits = []
    with torch.inference_mode():
        for start in range(0, ids.shape[1], chunk):
            out = model(ids[:, start:start + chunk], cache=cache, use_cache=True)
            logits.append(out.logits[0].float())
    every = torch.cat(logits)
    loss = torch.nn.functional.cross_entropy(every[:-1], ids[0, 1:])
    return math.exp(float(loss)), held_bytes(cache)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--chunk", type=int, default=64)
    parser.add_argument("--data-dir", type=Path, default=Path("/tmp/swarm-bench"))
    args = parser.parse_args()

    import torch
    from transformers import AutoTokenizer

    from reference_model import load_reference_model
    from swarm.model_import import ensure_imported

    ensure_imported("smollm2-135m-instruct", args.data_dir / "leader", "smollm2-135m-instruct", show_progress=False)
    model_dir = args.data_dir / "leader" / "models" / "smollm2-135m-instruct"
    print(f"machine: {machine()}", flush=True)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ids = tokenizer(TEXT, return_tensors="pt").input_ids
    model = load_reference_model(model_dir, dtype=torch.float32)
    print(f"model: SmolLM2-135M-Instruct, float32 compute, {ids.shape[1]} tokens in chunks of {args.chunk}",
          flush=True)
    base, base_bytes = chunked_perplexity(model, ids, "f32", args.chunk)
    print(f"{'kv cache':10s} {'perplexity':>11s} {'vs f32':>8s} {'KB/token':>9s}")
    for kind in ("f32", "f16", "q8"):
        ppl, held = (base, base_bytes) if kind == "f32" else chunked_perplexity(model, ids, kind, args.chunk)
        print(f"{kind:10s} {ppl:11.4f} {100 * (ppl / base - 1):+7.3f}% {held / ids.shape[1] / 1024:9.2f}", flush=True)


if __name__ == "__main__":
    main()
