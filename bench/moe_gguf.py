"""A mixture of experts from a GGUF at the ``gguf`` kind: bench/moe_decode.py's random Qwen3-MoE (8 layers, 32
experts, top-4, hidden 512, expert rows 256) written with gguf-py's writer as llama.cpp lays it out -- experts in
--experts (Q4_0 by default), the other matrices in Q8_0, norms and router F32 -- imported with its blocks kept, then
decoded over 1 and 2 stages in one process (swarm.stage.local.LocalRing) at gguf and at none, against the gguf kind
in one process (tests/reference_model.gguf_reference_model driven by transformers' generate); the share of a token's
time in the experts; stored bytes against the file; each stage's memory against the plan.

    .venv/bin/python bench/moe_gguf.py [--tokens 32] [--rounds 3] [--threads 1] [--experts Q4_0]

Decode speed as bench/moe_decode.py measures it: (tokens - 1) / (reply of --tokens - reply of 1), median of rounds.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "bench")]

import torch  # noqa: E402

from moe_decode import CONFIG, PROMPT, decode_rate, expert_share  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--experts", default="Q4_0", help="the experts' GGUF type (one gguf-py quantizes)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    import transformers

    from gguf_moe_files import build_model, write_moe_gguf
    from reference_model import gguf_reference_model
    from swarm.leader.planning.placement import stage_weight_bytes
    from swarm.leader.serving.models import model_size
    from swarm.stage.local import LocalRing
    from swarm.stage.slice import StageModel
    from swarm.stage.slice_load import stage_specs
    from swarm.store.importer import import_model
    from swarm.store.manifest import load_manifest

    print(f"machine: {platform.machine()} {platform.processor() or ''}, {torch.get_num_threads()} torch threads, "
          f"torch {torch.__version__}, transformers {transformers.__version__}; a shared machine: figures are noisy")
    layers = CONFIG["num_hidden_layers"]
    with tempfile.TemporaryDirectory() as tmp:
        gguf = Path(tmp) / "moe.gguf"
        t0 = time.perf_counter()
        write_moe_gguf(gguf, build_model("qwen3_moe", seed=7, **CONFIG, norm_topk_prob=True), args.experts,
                       matrices="Q8_0")
        t1 = time.perf_counter()
        import_model(str(gguf), Path(tmp) / "models", "moe")
        t2 = time.perf_counter()
        model_dir = Path(tmp) / "models" / "moe"
        manifest = json.loads(load_manifest(model_dir).to_json())
        stored = sum(f["size"] for f in manifest["files"] if f["kind"] in ("layer", "embed", "final"))
        print(f"GGUF {gguf.stat().st_size / 1e6:.1f} MB (experts {args.experts}, the rest Q8_0 / F32), written in "
              f"{t1 - t0:.1f} s; imported in {t2 - t1:.1f} s, weights stored {stored / 1e6:.1f} MB "
              f"({stored / gguf.stat().st_size:.3f}x the file)")

        reference = gguf_reference_model(model_dir)
        ids = torch.tensor([PROMPT])

        def generate(n):
            with torch.inference_mode():
                reference.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)

        rate, rates = decode_rate(generate, args.tokens, args.rounds)
        print(f"the gguf kind in one process (generate): {rate:.1f} tok/s (rounds "
              f"{', '.join(f'{r:.1f}' for r in rates)})")

        for kind in ("gguf", "none"):
            size = model_size(manifest, cpu=True, quantization=kind)
            for n in (1, 2):
                specs = stage_specs(layers, n)
                stages = [StageModel.load_dir(model_dir, s, quantization=kind) for s in specs]
                for stage in stages:
                    stage.warm_up()
                ring = LocalRing(stages)
                memory = [f"{s.parameter_bytes() / 1e6:.1f} held / "
                          f"{stage_weight_bytes(size, p.first_layer, p.end_layer, p.is_first, p.is_last) / 1e6:.1f}"
                          f" planned MB" for s, p in zip(stages, specs)]
                rate, rates = decode_rate(lambda t, ring=ring: ring.generate(PROMPT, t), args.tokens, args.rounds)
                share = expert_share(ring, stages, args.tokens)
                print(f"swarm at {kind}, {n} stage(s) in one process: {rate:.1f} tok/s (rounds "
                      f"{', '.join(f'{r:.1f}' for r in rates)}); experts {share:.0%} of a token's time; "
                      f"{'; '.join(memory)}", flush=True)
                del stages, ring


if __name__ == "__main__":
    main()
