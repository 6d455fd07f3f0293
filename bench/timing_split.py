"""Where each token's time goes (swarm.timing), against the time per token the leader measured: the built-in model
over 2 stages on the relay, 2 stages on the direct link, and 1 stage.

    .venv/bin/python bench/timing_split.py [--tokens 64] [--runs 2] [--data-dir /tmp/swarm-bench]

A leader and two fellows in one process (tests/harness.py), greedy replies of --tokens tokens. Prints, per reply:
the leader's steady tokens/s and ms per token, each stage's compute per token and prompt time, each link's ms per
token and transport, bytes per token forward and back, and the split's sum against the measured ms per token.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from builtin_swarm import COUNT, main  # first: puts tests/ on the import path
from harness import running_swarm


async def bench(model_dir: Path, tmp: Path, args: argparse.Namespace) -> None:
    for transport, stages in (("relay", 2), ("auto", 2), ("auto", 1)):
        async with running_swarm(tmp / f"{transport}-{stages}", [model_dir],
                                 leader_env={"SWARM_PIPELINE_TRANSPORT": transport}) as swarm:
            await swarm.load(model_dir.name, stages)
            await swarm.chat(model_dir.name, [{"role": "user", "content": "Hi"}], max_tokens=4)  # warm-up
            for _ in range(args.runs):
                data = await swarm.chat(model_dir.name, COUNT, max_tokens=args.tokens, ignore_eos=True)
                t = data["swarm"]["timing"]
                split = sum(s["compute_ms_per_token"] for s in t["stages"]) + (t["link_ms_per_token"] or 0)
                stages_text = ", ".join(f"stage {s['stage']} on {s['fellow']} {s['compute_ms_per_token']:.1f} ms/token "
                                        f"(prompt {s['prefill_ms']:.0f} ms)" for s in t["stages"])
                links = ", ".join(f"{link['transport']} {link['ms_per_token']:.2f}" for link in t["links"])
                print(f"{stages} stage{'s' if stages > 1 else ''} ({transport}): {t['tokens_per_s']:.2f} tok/s = "
                      f"{t['ms_per_token']:.1f} ms/token; split {split:.1f} ms = {stages_text}"
                      + (f", links {t['link_ms_per_token']:.2f} ms ({links})" if t["links"] else "")
                      + f"; bytes/token {json.dumps(t['bytes_per_token'])}; TTFT {t['ttft_ms']:.0f} ms", flush=True)


if __name__ == "__main__":
    main(bench, __doc__, lambda parser: parser.add_argument("--runs", type=int, default=2, help="replies per ring"))
