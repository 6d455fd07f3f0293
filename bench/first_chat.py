"""The first chat after a load against the later ones: time to first token, as the page meets it right after
`swarm demo`.

    .venv/bin/python bench/first_chat.py [--stages 2] [--chats 5] [--quantization KIND] [--no-calibrate]
                                         [--env K=V ...] [--data-dir /tmp/swarm-bench]

Starts a leader and ``--stages`` fellow processes on this machine as the demo does (tests/fleet.Pool; the fellows
calibrate when they join unless ``--no-calibrate``), loads the built-in model, and as soon as it is ready sends
``--chats`` short greedy chats one after another, each a different question (no prompt shares a cached prefix with
an earlier one beyond the chat template). Prints each chat's time to first token, the first one's against the median
of the later ones (the goal: within 1.5x on a quiet machine), and where the first token's time went as the fellows
measured it (swarm.timing).
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "bench")]

from ring_speed import builtin_pool, machine  # noqa: E402
from swarm.demo import BUILTIN  # noqa: E402

QUESTIONS = ["Hi, who are you?", "What is the capital of France?", "Name a colour.", "How many legs has a spider?",
             "Say something kind.", "What is two plus two?", "Name a fruit.", "What day comes after Monday?"]


def first_token(url: str, token: str, content: str, max_tokens: int = 4) -> tuple[float, dict | None]:
    """-> (seconds to the first streamed token, the reply's swarm.timing)."""
    body = {"model": BUILTIN, "messages": [{"role": "user", "content": content}], "temperature": 0,
            "max_tokens": max_tokens, "stream": True}
    t0 = time.perf_counter()
    first = None
    timing = None
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=600,
                      headers={"authorization": f"Bearer {token}"}) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            data = json.loads(line[6:])
            if first is None and data["choices"] and data["choices"][0]["delta"].get("content"):
                first = time.perf_counter() - t0
            if data.get("swarm"):
                timing = data["swarm"].get("timing") or timing
    return (first if first is not None else float("nan")), timing


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--chats", type=int, default=5)
    parser.add_argument("--quantization", default=None, help="the load's quantization (default: the leader's)")
    parser.add_argument("--no-calibrate", action="store_true", help="fellows skip their calibration at join")
    parser.add_argument("--env", action="append", default=[], help="K=V for the fellows")
    parser.add_argument("--data-dir", type=Path, default=Path("/tmp/swarm-bench"))
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    env = {"SWARM_CALIBRATE": "0" if args.no_calibrate else "1", **dict(kv.split("=", 1) for kv in args.env)}
    print(f"machine: {machine()}")
    print(f"model: {BUILTIN}, {args.stages} stage(s), quantization {args.quantization or 'default'}, "
          f"fellow env {env}")
    pool = builtin_pool(args.data_dir, args.stages, fellow_env=env)
    try:
        began = time.perf_counter()
        body = {"num_stages": args.stages, **({"quantization": args.quantization} if args.quantization else {})}
        assert pool.http.post(f"/api/v1/models/{pool.name}/load", json=body).status_code == 202
        while pool.status() != "ready":
            time.sleep(0.01)
        print(f"load: ready in {time.perf_counter() - began:.1f} s")
        results = [first_token(pool.leader.url, pool.token, QUESTIONS[i % len(QUESTIONS)])
                   for i in range(args.chats)]
        for i, (ttft, timing) in enumerate(results):
            split = ""
            if timing:
                stages = " · ".join(f"stage {s.get('index', j)} {s.get('compute_ms_per_token')} ms/token"
                                    for j, s in enumerate(timing.get("stages") or []))
                split = f"   prompt {timing.get('prompt_ms')} ms   {stages}"
            print(f"chat {i + 1}: first token after {ttft * 1000:7.0f} ms{split}")
        later = statistics.median(t for t, _ in results[1:])
        first = results[0][0]
        print(f"first chat {first * 1000:.0f} ms, later chats {later * 1000:.0f} ms (median): {first / later:.2f}x "
              f"(goal <= 1.5x)")
    finally:
        pool.stop()


if __name__ == "__main__":
    main()
