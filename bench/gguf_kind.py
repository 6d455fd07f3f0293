"""The gguf kind against int4-fast and none on the built-in model (SmolLM2-135M-Instruct, Q4_1 GGUF): a stage's
memory against its layers' file bytes, and decode speed over 1 and 2 stages.

    .venv/bin/python bench/gguf_kind.py [--tokens 48] [--rounds 3] [--data-dir /tmp/swarm-bench-gguf]

Memory: each kind in a fresh process, the middle stage of a 3-stage split (layers 10-19: no embedding, no head, so
the figure is the layers' alone): the process's RSS after the load minus before it (after one other layer was loaded
to pay for the imports and the kernel), the bytes the stage's tensors
hold, and the layers' file bytes (what the fellow downloads). Speed: greedy decode of one chat in one process
through swarm's stages (swarm.stage.local.LocalRing: the stages' own passes, no network), 1 stage and 2 stages, the
kinds alternated round by round -- this machine is shared and noisy, so read the spread, not one figure.
"""

from __future__ import annotations

import argparse
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


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                   if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{cpu}, {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}"


def model_dir(data: Path) -> Path:
    from swarm.store.importer import import_model

    folder = data / "smollm2-135m-instruct"
    if not (folder / "manifest.json").exists():
        import_model("smollm2-135m-instruct", data)
    return folder


def rss() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def measure_memory(folder: Path, kind: str) -> dict:
    """Run in a fresh process (--memory KIND): the middle stage of 3 at ``kind``."""
    import torch

    from swarm.model_format import layer_file
    from swarm.stage.slice import StageModel
    from swarm.stage.slice_load import stage_specs

    torch.set_num_threads(1)
    spec = stage_specs(30, 3)[1]
    # one layer first (layer 5, not measured): the imports, the kernel's build and the first allocations are paid
    # there, so the figure is what the ten layers take
    warm = StageModel.load_dir(folder, stage_specs(30, 30)[5], quantization=kind)
    gc.collect()
    before = rss()
    stage = StageModel.load_dir(folder, spec, quantization=kind)
    gc.collect()
    after = rss()
    files = sum((folder / layer_file(i)).stat().st_size for i in range(spec.first_layer, spec.end_layer))
    del warm
    return {"kind": kind, "layers": [spec.first_layer, spec.end_layer], "rss_bytes": after - before,
            "held_bytes": stage.parameter_bytes(), "file_bytes": files}


def decode_speed(stages, prompt: list[int], tokens: int) -> float:
    from swarm.stage.local import LocalRing

    ring = LocalRing(stages)
    ring.generate(prompt, 4, rid="warm")
    start = time.perf_counter()
    got = ring.generate(prompt, tokens, rid="timed")
    return len(got) / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--data-dir", type=Path, default=Path("/tmp/swarm-bench-gguf"))
    parser.add_argument("--threads", type=int, default=1, help="torch threads for the speed part (default 1: on a "
                        "shared machine two spinning OpenMP threads fall far behind one)")
    parser.add_argument("--skip-memory", action="store_true")
    parser.add_argument("--memory", choices=KINDS, help=argparse.SUPPRESS)  # the child process's job
    args = parser.parse_args()
    args.data_dir.mkdir(parents=True, exist_ok=True)
    folder = model_dir(args.data_dir)
    if args.memory:
        print(json.dumps(measure_memory(folder, args.memory)))
        return

    print(f"machine: {machine()}", flush=True)
    if not args.skip_memory:
        print("memory: the middle stage of 3 (layers 10-19), each kind in a fresh process", flush=True)
    for kind in () if args.skip_memory else KINDS:
        out = subprocess.run([sys.executable, __file__, "--memory", kind, "--data-dir", str(args.data_dir)],
                             capture_output=True, text=True, check=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
        m = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"  {kind:>9}: RSS +{m['rss_bytes'] / 1e6:6.1f} MB, tensors {m['held_bytes'] / 1e6:6.1f} MB, "
              f"layer files {m['file_bytes'] / 1e6:5.1f} MB: RSS {m['rss_bytes'] / m['file_bytes']:.2f}x, "
              f"tensors {m['held_bytes'] / m['file_bytes']:.2f}x the files", flush=True)

    import torch

    from swarm.leader.chat_format import encode_chat
    from swarm.stage.slice import StageModel
    from swarm.stage.slice_load import stage_specs

    torch.set_num_threads(args.threads)

    prompt = encode_chat(folder, [{"role": "user", "content": PROMPT}], None)
    rings = {(kind, n): [StageModel.load_dir(folder, s, quantization=kind) for s in stage_specs(30, n)]
             for kind in ("gguf", "int4-fast") for n in (1, 2)}
    speeds: dict[tuple[str, int], list[float]] = {key: [] for key in rings}
    for round_ in range(args.rounds):
        for key in (rings if round_ % 2 == 0 else reversed(list(rings))):  # alternated: the noise falls on both
            speeds[key].append(decode_speed(rings[key], prompt, args.tokens))
    print(f"decode, {args.tokens} tokens a chat, tok/s per round (median), in one process through the stages, "
          f"{args.threads} thread{'s' if args.threads > 1 else ''}:")
    for (kind, n), values in speeds.items():
        print(f"  {kind:>9}, {n} stage{'s' if n > 1 else ' '}: {' '.join(f'{v:5.1f}' for v in values)} "
              f"({statistics.median(values):.1f})")
    for n in (1, 2):
        ratio = statistics.median(speeds[("gguf", n)]) / statistics.median(speeds[("int4-fast", n)])
        print(f"  gguf / int4-fast over {n} stage{'s' if n > 1 else ''}: {ratio:.2f}x")
    print(f"machine after: load average {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
