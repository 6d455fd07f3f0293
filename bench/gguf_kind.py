"""The gguf kind against int4-fast, and against llama.cpp on the same file: a stage's memory against its file bytes,
decode speed over 1 and 2 stages, and the time to first token of a long prompt (issue 33).

    .venv/bin/python bench/gguf_kind.py [--model smollm2-135m-instruct|gemma3-270m] [--tokens 48] [--rounds 3]
                                        [--llama-cpp BUILD] [--prefill 1000] [--skip-memory] [--skip-speed]

Memory, each stage in a fresh process (after one other layer was loaded to pay for the imports and the kernel):

- the middle stage of a 3-stage split at each kind (no embedding, no head, so the figure is the layers' alone);
- the memory table: what the leader stores for the GGUF (weights, and with the tokenizer) against the file's size,
  then each stage of a 1- and a 2-stage split at ``gguf``: what its fellow downloads (swarm.store.manifest's
  stage_files: its layers, the embedding for the first, the tied embedding and the tokenizer for the last), the RSS
  its load added, and that RSS against the download's weights.

Speed, in one process through swarm's stages (swarm.stage.local.LocalRing: the stages' own passes, no network), the
settings alternated round by round -- this machine is shared and noisy, so read the spread, not one figure:

- decode: tokens/s after the first token of a greedy chat reply (``(tokens - 1) / (t(tokens) - t(1))``), at each kind
  over 1 and 2 stages; with --llama-cpp, ``llama-bench`` tg of the same GGUF in the same rounds, same thread count;
- with --prefill N: the time to first token of an N-token prompt (the bench's text) over 2 stages at each kind, and
  llama.cpp's prompt processing of N tokens (``llama-bench`` pp) in the same rounds.

--llama-cpp: llama.cpp's build folder (bin/llama-bench); bench/side_by_side.py's docstring says how to build it.
"""

from __future__ import annotations

import argparse
import csv
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

KINDS = ("gguf", "int4-fast", "none")
PROMPT = "Write a long story about a lighthouse keeper and a storm."
TEXT = Path(__file__).with_name("texts") / "eb1911_shakespeare.txt"


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                   if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{cpu}, {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}"


def model_dir(data: Path, name: str) -> Path:
    from swarm.store.importer import import_model

    folder = data / name
    if not (folder / "manifest.json").exists():
        import_model(name, data)
    return folder


def rss() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def measure_memory(folder: Path, kind: str, stages: int, index: int) -> dict:
    """Run in a fresh process (--memory KIND --stage N/I): stage I of an N-stage split at ``kind``."""
    import torch

    from swarm.stage.slice import StageModel
    from swarm.stage.slice_load import stage_specs
    from swarm.store.manifest import load_manifest, stage_files

    torch.set_num_threads(1)
    manifest = load_manifest(folder)
    layers = manifest.num_layers
    spec = stage_specs(layers, stages)[index]
    # one middle layer first (not measured): the imports, the kernel's build and the first allocations are paid
    # there, so the figure is what the stage takes
    warm = StageModel.load_dir(folder, stage_specs(layers, layers)[layers // 2], quantization=kind)
    gc.collect()
    before = rss()
    stage = StageModel.load_dir(folder, spec, quantization=kind)
    gc.collect()
    after = rss()
    files = stage_files(manifest, spec.first_layer, spec.end_layer, spec.is_first, spec.is_last)
    weights = sum(f.size for f in files if f.path.endswith(".safetensors"))
    del warm
    return {"kind": kind, "layers": [spec.first_layer, spec.end_layer], "rss_bytes": after - before,
            "held_bytes": stage.parameter_bytes(), "file_bytes": weights,
            "download_bytes": sum(f.size for f in files)}


def child_memory(args, kind: str, stages: int, index: int) -> dict:
    out = subprocess.run([sys.executable, __file__, "--model", args.model, "--memory", kind, "--stage",
                          f"{stages}/{index}", "--data-dir", str(args.data_dir)],
                         capture_output=True, text=True, check=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    return json.loads(out.stdout.strip().splitlines()[-1])


def memory(args, folder: Path, gguf: Path | None) -> None:
    from swarm.store.manifest import load_manifest

    manifest = load_manifest(folder)
    layers = manifest.num_layers
    middle = [(i * layers) // 3 for i in (1, 2)]
    print(f"memory: the middle stage of 3 (layers {middle[0]}-{middle[1] - 1}), each kind in a fresh process",
          flush=True)
    for kind in KINDS:
        m = child_memory(args, kind, 3, 1)
        print(f"  {kind:>9}: RSS +{m['rss_bytes'] / 1e6:6.1f} MB, tensors {m['held_bytes'] / 1e6:6.1f} MB, "
              f"layer files {m['file_bytes'] / 1e6:5.1f} MB: RSS {m['rss_bytes'] / m['file_bytes']:.2f}x, "
              f"tensors {m['held_bytes'] / m['file_bytes']:.2f}x the files", flush=True)
    weights = sum(f.size for f in manifest.files if f.path.endswith(".safetensors"))
    size = gguf.stat().st_size if gguf is not None else None
    print("memory table, at gguf:", flush=True)
    if size:
        print(f"  the GGUF {size / 1e6:.1f} MB; stored: weights {weights / 1e6:.1f} MB ({weights / size:.3f}x), "
              f"all files {manifest.total_bytes / 1e6:.1f} MB ({manifest.total_bytes / size:.3f}x, the tokenizer "
              "and config included)", flush=True)
    print(f"  {'stage':>14} {'download MB':>12} {'x file':>7} {'RSS MB':>8} {'RSS/download':>13} {'tensors MB':>11}",
          flush=True)
    for stages in (1, 2):
        for index in range(stages):
            m = child_memory(args, "gguf", stages, index)
            share = f"{m['download_bytes'] / size:.2f}" if size else "-"
            print(f"  {f'{index + 1} of {stages} ' + '-'.join(map(str, m['layers'])):>14} "
                  f"{m['download_bytes'] / 1e6:12.1f} {share:>7} {m['rss_bytes'] / 1e6:8.1f} "
                  f"{m['rss_bytes'] / m['file_bytes']:13.2f} {m['held_bytes'] / 1e6:11.1f}", flush=True)


def llama_bench(build: Path, gguf: Path, prompt: int, tokens: int, threads: int) -> dict[str, float]:
    """llama-bench's rates, tokens/s: {"pp": prompt processing of ``prompt`` tokens, "tg": generation of
    ``tokens``} (a 0 leaves that test out), one repetition."""
    binary = next((p for p in (build / "bin" / "llama-bench", build / "llama-bench") if p.exists()), None)
    if binary is None:
        raise SystemExit(f"no llama-bench under {build}")
    out = subprocess.run([str(binary), "-m", str(gguf), "-p", str(prompt), "-n", str(tokens), "-t", str(threads),
                          "-r", "1", "-o", "csv"], capture_output=True, text=True, timeout=900, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"llama-bench failed ({out.returncode}): {out.stderr.strip()[-400:]}")
    rows = list(csv.DictReader(line for line in out.stdout.splitlines() if line.startswith('"') or "avg_ts" in line))
    return {("pp" if int(r["n_prompt"]) else "tg"): float(r["avg_ts"]) for r in rows}


def decode_speed(stages, prompt: list[int], tokens: int) -> float:
    """tokens/s after the first token: (tokens - 1) / (t(tokens) - t(1))"""
    from swarm.stage.local import LocalRing

    ring = LocalRing(stages)
    ring.generate(prompt, 4, rid="warm")
    start = time.perf_counter()
    ring.generate(prompt, 1, rid="first")
    first = time.perf_counter() - start
    start = time.perf_counter()
    got = ring.generate(prompt, tokens, rid="timed")
    return (len(got) - 1) / (time.perf_counter() - start - first)


def first_token(stages, prompt: list[int]) -> float:
    """seconds to the first token of ``prompt`` (prefill in the ring's chunks, then one token)"""
    from swarm.stage.local import LocalRing

    ring = LocalRing(stages)
    start = time.perf_counter()
    ring.generate(prompt, 1, rid=f"ttft{time.monotonic_ns()}")
    return time.perf_counter() - start


def speed(args, folder: Path, gguf: Path | None) -> None:
    import torch

    from swarm.leader.chat.chat_format import encode_chat
    from swarm.stage.slice import StageModel
    from swarm.stage.slice_load import stage_specs
    from swarm.store.manifest import load_manifest

    torch.set_num_threads(args.threads)
    layers = load_manifest(folder).num_layers
    kinds = args.kinds.split(",")
    prompt = encode_chat(folder, [{"role": "user", "content": PROMPT}], None)
    rings = {(kind, n): [StageModel.load_dir(folder, s, quantization=kind) for s in stage_specs(layers, n)]
             for kind in kinds for n in (1, 2)}
    long_prompt: list[int] = []
    if args.prefill:
        from transformers import AutoTokenizer

        long_prompt = AutoTokenizer.from_pretrained(folder)(TEXT.read_text()).input_ids[: args.prefill]
    keys: list[str] = [f"{kind}, {n} stage{'s' if n > 1 else ''}" for kind, n in rings]
    llama = args.llama_cpp is not None and gguf is not None
    rates: dict[str, list[float]] = {key: [] for key in keys + (["llama.cpp tg, one process"] if llama else [])}
    ttfts: dict[str, list[float]] = {f"{kind}, 2 stages": [] for kind in kinds} if long_prompt else {}
    if long_prompt and llama:
        ttfts["llama.cpp pp, one process"] = []
    jobs: list = [("rate", key, ring) for key, ring in zip(keys, rings.values())]
    if llama:
        jobs.append(("llama", None, None))
    jobs += [("ttft", f"{kind}, 2 stages", rings[(kind, 2)]) for kind in kinds if long_prompt]
    for round_ in range(args.rounds):
        for job, key, ring in (jobs if round_ % 2 == 0 else reversed(jobs)):  # alternated: noise falls on all
            if job == "rate":
                rates[key].append(decode_speed(ring, prompt, args.tokens))
            elif job == "ttft":
                ttfts[key].append(first_token(ring, long_prompt))
            else:
                assert gguf is not None and args.llama_cpp is not None
                got = llama_bench(args.llama_cpp, gguf, len(long_prompt), args.tokens, args.threads)
                rates["llama.cpp tg, one process"].append(got["tg"])
                if long_prompt:
                    ttfts["llama.cpp pp, one process"].append(len(long_prompt) / got["pp"])
        print(f"  round {round_ + 1} done, load average {os.getloadavg()[0]:.1f}", flush=True)
    plural = "s" if args.threads > 1 else ""
    print(f"decode, {args.tokens} tokens a reply, tok/s after the first token per round (median), "
          f"{args.threads} thread{plural}:")
    for key, values in rates.items():
        print(f"  {key:>28}: {' '.join(f'{v:6.1f}' for v in values)} ({statistics.median(values):.1f})")
    med = {key: statistics.median(values) for key, values in rates.items()}
    for n in ("1 stage", "2 stages"):
        for other in kinds[1:]:
            print(f"  {kinds[0]} / {other} over {n}: {med[f'{kinds[0]}, {n}'] / med[f'{other}, {n}']:.2f}x")
        if llama:
            print(f"  {kinds[0]} over {n} / llama.cpp tg: "
                  f"{med[f'{kinds[0]}, {n}'] / med['llama.cpp tg, one process']:.2f}x")
    if ttfts:
        print(f"time to first token of a {len(long_prompt)}-token prompt, seconds per round (median), prefill "
              f"chunks of 256, {args.threads} thread{plural}:")
        for key, values in ttfts.items():
            print(f"  {key:>28}: {' '.join(f'{v:6.2f}' for v in values)} ({statistics.median(values):.2f})")
        if llama:
            mine = statistics.median(ttfts[f"{kinds[0]}, 2 stages"])
            print(f"  {kinds[0]} over 2 stages / llama.cpp pp: "
                  f"{mine / statistics.median(ttfts['llama.cpp pp, one process']):.2f}x the time")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct", help="a built-in GGUF model's name")
    parser.add_argument("--kinds", default="gguf,int4-fast", help="kinds timed (the first is compared with the rest)")
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--data-dir", type=Path, default=Path("/tmp/swarm-bench-gguf"))
    parser.add_argument("--threads", type=int, default=1, help="torch threads for the speed part, and llama.cpp's "
                        "(default 1: on a shared machine two spinning OpenMP threads fall far behind one)")
    parser.add_argument("--llama-cpp", type=Path, help="llama.cpp's build folder (bin/llama-bench)")
    parser.add_argument("--prefill", type=int, default=0, help="time to first token of a prompt of this many tokens")
    parser.add_argument("--skip-memory", action="store_true")
    parser.add_argument("--skip-speed", action="store_true")
    parser.add_argument("--memory", choices=KINDS, help=argparse.SUPPRESS)  # the child process's job
    parser.add_argument("--stage", default="3/1", help=argparse.SUPPRESS)  # the child's stage: N/I
    args = parser.parse_args()
    args.data_dir.mkdir(parents=True, exist_ok=True)
    folder = model_dir(args.data_dir, args.model)
    if args.memory:
        stages, index = map(int, args.stage.split("/"))
        print(json.dumps(measure_memory(folder, args.memory, stages, index)))
        return

    from swarm.store.importer import builtin_gguf_path

    gguf = builtin_gguf_path(args.model, args.data_dir / "assembled")
    print(f"machine: {machine()}; model {args.model} ({gguf.name}, {gguf.stat().st_size / 1e6:.1f} MB)", flush=True)
    if not args.skip_memory:
        memory(args, folder, gguf)
    if not args.skip_speed:
        speed(args, folder, gguf)
    print(f"machine after: load average {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
