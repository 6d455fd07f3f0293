"""The calibration (swarm.fellow.calibration) in a process of its own, at the lowest priority, so that joining never
costs serving anything.

It used to run on the fellow's one compute thread (swarm.fellow.compute), and waited there up to QUIET_WAIT_S for the
machine to quieten: a load sent right after the join (the demo's) queued behind it, and so did the first chat when
the calibration started as the load finished. Measured with bench/first_chat.py on a 2-core VM shared with other
runs: the 2-stage load took 114 s with the fellows calibrating against 18 s without. Now a child process measures:
at nice 19 and, on Linux, SCHED_IDLE (it runs only on CPU time nothing else wants), with its CPU time capped by
SWARM_CALIBRATE_CPU_S (the measurement stops timing once it is spent, calibration.CpuBudget; the kernel's RLIMIT_CPU
ends a child that still runs far past it). The result is cached for the whole machine
(calibration_cache.cache_file), so a second fellow, or a fresh data dir, on the same hardware reuses it without
starting a child at all.

The child prints one JSON line on stdout: {"calibration": ..., "cpu_s": ..., "wall_s": ...}; its log goes to stderr.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from pathlib import Path

import trio

from swarm.fellow import calibration, calibration_cache

log = logging.getLogger(__name__)

# How far past SWARM_CALIBRATE_CPU_S the kernel lets the child run before it ends it (SIGXCPU): what is left once the
# budget is spent -- one warm-up and one run of each figure still to come -- and importing torch, which the budget
# counts too.
HARD_LIMIT_FACTOR = 2.0
HARD_LIMIT_EXTRA_S = 30.0


def hard_limit_s(cpu_s: float) -> int:
    return int(cpu_s * HARD_LIMIT_FACTOR + HARD_LIMIT_EXTRA_S)


async def calibrate(data_dir: Path, device_setting: str, hardware_wire: dict, threads: int | None,
                    cpu_s: float) -> dict | None:
    """This machine's calibration for ``hardware_wire`` on SWARM_DEVICE ``device_setting``: the cached one when the
    hardware is the same, else measured in a child process and cached. None when it could not be measured (logged):
    the planner then leaves this fellow out until it can."""
    key = calibration.hardware_key(device_setting, hardware_wire)
    found = await trio.to_thread.run_sync(calibration_cache.cached, key, data_dir)
    if found is not None:
        log.info("using this machine's calibration for this hardware (%s)", calibration_cache.cache_file(key))
        return found
    result = await measure_in_child(device_setting, threads, cpu_s, key)
    if result is not None:
        await trio.to_thread.run_sync(calibration_cache.store, key, result, data_dir)
    return result


# ``-c``, not ``-m``: the package's __init__ imports this module, which runpy would then run a second time
CHILD = "import sys; from swarm.fellow.calibration_process import main; sys.exit(main(sys.argv[1:]))"


async def measure_in_child(device_setting: str, threads: int | None, cpu_s: float, key: str) -> dict | None:
    """Measure in a child process (or take what another fellow of this machine measured meanwhile: the child
    looks in the cache again once it is its turn)."""
    command = [sys.executable, "-c", CHILD, device_setting, str(threads or 0), str(cpu_s), key]
    # the child imports this very swarm, wherever the fellow found it (an installed package, a source checkout)
    here = str(Path(__file__).resolve().parent.parent.parent)
    path = os.pathsep.join([here, *filter(None, [os.environ.get("PYTHONPATH")])])
    try:
        done = await trio.run_process(command, capture_stdout=True, capture_stderr=True, check=False,
                                      env={**os.environ, "PYTHONPATH": path})
    except OSError as exc:
        log.warning("could not start the calibration (%s): the planner will not count this fellow", exc)
        return None
    lines = done.stdout.decode(errors="replace").strip().splitlines()
    try:
        report = json.loads(lines[-1])
        result = report["calibration"]
    except (IndexError, ValueError, KeyError, TypeError):
        tail = done.stderr.decode(errors="replace").strip().splitlines()[-3:]
        why = f"it ended with status {done.returncode}"
        if done.returncode in (-24, 128 + 24):  # SIGXCPU: the kernel's limit on its CPU time
            why = f"it ran past its CPU limit of {hard_limit_s(cpu_s)} s (SWARM_CALIBRATE_CPU_S={cpu_s:g})"
        log.warning("could not calibrate this fellow's speed (%s%s): the planner will not count it", why,
                    ": " + " / ".join(tail) if tail else "")
        return None
    if report.get("cached"):
        log.info("using the calibration another fellow of this machine just measured for this hardware")
        return result
    log.info("calibrated a decoder layer on %s in %.1f s at the lowest priority (%.1f s of CPU, at most %g): %s",
             result.get("device"), report.get("wall_s", 0.0), report.get("cpu_s", 0.0), cpu_s,
             calibration_cache.describe(result))
    return result


def lower_priority() -> None:
    """This process runs only when nothing else wants the CPU: nice 19, and SCHED_IDLE where there is one (Linux)."""
    try:
        os.nice(19)
    except (OSError, AttributeError):  # AttributeError: no nice on Windows
        pass
    if hasattr(os, "sched_setscheduler") and hasattr(os, "SCHED_IDLE"):
        try:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        except OSError:  # refused (a container's seccomp, say): nice 19 alone
            pass


def cap_cpu(cpu_s: float) -> None:
    """The kernel ends this process (SIGXCPU) once it has used ``hard_limit_s(cpu_s)`` of CPU."""
    try:
        import resource
    except ImportError:  # not on Windows: the cooperative budget alone
        return
    limit = hard_limit_s(cpu_s)
    try:
        resource.setrlimit(resource.RLIMIT_CPU, (limit, limit + 5))
    except (ValueError, OSError):  # a lower hard limit is already set: the cooperative budget alone
        pass


def main(argv: list[str]) -> int:
    device_setting, threads, cpu_s, key = argv[0], int(argv[1]) or None, float(argv[2]), argv[3]
    began = time.perf_counter()
    lower_priority()
    cap_cpu(cpu_s)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")
    # the budget counts from the process's start: importing torch is part of what joining costs
    budget = calibration.CpuBudget(until=cpu_s)
    device = calibration.compute_device(device_setting)
    result, measured = calibration_cache.measure_quietly(device, threads, budget, key=key)
    print(json.dumps({"calibration": result, "cached": not measured,
                      "cpu_s": round(time.process_time(), 2), "wall_s": round(time.perf_counter() - began, 2)}),
          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
