"""Sampled choices of one long prompt: the time to their first tokens with the prompt prefilled once (one request
with n=4, a group on the ring) against four requests of their own (what n=4 sampled ran as before the group start).

    .venv/bin/python bench/group_prefill.py [--stages 2] [--words 760] [--rounds 3]

Starts a leader and ``--stages`` fellow processes on this machine (tests/fleet.Pool), serves the built-in model, and
alternates: one streamed chat with n=4 (temperature 0.8, a seed), then four streamed chats at once, each n=1 with
the seed choice i of the first gets (so both draw the same replies). Prints, per round and as medians, the time
until the first choice's first token and until every choice has its first token.
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

from ring_speed import builtin_pool, machine
from swarm.demo import BUILTIN
from swarm.leader.api.openai_params import choice_seed

SEED = 1234
STORY = ("The lighthouse keeper climbed the narrow stairs every evening, counting the steps and listening to the sea "
         "below, while the gulls circled the lamp and the fishing boats came home one by one. ")


def chat(url: str, token: str, prompt: str, n: int, seed: int, out: dict) -> None:
    """One streamed chat; ``out``: when it was sent, each choice's first token time, the prompt's token count."""
    body = {"model": BUILTIN, "messages": [{"role": "user", "content": prompt}], "temperature": 0.8, "seed": seed,
            "n": n, "max_tokens": 4, "stream": True, "ignore_eos": True}
    out["start"] = time.perf_counter()
    out["first"] = {}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=900,
                      headers={"authorization": f"Bearer {token}"}) as response:
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            data = json.loads(line[6:])
            for item in data.get("choices", []):
                if item["delta"].get("content") or item.get("finish_reason"):
                    out["first"].setdefault(item["index"], time.perf_counter())
            if data.get("usage"):
                out["prompt_tokens"] = data["usage"]["prompt_tokens"]


def grouped(url: str, token: str, prompt: str) -> tuple[float, float, int]:
    out: dict = {}
    chat(url, token, prompt, 4, SEED, out)
    firsts = sorted(out["first"].values())
    return firsts[0] - out["start"], firsts[-1] - out["start"], out["prompt_tokens"]


def separate(url: str, token: str, prompt: str) -> tuple[float, float]:
    outs = [{} for _ in range(4)]
    seeds = [SEED] + [choice_seed(SEED, i) for i in range(1, 4)]
    threads = [threading.Thread(target=chat, args=(url, token, prompt, 1, seed, out)) for seed, out in zip(seeds, outs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    start = min(o["start"] for o in outs)
    firsts = sorted(o["first"][0] for o in outs)
    return firsts[0] - start, firsts[-1] - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--words", type=int, default=760, help="the prompt's length in words (~1,000 tokens)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--data-dir", type=Path, default=Path("/tmp/swarm-bench-group"))
    args = parser.parse_args()
    words = STORY.split()
    prompt = "Continue this story.\n\n" + " ".join(words[i % len(words)] for i in range(args.words))
    print(f"machine: {machine()}")
    pool = builtin_pool(args.data_dir, args.stages)
    url, token = pool.leader.url, pool.token
    try:
        pool.load(args.stages)
        grouped(url, token, "Say hello.")  # warm the path
        rows = {"group": [], "separate": []}
        prompt_tokens = 0
        for r in range(args.rounds):
            first, every, prompt_tokens = grouped(url, token, prompt)
            rows["group"].append((first, every))
            rows["separate"].append(separate(url, token, prompt))
            print(f"round {r + 1}: n=4 as one group: first token {first:.2f} s, every choice {every:.2f} s; "
                  f"four requests: first {rows['separate'][-1][0]:.2f} s, every {rows['separate'][-1][1]:.2f} s")
        print(f"model {BUILTIN}, float32 on CPU, {args.stages} stages, a {prompt_tokens}-token prompt, n=4 sampled")
        for name, label in (("separate", "four requests (before)"), ("group", "one group (now)")):
            first = statistics.median(f for f, _ in rows[name])
            every = statistics.median(e for _, e in rows[name])
            print(f"{label:24s} first token {first:6.2f} s   every choice's first token {every:6.2f} s")
    finally:
        pool.stop()


if __name__ == "__main__":
    main()
