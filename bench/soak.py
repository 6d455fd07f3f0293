"""Hold the demo under load for a while and see that nothing is lost and nothing leaks.

    .venv/bin/python bench/soak.py [--minutes 5] [--clients 64] [--tokens 48] [--stages 2] [--burst 64]

Starts a leader and ``--stages`` fellow processes on this machine (tests/fleet.Pool) serving the built-in model,
sends a burst of ``--burst`` chats the moment the model is ready (this also warms every path), then runs
``--clients`` clients back to back for ``--minutes``: whole replies and streams, prompts of 10 to 2,000 tokens, some
clients cancelling mid-reply, some going away without a word, some reading slowly (tests/traffic.py). Prints
requests done, refused and failed (by kind), lost (never answered nor refused: must be 0), how many greedy replies
were generate's (identical, cut-off prefix, near-tie: tests/exactness.py), time to first token and latency at
p50/p95, tokens/s, and the resident memory of the leader and each fellow after the burst and at the end.

Goals: 0 lost; 0 failed (refusals only of requests over the pool's limits, in words); no reply that differs from
generate's; memory at the end within 5 % of memory after warm-up; every stage holding no request once traffic ends.
An hour: --minutes 60.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import httpx
import trio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from ring_speed import builtin_pool, machine
from swarm.client import LeaderClient
from swarm.demo import BUILTIN
from swarm.model_import import ensure_imported
from traffic import Traffic, build_prompts, rss_mb

LENGTHS = [10, 40, 120, 300, 700, 1200, 2000]


def held(client: LeaderClient) -> list:
    return [f.get("held") for f in client.get("/api/v1/fellows")["fellows"] if f["state"] == "online"]


async def watch_memory(pids: dict[str, int], t0: float, every_s: float = 60.0) -> None:
    """The processes' resident memory once a minute while traffic runs: a leak shows as a steady climb."""
    while True:
        await trio.sleep(every_s)
        print(f"  {time.perf_counter() - t0:5.0f} s  RSS (MB): {rss_mb(pids)}", flush=True)


def report(title: str, traffic: Traffic, seconds: float) -> None:
    t = traffic.tally()
    print(f"\n{title}: {t['requests']} requests in {seconds:.0f} s")
    print(f"  outcomes: {dict(sorted(t['by_status'].items()))}")
    print(f"  lost: {t['lost']}   failed: {len(t['failed'])} {sorted(set(t['failed'])) or ''}")
    print(f"  greedy replies vs generate: {t['exact']}")
    for line in t["differs"][:5]:
        print(f"    {line}")
    print(f"  time to first token: p50 {t['ttft_s']['p50']} s, p95 {t['ttft_s']['p95']} s")
    print(f"  latency (whole replies and streams read to the end): p50 {t['latency_s']['p50']} s, "
          f"p95 {t['latency_s']['p95']} s")
    print(f"  tokens: {t['tokens']} ({t['tokens'] / seconds:.1f} tok/s in all)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=5.0)
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--burst", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--data-dir", type=Path, default=Path("/tmp/swarm-soak"))
    args = parser.parse_args()
    data = args.data_dir
    (data / "leader").mkdir(parents=True, exist_ok=True)
    ensure_imported(BUILTIN, data / "leader", BUILTIN)
    model_dir = data / "leader" / "models" / BUILTIN
    print(f"machine: {machine()}")
    print(f"model: {BUILTIN}, {args.stages} stages, greedy, {args.tokens} tokens per reply; {args.clients} clients "
          f"for {args.minutes:g} min after a burst of {args.burst}")
    print("computing generate's replies for the prompts ...", flush=True)
    from swarm.leader.chat.chat_format import load_tokenizer

    prompts = build_prompts(model_dir, LENGTHS, args.tokens, eos=[2])
    tokenizer = load_tokenizer(str(model_dir))
    pool = builtin_pool(data, args.stages, fellow_env={"SWARM_HEARTBEAT_S": "1"})
    url, token = pool.leader.url, pool.token
    pids = pool.pids()
    client = LeaderClient(url, token)
    try:
        pool.load(args.stages)

        burst = Traffic(url, token, BUILTIN, prompts, tokenizer, max_tokens=args.tokens,
                        kinds={"whole": 0.5, "stream": 0.5}, deadline_s=1800)
        t0 = time.perf_counter()
        trio.run(lambda: burst.run(args.burst, requests=args.burst))
        report(f"burst of {args.burst} the moment the model was ready", burst, time.perf_counter() - t0)
        time.sleep(3)
        warm = rss_mb(pids)
        print(f"  RSS after the burst (MB): {warm}")

        soak = Traffic(url, token, BUILTIN, prompts, tokenizer, max_tokens=args.tokens, seed=2, deadline_s=1800)
        t0 = time.perf_counter()

        async def soak_and_watch():
            async with trio.open_nursery() as nursery:
                nursery.start_soon(watch_memory, pids, t0)
                await soak.run(args.clients, duration_s=args.minutes * 60)
                nursery.cancel_scope.cancel()

        trio.run(soak_and_watch)
        report(f"{args.clients} clients for {args.minutes:g} min", soak, time.perf_counter() - t0)
        time.sleep(3)  # a heartbeat or two: what the stages hold once traffic ends
        end = rss_mb(pids)
        print(f"  stages hold afterwards: {held(client)}")
        print("  RSS (MB), after warm-up -> end: " + ", ".join(
            f"{name} {warm[name]:.0f} -> {end[name]:.0f} ({(end[name] / warm[name] - 1) * 100:+.1f} %)"
            for name in pids))
    except httpx.HTTPError as exc:
        print(f"the leader stopped answering: {exc}\n{pool.leader.log()}")
        raise SystemExit(1) from None
    finally:
        pool.stop()


if __name__ == "__main__":
    main()
