"""The planner's prediction (swarm.leader.planning.planner) against the measured speed: the built-in model (or, with
--moe, a tiny-but-not-trivial mixture of experts) over 1 and 2 stages. The goal is within 25 %.

    .venv/bin/python bench/plan_vs_measured.py [--tokens 64] [--rounds 3] [--threads N] [--no-pin | --in-process]
        [--data-dir /tmp/swarm-bench] [--moe] [--quantization KIND] [--lab [--far-ms 60]]

By default the leader and each fellow run in processes of their own (tests/fleet.py), as on real PCs, each fellow on
a core of its own with one thread (taskset; SWARM_THREADS=1), so that two fellows on one machine behave like two
one-core PCs. Each fellow calibrates when it starts, as a joining fellow does. For each ring: the plan before loading
(from the fellows' calibration, links assumed), then the load and a warm-up; then --rounds rounds, each with the plan
(links now measured), a greedy reply of --tokens tokens (steady decode tokens/s) and a reply to a ~1,000-token prompt
(time to first token). Prints each fellow's calibration, each round's predicted and measured figures with the
per-stage split and their ratio, and the median ratios.

--no-pin leaves the fellow processes unpinned with every core each: each one's stage then computes 1.3-1.5x slower
while serving than its calibration, as the other process's OpenMP threads, still spinning after their pass, and its
caches share the same cores (two fellows on one PC, which the planner does not model).

--lab [--far-ms 60] runs bench/lab_placement.py: the network lab with three fellows, one of them --far-ms each way
from the others; the link-blind placement (all three) and the link-aware one (the far fellow left out) side by side,
each with its plan against its measured decode speed.

--in-process runs the leader and both fellows in this process (tests/harness.py), calibrating afresh right before
each round (swarm.fellow.calibration.measure, handed to both fellows) so that the plan and the measurement see the
same load on a shared machine. This is not a pool of PCs: the fellows share one compute thread and every core, so a
2-stage prompt's chunks cannot overlap as the plan counts them and its time to first token comes out ~2x the plan.
"""

from __future__ import annotations

import argparse
import os
import statistics
from pathlib import Path

import trio

from builtin_swarm import COUNT, main  # first: puts tests/ on the import path
from harness import running_swarm
from swarm.fellow import calibration

LONG = [{"role": "user", "content": "Summarise this. " + "The quick brown fox jumps over the lazy dog. " * 98}]


async def plan(swarm, name: str, stages: int) -> dict:
    while True:
        response = await swarm.http.get(f"/api/v1/models/{name}/plan?num_stages={stages}")
        if response.status_code == 200:
            return response.json()
        await trio.sleep(0.5)  # the fellows' calibration is still running


async def calibrate_afresh(swarm) -> dict:
    """Calibrate now, as a fellow does (its device, every core), and wait until the leader holds it for both."""
    fellow = swarm.fellows[0]
    device = calibration.compute_device(fellow.settings.device)
    fresh = await trio.to_thread.run_sync(calibration.measure, device, fellow.threads_for(1))
    for fellow in swarm.fellows:
        fellow.calibration = fresh
    while any(conn.calibration != fresh for conn in swarm.leader.hub.online.values()):
        await trio.sleep(0.1)
    return fresh


def parts(prediction: dict) -> str:
    return " + ".join(f"{s['decode_ms']:.1f}" for s in prediction["stages"]) + "".join(
        f" + link {link['ms_per_token']:.1f}" for link in prediction["links"])


def report(round_: int, calibrated: str, after: dict, decode: dict, long: dict, ratios: tuple[list, list]) -> None:
    """One round's lines: the plan against the decode reply's and the long prompt's ``swarm.timing``."""
    ttft = long["swarm"]["timing"]["ttft_ms"] / 1000
    ratios[0].append(after["tokens_per_s"] / decode["tokens_per_s"])
    ratios[1].append(after["time_to_first_token_s"] / ttft)
    split = " + ".join(f"{s['compute_ms_per_token']:.1f}" for s in decode["stages"]) + (
        f" + links {decode['link_ms_per_token']:.1f}" if decode.get("link_ms_per_token") else "")
    print(f"  round {round_ + 1} ({calibrated})\n"
          f"    predicted {after['tokens_per_s']:.1f} tok/s ({after['ms_per_token']:.1f} ms/token = "
          f"{parts(after)}), TTFT {after['time_to_first_token_s']:.2f} s\n"
          f"    measured  {decode['tokens_per_s']:.1f} tok/s ({decode['ms_per_token']:.1f} ms/token = "
          f"{split}), TTFT {ttft:.2f} s for {long['usage']['prompt_tokens']} prompt tokens\n"
          f"    predicted/measured: tokens/s {ratios[0][-1]:.2f}, TTFT {ratios[1][-1]:.2f}", flush=True)


def fellow_env(args: argparse.Namespace) -> dict:
    return {"SWARM_CALIBRATE": "1", **({"SWARM_THREADS": str(args.threads)} if args.threads else {})}


async def in_one_process(model_dir: Path, tmp: Path, args: argparse.Namespace, stages: int) -> tuple[list, list]:
    name = model_dir.name
    ratios: tuple[list, list] = ([], [])
    async with running_swarm(tmp / f"s{stages}", [model_dir], fellow_env=fellow_env(args)) as swarm:
        before = await plan(swarm, name, stages)
        await swarm.load(name, stages)
        await swarm.chat(name, [{"role": "user", "content": "Hi"}], max_tokens=4)  # warm-up
        print(f"{stages} stage(s): before loading (calibrated at the fellows' start, links assumed) "
              f"{before['tokens_per_s']:.1f} tok/s, TTFT {before['time_to_first_token_s']:.2f} s", flush=True)
        for round_ in range(args.rounds):
            fresh = await calibrate_afresh(swarm)
            after = await plan(swarm, name, stages)
            decode = (await swarm.chat(name, COUNT, max_tokens=args.tokens, ignore_eos=True))["swarm"]["timing"]
            long = await swarm.chat(name, LONG, max_tokens=2)
            points = "; ".join(f"hidden {p['hidden']}: layer {p['decode_ms']:.2f} ms, head {p['head_ms']:.1f} ms"
                               for p in fresh["points"])
            report(round_, f"calibration: {points}", after, decode, long, ratios)
    return ratios


def in_processes(model_dir: Path, tmp: Path, args: argparse.Namespace, stages: int) -> tuple[list, list]:
    """The leader and each fellow in a process of its own (tests/fleet.py), as on real PCs; each fellow's plan uses
    the calibration it took when it started (another process cannot be handed a fresh one)."""
    from fleet import Pool
    from harness import wait_for

    ratios: tuple[list, list] = ([], [])
    env, cpus = fellow_env(args), None
    if args.pin and len(os.sched_getaffinity(0)) < 2:
        print("one core only: the fellows are not pinned (each on a core of its own needs two)", flush=True)
        args.pin = False
    if args.pin:
        env["SWARM_THREADS"] = "1"
        cpus = [str(c) for c in sorted(os.sched_getaffinity(0))[:2]]
    pool = Pool(tmp / f"p{stages}", model_dir, fellow_env=env, fellow_cpus=cpus)
    refused = [""]  # the last refusal, told if a wait for an answer runs out
    try:
        def ask(path: str, body: dict | None = None) -> dict:
            if body is None:
                response = pool.http.get(path)
            else:
                response = pool.http.post(path, json={"model": pool.name, "temperature": 0, **body}, timeout=600)
            if response.status_code != 200:
                refused[0] = f"{path}: {response.status_code} {response.text[:300]}"
                return None
            return response.json()

        path = f"/api/v1/models/{pool.name}/plan?num_stages={stages}"
        wait_for(lambda: ask(path), 180, interval=0.5, message=lambda: refused[0])  # the fellows' calibration
        for fellow in pool.fellows:
            lines = [line for line in fellow.log(200).splitlines() if "calibrated a decoder layer" in line]
            print(f"  {fellow.name}: {lines[-1].split(': ', 1)[-1] if lines else 'no calibration logged'}", flush=True)
        pool.load(stages, quantization=args.quantization or "none")
        ask("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4})
        print(f"{stages} stage(s), separate processes{' on a core each, one thread' if args.pin else ''}:",
              flush=True)
        for round_ in range(args.rounds):
            # Right after a load a fellow's heartbeat may not carry its calibration yet (409): ask again.
            after = wait_for(lambda: ask(path), 60, interval=1, message=lambda: refused[0])
            decode = ask("/v1/chat/completions", {"messages": COUNT, "max_tokens": args.tokens, "ignore_eos": True})
            long = ask("/v1/chat/completions", {"messages": LONG, "max_tokens": 2})
            report(round_, "the fellows' calibration at start", after, decode["swarm"]["timing"], long, ratios)
    finally:
        pool.stop()
    return ratios


async def bench(model_dir: Path, tmp: Path, args: argparse.Namespace) -> None:
    if args.moe:
        from moe_decode import build

        _, model_dir = await trio.to_thread.run_sync(lambda: build(tmp / "moe", tokenizer=True))
    if args.lab:
        from lab_placement import run

        await trio.to_thread.run_sync(run, model_dir, tmp, args)
        return
    summary = []
    for stages in (1, 2):
        if args.processes:
            ratios = await trio.to_thread.run_sync(in_processes, model_dir, tmp, args, stages)
        else:
            ratios = await in_one_process(model_dir, tmp, args, stages)
        summary.append((f"{stages} stage{'s' if stages > 1 else ''}", *ratios))
    for label, decode_ratios, ttft_ratios in summary:
        print(f"{label}: predicted/measured tokens/s {' '.join(f'{r:.2f}' for r in decode_ratios)} "
              f"(median {statistics.median(decode_ratios):.2f}); TTFT {' '.join(f'{r:.2f}' for r in ttft_ratios)} "
              f"(median {statistics.median(ttft_ratios):.2f})", flush=True)


def options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rounds", type=int, default=3, help="calibrate-then-measure rounds per ring")
    parser.add_argument("--threads", type=int, default=0,
                        help="SWARM_THREADS for the fellows (their calibration and their stages); 0: every core")
    parser.add_argument("--no-pin", dest="pin", action="store_false",
                        help="the fellow processes unpinned, each with every core (two fellows on one PC)")
    parser.add_argument("--in-process", dest="processes", action="store_false",
                        help="the leader and the fellows in this process, calibrated afresh before each round")
    parser.add_argument("--lab", action="store_true",
                        help="the network lab: link-blind against link-aware placement with one far fellow of three "
                             "(bench/lab_placement.py; needs root)")
    parser.add_argument("--far-ms", type=float, default=60.0, help="--lab: the far fellow's delay, each way")
    parser.add_argument("--quantization", help="the stages' quantization (e.g. int4-fast); default: none")
    parser.add_argument("--moe", action="store_true",
                        help="a tiny-but-not-trivial random Qwen3-MoE (bench/moe_decode.py's: 8 layers, 32 experts, "
                             "top-4, hidden 512) instead of the built-in model")
    for old in ("--processes", "--pin"):  # the default now; the earlier runs in bench/HISTORY.md name them
        parser.add_argument(old, dest=old[2:], action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)


if __name__ == "__main__":
    main(bench, __doc__, options)
