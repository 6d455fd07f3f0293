"""The planner's prediction (swarm.leader.planner) against the measured speed: the built-in model over 1 and 2
stages. The goal is within 25 %.

    .venv/bin/python bench/plan_vs_measured.py [--tokens 64] [--data-dir /tmp/swarm-bench]

A leader and two fellows in one process (tests/harness.py) with the fellows' calibration on. For each ring: the plan
before loading (links assumed), then the load, a warm-up, a greedy reply of --tokens tokens (steady decode tokens/s)
and a reply to a ~1,000-token prompt (time to first token), then the plan again (links now measured). Prints the
predicted and measured figures and their ratio.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import trio

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from harness import running_swarm  # noqa: E402

from swarm.cli import FELLOW_THREAD_ENV  # noqa: E402

for _name, _value in {**FELLOW_THREAD_ENV, "OMP_WAIT_POLICY": "PASSIVE"}.items():  # as `swarm join` and the tests
    os.environ.setdefault(_name, _value)

from swarm.demo import BUILTIN  # noqa: E402
from swarm.model_import import ensure_imported  # noqa: E402

COUNT = [{"role": "user", "content": "List the numbers from 1 to 80, separated by commas."}]
LONG = [{"role": "user", "content": "Summarise this. " + "The quick brown fox jumps over the lazy dog. " * 98}]


async def plan(swarm, name: str, stages: int) -> dict:
    while True:
        response = await swarm.http.get(f"/api/v1/models/{name}/plan?num_stages={stages}")
        if response.status_code == 200:
            return response.json()
        await trio.sleep(0.5)  # the fellows' calibration is still running


async def bench(model_dir: Path, tmp: Path, tokens: int) -> None:
    name = model_dir.name
    for stages in (1, 2):
        async with running_swarm(tmp / f"s{stages}", [model_dir], fellow_env={"SWARM_CALIBRATE": "1"}) as swarm:
            before = await plan(swarm, name, stages)
            await swarm.load(name, stages)
            await swarm.chat(name, [{"role": "user", "content": "Hi"}], max_tokens=4)  # warm-up
            decode = (await swarm.chat(name, COUNT, max_tokens=tokens, ignore_eos=True))["swarm"]["timing"]
            long = await swarm.chat(name, LONG, max_tokens=2)
            after = await plan(swarm, name, stages)
            ttft = long["swarm"]["timing"]["ttft_ms"] / 1000
            print(f"{stages} stage{'s' if stages > 1 else ''}: {after['text']}", flush=True)
            print(f"  predicted before loading {before['tokens_per_s']:.1f} tok/s, "
                  f"TTFT {before['time_to_first_token_s']:.2f} s; after (links measured) "
                  f"{after['tokens_per_s']:.1f} tok/s, TTFT {after['time_to_first_token_s']:.2f} s", flush=True)
            split = ", ".join(f"{s['compute_ms_per_token']:.1f}" for s in decode["stages"])
            print(f"  measured {decode['tokens_per_s']:.1f} tok/s ({decode['ms_per_token']:.1f} ms/token; "
                  f"stages {split} ms/token), "
                  f"TTFT {ttft:.2f} s for {long['usage']['prompt_tokens']} prompt tokens", flush=True)
            print(f"  predicted/measured: tokens/s {after['tokens_per_s'] / decode['tokens_per_s']:.2f}, "
                  f"TTFT {after['time_to_first_token_s'] / ttft:.2f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--data-dir", type=Path, default=Path("/tmp/swarm-bench"))
    args = parser.parse_args()
    (args.data_dir / "leader").mkdir(parents=True, exist_ok=True)
    ensure_imported(BUILTIN, args.data_dir / "leader", BUILTIN)
    with tempfile.TemporaryDirectory() as tmp:
        trio.run(bench, args.data_dir / "leader" / "models" / BUILTIN, Path(tmp), args.tokens)


if __name__ == "__main__":
    main()
