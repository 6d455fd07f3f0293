"""swarm's 8-bit group kernel (swarm/stage/q8_kernel.c) on a stage's shapes, against the other ways to compute the
same layer on this CPU: torch's float32 matmul of the widened weight, torch's int8 weight-only kernel
(``torch._weight_int8pack_mm``, one scale per output: not lossless for GGUF blocks, a speed reference), swarm's int4
kernel, and ggml's own matrix product on the same type where a build of it is given.

    .venv/bin/python bench/q8_kernel.py [--rounds 5] [--threads N] [--types Q8_0,Q6_K,...] [--rows 1,4]
                                        [--shapes KxN,...] [--ggml PROGRAM]

Shapes (inputs x outputs) are SmolLM2-135M's: 576 x 1536 (gate/up), 1536 x 576 (down), 576 x 49152 (the head), each
for 1 row (a decode step) and 4 rows (drafting's verifying pass) unless --rows says otherwise; the K types only where
the inputs are whole blocks of 256 (1536: llama.cpp quantizes 576-wide rows to Q8_0, Q5_0, ... instead). Every
candidate takes its turn in each of --rounds rounds and keeps its best time per call (the VM is shared). --ggml:
bench/q8_ggml_mm.c built against ggml (its header says how). Prints the machine first, then one line per shape, rows
and candidate: microseconds per product and the weight bytes it reads per second.
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np
import torch
from torch.nn import functional as F

from swarm.stage import gguf_q8, int4_kernel, q8_kernel

SHAPES = [(576, 1536), (1536, 576), (576, 49152)]
# values and bytes per block, and where each type's fp16 scales sit in its block (ggml-common.h)
_BLOCKS = {"Q8_0": (32, 34, (0,)), "Q5_0": (32, 22, (0,)), "Q5_1": (32, 24, (0, 2)), "Q5_K": (256, 176, (0, 2)),
           "Q6_K": (256, 210, (208,))}


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                   if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return (f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__}, load average "
            f"{os.getloadavg()[0]:.1f}, {torch.get_num_threads()} torch threads")


def random_blocks(kind: str, n: int, k: int, rng: np.random.Generator) -> torch.Tensor:
    """Random block bytes with small finite fp16 scales: the speed does not depend on the values"""
    values, size, scales = _BLOCKS[kind]
    data = rng.integers(0, 256, size=(n, k // values, size), dtype=np.uint8)
    for at in scales:
        data[:, :, at : at + 2] = np.frombuffer(np.float16(0.002).tobytes(), dtype=np.uint8)
    return torch.from_numpy(data.reshape(n, -1))


def best_us(fn, budget_s: float = 0.25) -> float:
    """The best time per call, in microseconds, over ~budget_s of calls"""
    fn()
    best, spent = float("inf"), 0.0
    while spent < budget_s:
        start = time.perf_counter()
        fn()
        took = time.perf_counter() - start
        best, spent = min(best, took), spent + took
    return best * 1e6


def ggml_us(program: Path, kind: str, k: int, n: int, rows: int, threads: int) -> float:
    done = subprocess.run([str(program), kind, str(k), str(n), str(rows), str(threads), "50"], capture_output=True,
                          text=True, timeout=600)
    if done.returncode:
        raise RuntimeError(f"{program} failed: {done.stderr.strip()[-300:]}")
    return float(done.stdout.split()[-1])


def candidates(k: int, n: int, rows: int, types: list[str], rng: np.random.Generator):
    """(name, weight bytes read per call, function) for one shape and row count"""
    x = torch.randn(rows, k)
    for kind in types:
        if k % _BLOCKS[kind][0]:
            continue  # a K-quant row is whole blocks of 256: files hold such tensors in Q8_0, Q5_0 ... instead
        raw = random_blocks(kind, n, k, rng)
        layer = gguf_q8.q8_linear(raw, kind, (n, k), None)
        held = layer.packed.numel() + layer.scales.element_size() * layer.scales.numel()
        yield f"swarm q8 kernel, {kind}", held, lambda layer=layer: layer(x)
        if layer.bits != 8:  # the same type a byte a level (the layout before the planes), for comparison
            wide = gguf_q8.q8_linear(raw, kind, (n, k), None, planes=False)
            held = wide.packed.numel() + wide.scales.element_size() * wide.scales.numel()
            yield f"swarm q8 kernel, {kind} a byte a level", held, lambda wide=wide: wide(x)
    w = torch.randn(n, k) * 0.02
    yield "torch float32 matmul (widened)", 4 * n * k, lambda: F.linear(x, w)
    w8 = torch.randint(-127, 128, (n, k), dtype=torch.int8)
    scales = torch.rand(n) * 0.01
    yield "torch int8 per-output (_weight_int8pack_mm)", n * k + 4 * n, lambda: torch._weight_int8pack_mm(x, w8, scales)
    four = int4_kernel.kernel()
    if four is not None and int4_kernel.takes(k):
        q = torch.randint(0, 16, (n, k))
        s = (torch.rand(n, k // 32) * 0.02).to(torch.bfloat16)
        packed, scale_zeros = four.pack(q, s, s)
        yield "swarm int4 kernel (Q4 repack)", n * k // 2 + 4 * n * k // 32, \
            lambda: four.matmul(x, packed, scale_zeros, n, None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--types", default="Q8_0,Q6_K,Q5_K,Q5_0,Q5_1")
    parser.add_argument("--rows", default="1,4", help="row counts: 1 a decode step, 4 drafting's check, 64+ prefill")
    parser.add_argument("--shapes", default=",".join(f"{k}x{n}" for k, n in SHAPES), help="inputs x outputs, ...")
    parser.add_argument("--ggml", type=Path, help="bench/q8_ggml_mm.c built against ggml")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    kernel = q8_kernel.kernel()
    print(f"machine: {machine()}; q8 kernel: {kernel.simd if kernel else 'not built (torch fallback)'}")
    types = args.types.split(",")
    rng = np.random.default_rng(0)
    for k, n in (tuple(int(v) for v in shape.split("x")) for shape in args.shapes.split(",")):
        for rows in (int(r) for r in args.rows.split(",")):
            rows_of = list(candidates(k, n, rows, types, rng))
            best = {name: float("inf") for name, _, _ in rows_of}
            for _ in range(args.rounds):  # turns, so that a busy moment of the shared VM hits every candidate
                for name, _, fn in rows_of:
                    best[name] = min(best[name], best_us(fn))
            if args.ggml:
                for kind in (t for t in types if k % _BLOCKS[t][0] == 0):
                    best[f"ggml mul_mat, {kind}"] = ggml_us(args.ggml, kind, k, n, rows, torch.get_num_threads())
            sizes = {name: size for name, size, _ in rows_of}
            for name, us in best.items():
                rate = f", {sizes[name] / us / 1e3:.1f} GB/s of weights" if name in sizes else ""
                print(f"{k} x {n}, {rows} row{'s' if rows > 1 else ''}: {name}: {us:.1f} us{rate}", flush=True)


if __name__ == "__main__":
    main()
