"""Where a fellow's calibration (swarm.fellow.calibration) is kept and when it runs: cached for the whole machine,
keyed by the hardware it ran on, one calibration at a time on the machine, after other work quietened.
"""

from __future__ import annotations

import contextlib
import json
import logging
import tempfile
import time
from pathlib import Path

from swarm.fellow import calibration
from swarm.fellow.calibration import PREFILL_TOKENS, CpuBudget, hardware_key

log = logging.getLogger(__name__)

LOCK_WAIT_S = 120.0  # past this, measure anyway: a stuck lock must not leave a fellow out of the planner
# Before timing itself on the CPU a fellow waits (at most QUIET_WAIT_S) until other processes use less than
# QUIET_SHARE of the machine: started beside others (the demo, a bench, a PC that has just booted) it met their
# start-up and measured itself up to 1.5-4x slower than it then served.
QUIET_SHARE = 0.25
QUIET_WAIT_S = 20.0
QUIET_SAMPLE_S = 0.5


@contextlib.contextmanager
def _one_at_a_time():
    """One calibration at a time on this machine: several fellows started together on one PC (the demo, a lab, a
    bench) calibrating at once shared its cores and each measured itself up to 5x slower than it serves (their
    stages take turns on a token), and the cache kept that figure."""
    import filelock

    lock = filelock.FileLock(str(Path(tempfile.gettempdir()) / "swarm-calibration.lock"))
    try:
        lock.acquire(timeout=LOCK_WAIT_S)
    except (filelock.Timeout, OSError) as exc:
        log.info("calibrating without waiting for the other fellows on this machine (%s)", exc)
        yield
        return
    try:
        yield
    finally:
        lock.release()


def others_busy(sample_s: float = QUIET_SAMPLE_S) -> float:
    """The share of the machine's CPU time (0-1) that processes other than this one used over ``sample_s``."""
    import psutil

    def busy_and_total():
        times = psutil.cpu_times()._asdict()
        total = sum(v for k, v in times.items() if k not in ("guest", "guest_nice"))  # counted in user already
        return total - times["idle"] - times.get("iowait", 0.0), total

    me = psutil.Process()
    (busy0, total0), mine0 = busy_and_total(), me.cpu_times()
    time.sleep(sample_s)
    (busy1, total1), mine1 = busy_and_total(), me.cpu_times()
    if total1 <= total0:
        return 0.0
    mine = (mine1.user + mine1.system) - (mine0.user + mine0.system)
    return max(0.0, min(1.0, (busy1 - busy0 - mine) / (total1 - total0)))


def wait_until_quiet(wait_s: float = QUIET_WAIT_S) -> float:
    """Wait until other processes use less than QUIET_SHARE of the machine, at most ``wait_s``; their last share."""
    deadline = time.monotonic() + wait_s
    while True:
        share = others_busy()
        if share < QUIET_SHARE or time.monotonic() >= deadline:
            return share


def cache_file(key: str) -> Path:
    """Where the calibration for hardware ``key`` is kept for every fellow of this machine (platformdirs' user cache:
    ~/.cache/swarm/calibration on Linux). Per machine, not per data dir: a second fellow, a fresh data dir or the demo
    started again on the same PC measured the same figures again, 82-112 s of a busy PC's CPU each time."""
    import platformdirs

    return Path(platformdirs.user_cache_dir("swarm")) / "calibration" / f"{key}.json"


def _read(path: Path, key: str) -> dict | None:
    try:
        cached = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if isinstance(cached, dict) and cached.get("key") == key and isinstance(cached.get("calibration"), dict):
        return cached["calibration"]
    return None


def cached(key: str, data_dir: Path | None = None) -> dict | None:
    """The calibration measured on hardware ``key`` on this machine, or -- a fellow's from before the machine-wide
    cache -- in ``data_dir``/calibration.json (then kept machine-wide too); None when there is none."""
    found = _read(cache_file(key), key)
    if found is None and data_dir is not None:
        found = _read(Path(data_dir) / "calibration.json", key)
        if found is not None:
            store(key, found)
    return found


def store(key: str, result: dict, data_dir: Path | None = None) -> None:
    """Keep ``result`` for hardware ``key`` machine-wide, and as the fellow's own record in ``data_dir`` (given)."""
    text = json.dumps({"key": key, "calibration": result})
    targets = [cache_file(key)] + ([Path(data_dir) / "calibration.json"] if data_dir is not None else [])
    for path in targets:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            # written under another name, then renamed: a fellow reading at the same time gets a whole file
            handle, temporary = tempfile.mkstemp(dir=path.parent, suffix=".part")
            with open(handle, "w") as out:
                out.write(text)
            Path(temporary).replace(path)
        except OSError as exc:
            log.info("could not keep the calibration in %s: %s", path, exc)


def measure_quietly(device: str, threads: int | None = None, cpu: CpuBudget | None = None,
                    key: str | None = None) -> tuple[dict, bool]:
    """:func:`swarm.fellow.calibration.measure`, one calibration at a time on this machine, after waiting (on the
    CPU) for other work to quieten; logs what it found. -> (the calibration, whether it was measured here). With
    ``key``, the result is kept machine-wide for that hardware, and one another fellow of this machine measured while
    this one waited for its turn is taken instead (the demo's fellows join together and measure once)."""
    t0 = time.perf_counter()
    with _one_at_a_time():
        found = cached(key) if key is not None else None
        if found is not None:
            return found, False
        if device == "cpu":
            share = wait_until_quiet()
            if share >= QUIET_SHARE:
                log.info("other work kept %.0f %% of this machine's CPU busy for %.0f s: calibrating anyway (the "
                         "planner may count this fellow slower than it is)", share * 100, QUIET_WAIT_S)
        result = calibration.measure(device, threads, cpu)
        if key is not None:  # kept before the next fellow's turn, so that it finds it
            store(key, result)
    log.info("calibrated a decoder layer on %s in %.1f s (%.1f s of CPU): %s", device, time.perf_counter() - t0,
             time.process_time(), describe(result))
    return result, True


def describe(result: dict) -> str:
    return ", ".join(f"hidden {p['hidden']}: decode {p['decode_ms']:.2f} ms ({p['decode_idle_ms']:.2f} after a wait; "
                     f"lean {p['lean_decode_ms']:.2f}, {p['lean_decode_idle_ms']:.2f}), {PREFILL_TOKENS}-token "
                     f"prefill {p['prefill_ms']:.0f} ms, head {p['head_ms']:.1f} ms" for p in result["points"])


def cached_or_measure(data_dir: Path, device: str, hardware_wire: dict, threads: int | None = None,
                      cpu_s: float | None = None) -> dict | None:
    """The calibration for this hardware, in this process: cached (:func:`cached`), else measured now (at most
    ``cpu_s`` of CPU) and kept. None when torch cannot run it (logged). A fellow calibrates in a process of its own
    instead (swarm.fellow.calibration_process)."""
    key = hardware_key(device, hardware_wire)
    found = cached(key, data_dir)
    if found is not None:
        return found
    try:
        result, _ = measure_quietly(device, threads, CpuBudget.from_now(cpu_s))
    except Exception as exc:  # noqa: BLE001 -- a planner without this fellow's speed is better than no fellow
        log.warning("could not calibrate this fellow's speed on %s (%s): the planner will not count it", device, exc)
        return None
    store(key, result, data_dir)
    return result
