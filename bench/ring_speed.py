"""Decode speed and time to first token of the built-in model: one process, one stage, and a 2-stage ring.

    .venv/bin/python bench/ring_speed.py [--tokens 64] [--data-dir /tmp/swarm-bench]

Prints, with the machine it ran on: transformers `generate` tokens/s in one process; the same through swarm with
1 stage and with 2 stages over the direct TCP link and over the leader's relay; time to first token for a
1,000-token prompt; the first short chat's time to first token after a load against the later ones'; each stage
process's resident memory; and where each token's time went as the fellows measured it (swarm.timing: each stage's
compute, the links), against the time per token the leader measured. Real leader and fellow processes on loopback.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import statistics
import sys
import time
from pathlib import Path

import httpx
import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from fleet import Pool, free_port  # noqa: E402, F401 (free_port: bench/side_by_side.py takes it from here)
from swarm.client import split_parts  # noqa: E402
from swarm.demo import BUILTIN  # noqa: E402
from swarm.model_import import ensure_imported  # noqa: E402

PROMPT = "Write a long story about a lighthouse keeper and a storm."


def builtin_pool(data: Path, stages: int, *, leader_env: dict | None = None,
                 fellow_env: dict | None = None) -> Pool:
    """A leader process and ``stages`` `swarm join` processes on this machine (tests/fleet.Pool), with the built-in
    model imported once into ``data``/leader and in the leader's catalogue. Each call starts them afresh in
    ``data``/pool (their logs stay there). The fellows take the threads `swarm join` picks, and do not calibrate
    (it would run beside the first measurements)."""
    ensure_imported(BUILTIN, data / "leader", BUILTIN)
    run = data / "pool"
    shutil.rmtree(run, ignore_errors=True)
    run.mkdir(parents=True)
    env = {"OMP_NUM_THREADS": None, "SWARM_HEARTBEAT_S": None, "SWARM_CALIBRATE": "0", **(fellow_env or {})}
    return Pool(run, data / "leader" / "models" / BUILTIN, stages, leader_env=leader_env, fellow_env=env)


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


def bench_generate(model_dir: Path, tokens: int) -> float:
    import torch

    from reference_model import load_reference_model
    from swarm.leader.chat.chat_format import encode_chat

    model = load_reference_model(model_dir, dtype=torch.float32)
    ids = torch.tensor([encode_chat(model_dir, [{"role": "user", "content": PROMPT}], None)])
    with torch.inference_mode():
        model.generate(ids, max_new_tokens=4, do_sample=False)  # warm-up
        rates = []
        for _ in range(2):
            t0 = time.perf_counter()
            model.generate(ids, max_new_tokens=1, do_sample=False)
            ttft = time.perf_counter() - t0
            t0 = time.perf_counter()
            out = model.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)
            elapsed = time.perf_counter() - t0 - ttft
            rates.append((out.shape[1] - ids.shape[1] - 1) / elapsed)
    return max(rates)


def stream_once(url: str, token: str, content: str, max_tokens: int, timing: list | None = None,
                text: list | None = None) -> tuple[float, float, int]:
    """-> (time to first token, decode tokens/s after the first, completion tokens); swarm.timing appended to
    ``timing``, the reply's text to ``text``."""
    body = {"model": BUILTIN, "messages": [{"role": "user", "content": content}], "temperature": 0,
            "max_tokens": max_tokens, "stream": True}
    t0 = time.perf_counter()
    first = last = None
    usage = None
    pieces: list[str] = []
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=600,
                      headers={"authorization": f"Bearer {token}"}) as response:
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            data = json.loads(line[6:])
            if data["choices"] and data["choices"][0]["delta"].get("content"):
                last = time.perf_counter()
                first = first or last
                pieces.append(data["choices"][0]["delta"]["content"])
            usage = data.get("usage") or usage
            if timing is not None and data.get("swarm"):
                timing.append(data["swarm"]["timing"])
    n = usage["completion_tokens"]
    if text is not None:
        text.append("".join(pieces))
    return first - t0, (n - 1) / (last - first) if last > first else float("nan"), n


def bench_swarm(data: Path, stages: int, transport: str, tokens: int) -> dict:
    pool = builtin_pool(data, stages, leader_env={"SWARM_PIPELINE_TRANSPORT": transport})
    url, token = pool.leader.url, pool.token
    try:
        pool.load(stages)
        # The first chat after a load pays whatever was not warmed up during it; the goal is within 1.5x of later ones.
        first_ttft = stream_once(url, token, "Hi", 4)[0]
        later_ttft = statistics.median(stream_once(url, token, "Hi", 4)[0] for _ in range(3))
        timings: list[dict] = []
        rates = [stream_once(url, token, PROMPT, tokens, timings)[1] for _ in range(3)]
        long_prompt = " ".join(["The quick brown fox jumps over the lazy dog."] * 100)  # ~1,000 tokens
        ttft = min(stream_once(url, token, long_prompt, 2)[0] for _ in range(2))
        rss = [psutil.Process(f.proc.pid).memory_info().rss for f in pool.fellows]
        return {"tok_s": statistics.median(rates), "ttft_1000": ttft, "rss": rss, "first_ttft": first_ttft,
                "later_ttft": later_ttft, "timing": timings[len(timings) // 2]}
    finally:
        pool.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--data-dir", type=Path, default=Path("/tmp/swarm-bench"))
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    data = args.data_dir
    (data / "leader").mkdir(parents=True, exist_ok=True)
    ensure_imported(BUILTIN, data / "leader", BUILTIN)
    model_dir = data / "leader" / "models" / BUILTIN
    print(f"machine: {machine()}")
    print(f"model: {BUILTIN}, float32 on CPU, greedy, {args.tokens} tokens")
    base = bench_generate(model_dir, args.tokens)
    print(f"{'transformers generate, one process':42} {base:6.1f} tok/s")
    for stages, transport in ((1, "auto"), (2, "direct"), (2, "relay")):
        r = bench_swarm(data, stages, transport, args.tokens)
        label = f"swarm, {stages} stage{'s' if stages > 1 else ''}" + (f" ({transport})" if stages > 1 else "")
        rss = ", ".join(f"{b / 2**20:.0f}" for b in r["rss"])
        print(f"{label:42} {r['tok_s']:6.1f} tok/s ({r['tok_s'] / base:.2f}x)   TTFT 1000-token prompt "
              f"{r['ttft_1000']:.2f} s   stage RSS MiB: {rss}   first chat TTFT {r['first_ttft'] * 1000:.0f} ms, "
              f"later {r['later_ttft'] * 1000:.0f} ms")
        t = r["timing"]
        split = sum(s["compute_ms_per_token"] or 0 for s in t["stages"]) + (t["link_ms_per_token"] or 0)
        print(f"{'':42} split: {' · '.join(split_parts(t)) or 'not reported'}   sum {split:.1f} ms of "
              f"{t['ms_per_token']:.1f} ms/token measured by the leader   bytes/token {t['bytes_per_token']}")


if __name__ == "__main__":
    main()
