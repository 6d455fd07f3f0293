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
import sys
import tempfile
from pathlib import Path

import trio

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from fleet import FellowProcess  # noqa: E402
from harness import running_swarm, wait_until  # noqa: E402

PROMPT = [{"role": "user", "content": "List the numbers from 1 to 80, separated by commas."}]


async def one_run(model_dir: Path, work: Path, stage: int, hot_cover: bool) -> float:
    name = model_dir.name
    env = {"SWARM_SERVE_HOT_COVER": "1"} if hot_cover else {}
    async with running_swarm(work, [model_dir], fellows=0, leader_env=env) as swarm:
        join = swarm.join_token(uses=3)
        fellows = [FellowProcess(swarm.url, join, work / f"fellow-{i}", f"fellow-{i}", standby=i == 2).start()
                   for i in range(3)]
        try:
            await wait_until(lambda: len(swarm.leader.hub.online) == 3, 120)
            placed = [s["fellow"] for s in (await swarm.load(name, 2))["stages"]]
            if hot_cover:
                await wait_until(lambda: any(s.cover_ready for s in swarm.leader.serving.models[name].stages), 120)
                stage = next(i for i, s in enumerate(swarm.leader.serving.models[name].stages) if s.cover_ready)
            victim = next(f for f in fellows if f.name == placed[stage])
            times: list[tuple[float, int]] = []
            async with trio.open_nursery() as nursery:
                async def chat():
                    await swarm.http.post("/v1/chat/completions", timeout=600, json={
                        "model": name, "messages": PROMPT, "temperature": 0, "max_tokens": 200})
                    nursery.cancel_scope.cancel()

                nursery.start_soon(chat)
                request = await wait_until(lambda: next(iter(swarm.leader.serving.requests.values()), None), 60)
                seen = 0
                killed_at = None
                while True:
                    if len(request.tokens) != seen:
                        seen = len(request.tokens)
                        times.append((trio.current_time(), seen))
                    if killed_at is None and seen >= 40:
                        victim.kill()
                        killed_at = trio.current_time()
                    await trio.sleep(0.002)
            before = max(t for t, _ in times if t <= killed_at)
            after = min(t for t, _ in times if t > killed_at)
            return after - before
        finally:
            for f in fellows:
                f.stop()


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
