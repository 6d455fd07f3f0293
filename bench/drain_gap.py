"""How long a streamed reply pauses when the fellow of one of its stages leaves (SIGTERM: it hands the stage over
first), with and without hot cover; beside it, the same reply's longest gap with nobody leaving.

    .venv/bin/python bench/drain_gap.py [--runs 3] [--stage 1] [--hot-only] [--no-token-wait] [--no-kv-handover]

A leader and three fellows (one a standby) on this machine serve the built-in model over 2 stages; a greedy reply of
200 tokens gets SIGTERM sent to the fellow of ``--stage`` ~30 tokens in. Without hot cover the standby loads the
stage while the old one serves, then the ring switches; with hot cover (SWARM_SERVE_HOT_COVER=1) the standby holds
the stage already and the ring switches at once. The figure is the longest gap between two of the reply's token
arrivals at the leader from the signal to the end, against the longest gap of an uninterrupted reply.
Goals (issue 37): under 0.5 s with hot cover; without it, a pause for the switch only, not for the load.
--no-token-wait switches as soon as the taker is ready (the way before the switch waited for a token boundary,
swarm.leader.serving.drain.TOKEN_WAIT_S), for a before/after on the same machine; --no-kv-handover switches without
handing the requests' KV over (swarm.leader.serving.kv_carry), the new ring prefilling all they streamed, as before.
"""

from __future__ import annotations

import argparse
import platform
import shutil
import signal
import statistics
import tempfile
from pathlib import Path

import trio

from departures import reply_arrivals, ring_with_standby

SIGNAL_AT = 30


def longest_gap(times: list[tuple[float, int, int]], since: float | None = None) -> float:
    """The longest wait between two token arrivals (from ``since`` on)."""
    arrivals = [(t, n) for i, (t, n, _) in enumerate(times) if i == 0 or n != times[i - 1][1]]
    start = 0 if since is None else max((i for i, (t, _) in enumerate(arrivals) if t <= since), default=0)
    return max((b[0] - a[0] for a, b in zip(arrivals[start:], arrivals[start + 1:])), default=0.0)


def switch_gap(times: list[tuple[float, int, int]]) -> float:
    """From the old ring's last token to the new ring's first (the request's second attempt)."""
    resumed = next(i for i, (_, _, attempt) in enumerate(times) if attempt == 2)
    last_old = max(t for t, n, _ in times[:resumed] if n == times[resumed][1])
    return first_new_token_at(times) - last_old


def first_new_token_at(times: list[tuple[float, int, int]]) -> float:
    """When the new ring's first token came (the request's second attempt)."""
    resumed = next(i for i, (_, _, attempt) in enumerate(times) if attempt == 2)
    return next(t for t, n, _ in times[resumed:] if n > times[resumed][1])


async def one_run(model_dir: Path, work: Path, stage: int,
                  hot_cover: bool) -> tuple[float, float, float, bool, float, tuple[float, float, float, int, list]]:
    """(pause at the switch, longest gap from the signal on, longest gap uninterrupted, same reply, signal to the
    fellow's exit, (last token to the switch, the switch to the new ring linked, linked to its first token: the
    prefill of what streamed past the KV blocks handed over, and one step; the blocks handed over; each stage's
    prefilled tokens and ms)."""
    name = model_dir.name
    async with ring_with_standby(model_dir, work, stage, hot_cover, {"SWARM_CALIBRATE": "0"}) as (swarm, victim, stage):
        calm, _, want = await reply_arrivals(swarm, name)
        times, signalled, got = await reply_arrivals(swarm, name, lambda: victim.proc.send_signal(signal.SIGTERM),
                                                     SIGNAL_AT)
        await trio.to_thread.run_sync(victim.proc.wait, 60)
        left = trio.current_time() - (signalled or 0.0)
        moved = swarm.leader.serving.models[name].stages[stage].plan.fellow_name
        assert moved == "fellow-2", f"stage {stage} is on {moved}"
        switch = swarm.leader.serving.drains.switches[-1]
        resumed = first_new_token_at(times)
        request = next(r for r in swarm.leader.serving.book.recent.values() if r.attempts == 2)
        prefills = [(t.prefill_tokens, round(1000 * t.prefill_s)) for _, t in sorted(request.stage_times.items())]
        profile = (switch.switched_at - (switch.last_token_at or switch.switched_at),
                   switch.linked_at - switch.switched_at, resumed - switch.linked_at, switch.carried, prefills)
        return switch_gap(times), longest_gap(times, signalled), longest_gap(calm), got == want, left, profile


async def main(args) -> None:
    from swarm.leader.serving import drain
    from swarm.store.importer import import_model

    if args.no_token_wait:
        drain.TOKEN_WAIT_S = 0.0
    if args.no_kv_handover:
        async def no_handover(*_) -> int:
            return 0

        drain.KvCarry.prepare = no_handover  # type: ignore[method-assign]
    root = Path(tempfile.mkdtemp(prefix="swarm-drain-"))
    try:
        import_model("smollm2-135m-instruct", root / "models")
        model_dir = root / "models" / "smollm2-135m-instruct"
        print(f"machine: {platform.processor() or platform.machine()}, {platform.system()}; stage drained: "
              f"{args.stage} (hot cover: the covered stage); the switch "
              + ("as soon as the taker is ready" if args.no_token_wait else "at the next token")
              + ("; no KV handover" if args.no_kv_handover else "; the running requests' KV handed over"), flush=True)
        for hot in (True,) if args.hot_only else (False, True):
            runs = []
            for run in range(args.runs):
                runs.append(await one_run(model_dir, root / f"{'hot' if hot else 'cold'}-{run}", args.stage, hot))
                after_token, link, prefill, carried, prefills = runs[-1][5]
                print(f"  run {run + 1}: pause at the switch {runs[-1][0]:.2f} s, longest gap from the signal on "
                      f"{runs[-1][1]:.2f} s; the switch {1000 * after_token:.0f} ms after a token, the new ring "
                      f"linked in {1000 * link:.0f} ms, its first token {1000 * prefill:.0f} ms later; "
                      f"{carried} KV blocks handed over, each stage's prefill (tokens, ms) {prefills}", flush=True)
            gaps = [r[0] for r in runs]
            print(f"{'hot cover' if hot else 'standby loads the stage'}: pause at the switch "
                  f"{statistics.median(gaps):.2f} s median ({', '.join(f'{g:.2f}' for g in gaps)}); longest gap "
                  f"from the signal on {statistics.median(r[1] for r in runs):.2f} s, uninterrupted "
                  f"{statistics.median(r[2] for r in runs):.2f} s; replies the same: {all(r[3] for r in runs)}; "
                  f"signal to exit {statistics.median(r[4] for r in runs):.1f} s")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--stage", type=int, default=1)
    parser.add_argument("--hot-only", action="store_true", help="only the runs with hot cover")
    parser.add_argument("--no-token-wait", action="store_true", help="switch without waiting for a token (before)")
    parser.add_argument("--no-kv-handover", action="store_true", help="the new ring prefills all (before)")
    trio.run(main, parser.parse_args())
