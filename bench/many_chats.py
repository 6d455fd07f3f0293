"""Several chats at once on the demo's ring: tokens per second in all, and each chat's own speed.

    .venv/bin/python bench/many_chats.py [--stages 2] [--tokens 64] [--concurrency 1,2,4,8] [--env K=V ...]

Starts a leader and ``--stages`` fellow processes on this machine (tests/fleet.Pool), serves the built-in model, and
for each concurrency sends that many greedy chats at once (different prompts, ``--tokens`` each, no early stop).
Prints tokens/s in all, the slowest chat's steady rate, and the ratio to one chat; and, for reference, transformers'
`generate` in one process. ``--env`` sets variables for the fellows (e.g. OMP_WAIT_POLICY=ACTIVE, SWARM_THREADS=1,
SWARM_SERVE_MAX_BATCH=1) to compare how fellows share the machine. Goals: 4 chats >= 2.5x one chat in all, 8 chats
>= 3.5x, each chat >= half the speed of a lone one; one chat >= 0.95x generate.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from ring_speed import bench_generate, builtin_pool, machine
from swarm.demo import BUILTIN
from swarm.model_import import ensure_imported

TOPICS = ["a lighthouse keeper", "a dragon who bakes", "the first city on Mars", "a clockmaker's apprentice",
          "a storm at sea", "a lost library", "a robot gardener", "two rival chess players"]


def chat(url: str, token: str, topic: str, tokens: int, out: dict) -> None:
    body = {"model": BUILTIN, "messages": [{"role": "user", "content": f"Write a long story about {topic}."}],
            "temperature": 0, "max_tokens": tokens, "stream": True, "ignore_eos": True}
    t0 = time.perf_counter()
    times = []
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=900,
                      headers={"authorization": f"Bearer {token}"}) as response:
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                data = json.loads(line[6:])
                if data["choices"] and data["choices"][0]["delta"].get("content"):
                    times.append(time.perf_counter())
                if data.get("usage"):
                    out["tokens"] = data["usage"]["completion_tokens"]
    out["start"], out["first"], out["last"] = t0, times[0], times[-1]


def run_round(url: str, token: str, n: int, tokens: int) -> dict:
    results = [{} for _ in range(n)]
    threads = [threading.Thread(target=chat, args=(url, token, TOPICS[i % len(TOPICS)], tokens, results[i]))
               for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    total = sum(r["tokens"] for r in results)
    span = max(r["last"] for r in results) - min(r["start"] for r in results)
    steady = [(r["tokens"] - 1) / (r["last"] - r["first"]) for r in results]
    return {"all": total / span, "slowest": min(steady), "median": statistics.median(steady)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--concurrency", default="1,2,4,8")
    parser.add_argument("--env", action="append", default=[], help="K=V for the fellows")
    parser.add_argument("--no-generate", action="store_true", help="skip the one-process reference")
    parser.add_argument("--data-dir", type=Path, default=Path("/tmp/swarm-bench"))
    args = parser.parse_args()
    env = dict(kv.split("=", 1) for kv in args.env)
    data = args.data_dir
    (data / "leader").mkdir(parents=True, exist_ok=True)
    ensure_imported(BUILTIN, data / "leader", BUILTIN)
    print(f"machine: {machine()}")
    print(f"model: {BUILTIN}, float32 on CPU, greedy, {args.tokens} tokens per chat, {args.stages} stages, "
          f"fellow env {env or 'default'}")
    if not args.no_generate:
        base = bench_generate(data / "leader" / "models" / BUILTIN, args.tokens)
        print(f"transformers generate, one process: {base:.1f} tok/s")
    pool = builtin_pool(data, args.stages, fellow_env=env)
    url, token = pool.leader.url, pool.token
    try:
        pool.load(args.stages)
        run_round(url, token, 1, 8)  # warm the path
        lone = None
        for n in [int(c) for c in args.concurrency.split(",")]:
            r = run_round(url, token, n, args.tokens)
            lone = lone or r["median"]
            print(f"{n} chat{'s' if n > 1 else ' '} at once: {r['all']:6.1f} tok/s in all ({r['all'] / lone:4.2f}x one "
                  f"chat); each chat {r['median']:5.1f} tok/s median, slowest {r['slowest']:5.1f} "
                  f"({r['slowest'] / lone:.2f}x a lone chat)")
    finally:
        pool.stop()


if __name__ == "__main__":
    main()
