"""Fellows on one machine calibrate one at a time: started together (the demo, a bench) they shared the cores while
timing themselves, each measured itself several times slower than it serves, and the cache kept that."""

from __future__ import annotations

import os
import threading
import time

from swarm.fellow import calibration, calibration_cache


def test_two_fellows_on_one_machine_calibrate_one_after_the_other(tmp_path, monkeypatch):
    spans: list[tuple[float, float]] = []

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # the machine-wide cache, here

    def timed(device, threads, cpu=None):  # what is timed here is when each calibration runs, not the layer itself
        start = time.monotonic()
        time.sleep(0.3)
        spans.append((start, time.monotonic()))
        return {"version": calibration.VERSION, "device": device, "points": []}

    monkeypatch.setattr(calibration, "measure", timed)
    monkeypatch.setattr(calibration_cache, "others_busy", lambda sample_s=0: 0.0)  # the machine is quiet here
    fellows = [threading.Thread(target=calibration_cache.cached_or_measure,
                                args=(tmp_path / f"f{i}", "cpu", {"cpu": i})) for i in range(2)]
    for thread in fellows:
        thread.start()
    for thread in fellows:
        thread.join(10)
    assert len(spans) == 2
    (a_start, a_end), (b_start, b_end) = sorted(spans)
    assert b_start >= a_end  # the second waited for the first
    assert (tmp_path / "f0" / "calibration.json").exists() and (tmp_path / "f1" / "calibration.json").exists()


def test_a_fellow_waits_for_the_machine_to_quieten_before_timing_itself(tmp_path, monkeypatch):
    """Started beside other processes (the demo's other fellow importing torch), a fellow measured itself up to 4x
    slower than it served: it waits until others use under a quarter of the machine, and past QUIET_WAIT_S times
    itself anyway."""
    readings = iter([0.9, 0.6, 0.1])
    measured_after: list[float] = []
    monkeypatch.setattr(calibration_cache, "others_busy", lambda sample_s=0: next(readings))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(calibration, "measure",
                        lambda device, threads, cpu=None: measured_after.append(next(readings, None))
                        or {"version": calibration.VERSION, "device": device, "points": []})
    calibration_cache.cached_or_measure(tmp_path / "f", "cpu", {"cpu": 1})
    assert measured_after == [None]  # all three readings were taken (busy, busy, quiet) before it measured

    monkeypatch.setattr(calibration_cache, "others_busy", lambda sample_s=0: 0.95)  # never quiet
    monkeypatch.setattr(calibration_cache, "QUIET_WAIT_S", 0.2)
    started = time.monotonic()
    assert calibration_cache.wait_until_quiet(0.2) == 0.95
    assert time.monotonic() - started < 5


CORES = os.cpu_count() or 1  # psutil.cpu_times counts every CPU of the machine


def test_others_busy_sees_another_process_and_not_its_own_work():
    import subprocess
    import sys

    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)
        assert calibration_cache.others_busy(0.5) >= 0.6 / CORES  # one of the machine's cores spinning: 1 / CORES
    finally:
        spinner.kill()
        spinner.wait()

    def spin_here():
        end = time.monotonic() + 0.8
        while time.monotonic() < end:
            pass

    before = calibration_cache.others_busy(0.5)  # what the rest of the machine does meanwhile (another test run, say)
    mine = threading.Thread(target=spin_here)
    mine.start()
    try:
        share = calibration_cache.others_busy(0.5)
    finally:
        mine.join()
    assert share < before + 0.6 / CORES  # this process's own spinning thread (1 / CORES) is not "other work"
