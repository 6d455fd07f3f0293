"""How long a reply pauses when the fellow of one of its stages is killed (kill -9), with and without hot cover.

    .venv/bin/python bench/failover_pause.py [--runs 3] [--stage 1]

A leader and three fellows (one a standby) on this machine serve the built-in model over 2 stages; a greedy reply of
200 tokens is cut ~40 tokens in by killing the fellow of ``--stage``. The pause is the time from the last token
before the kill to the first token after it, as the leader streams them. Without hot cover the standby fetches and
loads the stage (from its cache after the first run: the files are kept by hash); with hot cover
(SWARM_SERVE_HOT_COVER=1) it already holds the stage and the ring is only rewired. Goals: under 30 s and 3 s.
"""

from __future__ import annotations

import argparse
import platform
import shutil
import statistics
import tempfile
from pathlib import Path

import trio

from departures import reply_arrivals, ring_with_standby


async def one_run(model_dir: Path, work: Path, stage: int, hot_cover: bool) -> float:
    async with ring_with_standby(model_dir, work, stage, hot_cover) as (swarm, victim, _):
        times, killed_at, _ = await reply_arrivals(swarm, model_dir.name, victim.kill, 40)
    assert killed_at is not None, "the reply ended before the kill"
    before = max(t for t, _, _ in times if t <= killed_at)
    after = min(t for t, _, _ in times if t > killed_at)
    return after - before


async def main(args) -> None:
    from swarm.store.importer import import_model

    root = Path(tempfile.mkdtemp(prefix="swarm-failover-"))
    try:
        import_model("smollm2-135m-instruct", root / "models")
        model_dir = root / "models" / "smollm2-135m-instruct"
        print(f"machine: {platform.processor() or platform.machine()}, {platform.system()}; stage killed: "
              f"{args.stage} (hot cover: the covered stage)")
        for hot in (False, True):
            pauses = []
            for run in range(args.runs):
                pauses.append(await one_run(model_dir, root / f"{'hot' if hot else 'cold'}-{run}", args.stage, hot))
            print(f"{'hot cover' if hot else 'standby loads the stage'}: pause "
                  f"{statistics.median(pauses):.2f} s median ({', '.join(f'{p:.2f}' for p in pauses)})")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--stage", type=int, default=1)
    trio.run(main, parser.parse_args())
