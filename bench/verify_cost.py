"""What spot checks (SWARM_SERVE_VERIFY) cost the decode speed: off, 0.02 and 0.1.

    .venv/bin/python bench/verify_cost.py [--tokens 64] [--chats 3]

A leader and three fellows in this process serve the built-in model over 2 stages, float32 on CPU; the third fellow
is a standby holding a copy of one stage, the checker. The fractions alternate (set through the admin API): each round
runs one greedy chat at off, 0.02 and 0.1, in a rotating order, so that the machine's swings fall on all three alike;
the figure is each reply's tokens per second over its whole request (a short prompt's prefill included), and how
many checks ran. The checked stage copies its inputs and sends samples after each picked
pass, and the checker recomputes them on the same machine's cores: on a pool of separate PCs only the first costs the
ring.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import trio

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from harness import running_swarm, wait_until  # noqa: E402
from swarm.config import Settings  # noqa: E402
from swarm.fellow.process import Fellow  # noqa: E402

PROMPT = [{"role": "user", "content": "List the numbers from 1 to 80, separated by commas."}]
FRACTIONS = (0.0, 0.02, 0.1)


async def run(model_dir: Path, work: Path, tokens: int, chats: int) -> dict[float, tuple[list[float], int]]:
    name = model_dir.name
    results: dict[float, tuple[list[float], int]] = {}
    async with running_swarm(work, [model_dir], fellows=2) as swarm, trio.open_nursery() as nursery:
        settings = Settings.from_env({"SWARM_SERVE_PORT": "0", "SWARM_HEARTBEAT_S": "1", "SWARM_CALIBRATE": "0"})
        standby = Fellow(leader_url=swarm.url, data_dir=work / "fellow-2", settings=settings, name="fellow-2",
                         join_token=swarm.join_token(), standby=True)
        await nursery.start(standby.run)
        await standby.connected.wait()
        await swarm.http.put("/api/v1/verification", json={"fraction": 0.02})  # the checker loads its copy
        await swarm.load(name, 2, timeout=600)
        model = swarm.leader.serving.models[name]
        await wait_until(lambda: any(s.cover_ready for s in model.stages), 180)
        verifier = swarm.leader.serving.verifier
        await swarm.chat(name, PROMPT, max_tokens=8)  # warm up
        speeds: dict[float, list[float]] = {f: [] for f in FRACTIONS}
        checks = dict.fromkeys(FRACTIONS, 0)
        for round_ in range(chats):
            order = FRACTIONS[round_ % len(FRACTIONS):] + FRACTIONS[:round_ % len(FRACTIONS)]
            for fraction in order:
                await swarm.http.put("/api/v1/verification", json={"fraction": fraction})
                before = verifier.checks
                began = time.perf_counter()
                reply = await swarm.chat(name, PROMPT, max_tokens=tokens)
                speeds[fraction].append(reply["usage"]["completion_tokens"] / (time.perf_counter() - began))
                await wait_until(lambda: not verifier.outstanding, 120)  # its checks end before the next chat
                checks[fraction] += verifier.checks - before
                print(f"round {round_ + 1} F={fraction}: {speeds[fraction][-1]:.1f} tok/s, "
                      f"{verifier.checks - before} checks, {verifier.failures} failures", flush=True)
        results.update({f: (speeds[f], checks[f]) for f in FRACTIONS})
        nursery.cancel_scope.cancel()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--chats", type=int, default=3, help="rounds: chats per fraction")
    args = parser.parse_args()
    from swarm.store.importer import import_model

    with tempfile.TemporaryDirectory() as tmp:
        import_model("smollm2-135m-instruct", Path(tmp) / "models")
        model_dir = Path(tmp) / "models" / "smollm2-135m-instruct"
        results = trio.run(run, model_dir, Path(tmp) / "work", args.tokens, args.chats)
    print(f"machine: {platform.processor() or platform.machine()}, {platform.system()}")
    off = statistics.median(results[0.0][0])
    for fraction, (speeds, checks) in results.items():
        median = statistics.median(speeds)
        print(f"F={fraction:g}: median {median:.1f} tok/s ({median / off:.2f}x off), {checks} checks")


if __name__ == "__main__":
    main()
