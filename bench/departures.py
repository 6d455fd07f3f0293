"""What bench/drain_gap.py and bench/failover_pause.py share: a 2-stage ring of the built-in model over three
fellows (one a standby, with or without hot cover), and the token arrivals of one greedy reply at the leader while
something happens to a fellow of the ring."""

from __future__ import annotations

import sys
from contextlib import asynccontextmanager
from pathlib import Path

import trio

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from fleet import FellowProcess  # noqa: E402
from harness import running_swarm, wait_until  # noqa: E402

PROMPT = [{"role": "user", "content": "List the numbers from 1 to 80, separated by commas."}]
TOKENS = 200
SIGNAL_AT = 30


async def reply_arrivals(swarm, name: str, act=None, act_at: int = 30,
                         tokens: int = TOKENS) -> tuple[list[tuple[float, int, int]], float | None, list[int]]:
    """Token arrivals (time, count) at the leader of one greedy reply; ``act()`` runs once ``act_at`` tokens came."""
    times: list[tuple[float, int, int]] = []  # (time, tokens, attempt)
    acted_at = None
    async with trio.open_nursery() as nursery:
        async def chat():
            await swarm.http.post("/v1/chat/completions", timeout=600, json={
                "model": name, "messages": PROMPT, "temperature": 0, "max_tokens": tokens})
            nursery.cancel_scope.cancel()

        nursery.start_soon(chat)
        request = await wait_until(lambda: next(iter(swarm.leader.serving.requests.values()), None), 60)
        seen = (0, 1)
        while True:
            if (len(request.tokens), request.attempts) != seen:
                seen = (len(request.tokens), request.attempts)
                times.append((trio.current_time(), *seen))
            if act is not None and acted_at is None and seen[0] >= act_at:
                act()
                acted_at = trio.current_time()
            await trio.sleep(0.002)
    return times, acted_at, list(request.tokens)


def longest_gap(times: list[tuple[float, int, int]], since: float | None = None) -> float:
    """The longest wait between two token arrivals (from ``since`` on)."""
    arrivals = [(t, n) for i, (t, n, _) in enumerate(times) if i == 0 or n != times[i - 1][1]]
    start = max((i for i, (t, _) in enumerate(arrivals) if since is None or t <= since), default=0)
    return max((b[0] - a[0] for a, b in zip(arrivals[start:], arrivals[start + 1:])), default=0.0)



@asynccontextmanager
async def ring_with_standby(model_dir: Path, work: Path, stage: int, hot_cover: bool, fellow_env: dict | None = None):
    """A leader and fellow-0..2 (fellow-2 a standby) serving ``model_dir`` over 2 stages -> (swarm, the fellow of
    ``stage`` -- with hot cover, of the covered stage instead --, that stage's index)."""
    name = model_dir.name
    env = {"SWARM_SERVE_HOT_COVER": "1"} if hot_cover else {}
    async with running_swarm(work, [model_dir], fellows=0, leader_env=env) as swarm:
        join = swarm.join_token(uses=3)
        fellows = [FellowProcess(swarm.url, join, work / f"fellow-{i}", f"fellow-{i}", standby=i == 2,
                                 env=fellow_env).start() for i in range(3)]
        try:
            await wait_until(lambda: len(swarm.leader.hub.online) == 3, 120)
            placed = [s["fellow"] for s in (await swarm.load(name, 2))["stages"]]
            if hot_cover:
                await wait_until(lambda: any(s.cover_ready for s in swarm.leader.serving.models[name].stages), 120)
                stage = next(i for i, s in enumerate(swarm.leader.serving.models[name].stages) if s.cover_ready)
            yield swarm, next(f for f in fellows if f.name == placed[stage]), stage
        finally:
            for f in fellows:
                f.stop()
