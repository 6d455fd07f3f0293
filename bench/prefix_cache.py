"""The prefix cache: time to first token of a long chat and of agent-like calls, with and without the cache.

    .venv/bin/python bench/prefix_cache.py [--turns 20] [--tokens 48] [--prefix 2000] [--calls 10]

Runs the built-in model over 2 stages (a leader and two fellows in one process, tests/harness.py) twice: with the
prefix cache (the default) and without it (SWARM_SERVE_PREFIX_CACHE_TOKENS=0). In each:

- a chat of ``--turns`` turns, each sending the whole conversation so far (greedy replies of ``--tokens``): the
  time to first token of every turn (swarm.timing.ttft_ms) and the prompt tokens the cache held. Goal: turn 20's
  time to first token at most 0.2x the one without the cache;
- ``--calls`` calls sharing a ``--prefix``-token prefix (a long system prompt), each with its own short question,
  as an agent sends them: the time to first token of calls 2.. against call 1.

Replies are the same with and without the cache (checked here too).

``--processes``: the fellows are real `swarm join` processes (tests/fleet.py; the leader in this process), the way a
swarm runs. ``--no-baseline`` skips the run without the cache (on a busy machine the shared-prefix calls are then
judged against call 1, their own cold start); ``--turns 0`` or ``--calls 0`` leave either part out.

``--in-process``: the prefill alone, in one process (a LocalRing over 2 stages, no leader): each turn's time to first
token (max_tokens 1) with and without the prefix cache, the assistant's turns a fixed sentence -- for a machine too
busy for the whole swarm's figures to mean anything.
"""

from __future__ import annotations

import contextlib
import platform
import statistics

from builtin_swarm import main
from harness import running_swarm
from swarm.demo import BUILTIN

QUESTIONS = ["Name a planet.", "Why is the sky blue?", "Give me a word that rhymes with cat.", "What is 7 times 8?",
             "Name a famous painter.", "What do bees make?", "Say hello in French.", "Name an ocean.",
             "What is the opposite of hot?", "How many days are in a week?"]


async def one(swarm, messages: list[dict], tokens: int) -> tuple[str, dict, dict]:
    body = {"model": BUILTIN, "messages": messages, "temperature": 0, "max_tokens": tokens}
    response = await swarm.http.post("/v1/chat/completions", json=body, timeout=900)
    assert response.status_code == 200, response.text
    data = response.json()
    return data["choices"][0]["message"]["content"], data["usage"], data["swarm"]["timing"]


@contextlib.asynccontextmanager
async def two_stage_swarm(model_dir, tmp, args, env: dict):
    """A leader with the built-in model loaded over two stages: fellows in this process, or ``--processes``."""
    fellows = 0 if args.processes else 2
    async with running_swarm(tmp, [model_dir], fellows=fellows, leader_env=env) as swarm:
        if not args.processes:
            await swarm.load(BUILTIN, 2, timeout=900)  # a busy machine loads slowly
            yield swarm
            return
        from fleet import fellow_fleet

        async with fellow_fleet(swarm, tmp, 2) as _:
            await swarm.load(BUILTIN, 2, timeout=900)
            yield swarm


async def run(model_dir, tmp, args, cache: bool) -> dict:
    env = {} if cache else {"SWARM_SERVE_PREFIX_CACHE_TOKENS": "0"}
    env["SWARM_REQUEST_STALL_S"] = "1200"  # an 8,000-token prefill on a busy 2-core machine takes minutes
    env["SWARM_SERVE_CONTEXT_TOKENS"] = "8192"  # the built-in model's own: --prefix 6550 makes ~8,000 tokens
    async with two_stage_swarm(model_dir, tmp / ("cache" if cache else "none"), args, env) as swarm:
        await one(swarm, [{"role": "user", "content": "Hi"}], 4)  # warm-up
        chat: list[dict] = []
        turns = []
        for turn in range(args.turns):
            chat.append({"role": "user", "content": QUESTIONS[turn % len(QUESTIONS)] + f" (turn {turn + 1})"})
            text, usage, timing = await one(swarm, chat, args.tokens)
            chat.append({"role": "assistant", "content": text})
            print(f"{'cache' if cache else 'none'} turn {turn + 1}: {timing['ttft_ms']} ms", flush=True)
            turns.append((usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"], timing["ttft_ms"],
                          text))
        system = " ".join(f"Rule {i}: answer briefly and politely." for i in range(args.prefix // 9))
        calls = []
        for call in range(args.calls):
            messages = [{"role": "system", "content": system}, {"role": "user", "content": QUESTIONS[call]}]
            text, usage, timing = await one(swarm, messages, 8)
            print(f"{'cache' if cache else 'none'} call {call + 1}: {usage['prompt_tokens']} tokens, "
                  f"{usage['prompt_tokens_details']['cached_tokens']} cached, {timing['ttft_ms']} ms", flush=True)
            calls.append((usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"], timing["ttft_ms"],
                          text))
        return {"turns": turns, "calls": calls}


def in_process(model_dir, args) -> None:
    import time

    from swarm.leader.chat.chat_format import encode_chat
    from swarm.leader.serving.prefix_index import PrefixIndex
    from swarm.stage import LocalRing, StageModel, stage_specs

    def ring() -> LocalRing:
        return LocalRing([StageModel.load_dir(model_dir, s) for s in stage_specs(30, 2)], prefill_chunk=256)

    cold, hot, index = ring(), ring(), PrefixIndex()
    chat: list[dict] = []
    print("turn: prompt tokens, cached, TTFT with cache, TTFT without, ratio", flush=True)
    for turn in range(args.turns):
        chat.append({"role": "user", "content": QUESTIONS[turn % len(QUESTIONS)] + f" (turn {turn + 1})"})
        prompt = encode_chat(model_dir, chat, None)
        took = []
        for name, r, plan in (("none", cold, None), ("cache", hot, index.plan(f"t{turn}", prompt, 1 << 30))):
            began = time.perf_counter()
            r.submit(f"{name}{turn}", prompt, 1, prefix=plan)
            r.run()
            took.append(time.perf_counter() - began)
        cached = index.cached_tokens(f"t{turn}")
        index.first_token(f"t{turn}")
        index.ended(f"t{turn}")
        print(f"turn {turn + 1:2d}: {len(prompt):5d} {cached:5d} {took[1] * 1000:8.0f} ms "
              f"{took[0] * 1000:8.0f} ms {took[1] / took[0]:5.2f}x", flush=True)
        chat.append({"role": "assistant", "content": "Here is a short and friendly answer to that question, " * 3})
    system = " ".join(f"Rule {i}: answer briefly and politely." for i in range(args.prefix // 9))
    print("calls sharing a prefix, with the cache: prompt tokens, cached, TTFT", flush=True)
    took = []
    for call in range(args.calls):
        prompt = encode_chat(model_dir, [{"role": "system", "content": system},
                                         {"role": "user", "content": QUESTIONS[call % len(QUESTIONS)]}], None)
        plan = index.plan(f"c{call}", prompt, 1 << 30)
        cached = index.cached_tokens(f"c{call}")
        began = time.perf_counter()
        hot.submit(f"c{call}", prompt, 1, prefix=plan)
        hot.run()
        took.append(time.perf_counter() - began)
        index.first_token(f"c{call}")
        index.ended(f"c{call}")
        print(f"call {call + 1:2d}: {len(prompt):5d} {cached:5d} {took[-1] * 1000:8.0f} ms", flush=True)
    rest = sorted(took[1:])[len(took[1:]) // 2] if len(took) > 1 else took[0]
    print(f"calls 2-{len(took)}: median {rest * 1000:.0f} ms against call 1's {took[0] * 1000:.0f} ms "
          f"({rest / took[0]:.2f}x)", flush=True)


async def bench(model_dir, tmp, args) -> None:
    print(f"machine: {platform.machine()} {platform.processor() or ''}, python {platform.python_version()}")
    if args.in_process:
        in_process(model_dir, args)
        return
    with_cache = await run(model_dir, tmp, args, cache=True)
    without = await run(model_dir, tmp, args, cache=False) if args.baseline else None
    if with_cache["turns"]:
        print("\nchat turns: prompt tokens, cached, TTFT with cache, TTFT without, ratio")
        for i, a in enumerate(with_cache["turns"]):
            b = without["turns"][i] if without else None
            assert b is None or a[3] == b[3], f"turn {i + 1}: the replies differ with and without the cache"
            print(f"turn {i + 1:2d}: {a[0]:5d} {a[1]:5d} {a[2]:8.0f} ms" +
                  (f" {b[2]:8.0f} ms {a[2] / b[2]:5.2f}x" if b else ""))
        if without:
            last_a, last_b = with_cache["turns"][-1], without["turns"][-1]
            print(f"turn {len(with_cache['turns'])}: {last_a[2]:.0f} ms with the cache, {last_b[2]:.0f} ms without "
                  f"({last_a[2] / last_b[2]:.2f}x; goal at most 0.2x)")
    if with_cache["calls"]:
        print("\nshared-prefix calls: prompt tokens, cached, TTFT with cache, TTFT without")
        for i, a in enumerate(with_cache["calls"]):
            b = without["calls"][i] if without else None
            assert b is None or a[3] == b[3], f"call {i + 1}: the replies differ with and without the cache"
            print(f"call {i + 1:2d}: {a[0]:5d} {a[1]:5d} {a[2]:8.0f} ms" + (f" {b[2]:8.0f} ms" if b else ""))
        rest = statistics.median(c[2] for c in with_cache["calls"][1:]) if len(with_cache["calls"]) > 1 else 0
        first = with_cache["calls"][0][2]
        baseline = f"; without the cache median {statistics.median(c[2] for c in without['calls']):.0f} ms" \
            if without else ""
        print(f"calls 2-{len(with_cache['calls'])}: median TTFT {rest:.0f} ms against call 1's {first:.0f} ms "
              f"({rest / first:.3f}x){baseline}")


if __name__ == "__main__":
    def options(parser):
        parser.add_argument("--turns", type=int, default=20)
        parser.add_argument("--prefix", type=int, default=2000, help="tokens of the calls' shared prefix (about)")
        parser.add_argument("--calls", type=int, default=10)
        parser.add_argument("--in-process", action="store_true", help="the prefill alone, in one process")
        parser.add_argument("--processes", action="store_true", help="the fellows as `swarm join` processes")
        parser.add_argument("--no-baseline", dest="baseline", action="store_false",
                            help="no run without the cache")

    main(bench, __doc__, options)
