"""Fellows on one machine calibrate one at a time: started together (the demo, a bench) they shared the cores while
timing themselves, each measured itself several times slower than it serves, and the cache kept that."""

from __future__ import annotations

import threading
import time

from swarm.fellow import calibration


def test_two_fellows_on_one_machine_calibrate_one_after_the_other(tmp_path, monkeypatch):
    spans: list[tuple[float, float]] = []

    def timed(device, threads):  # what is timed here is when each calibration runs, not the layer itself
        start = time.monotonic()
        time.sleep(0.3)
        spans.append((start, time.monotonic()))
        return {"version": calibration.VERSION, "device": device, "points": []}

    monkeypatch.setattr(calibration, "measure", timed)
    fellows = [threading.Thread(target=calibration.cached_or_measure, args=(tmp_path / f"f{i}", "cpu", {"cpu": i}))
               for i in range(2)]
    for thread in fellows:
        thread.start()
    for thread in fellows:
        thread.join(10)
    assert len(spans) == 2
    (a_start, a_end), (b_start, b_end) = sorted(spans)
    assert b_start >= a_end  # the second waited for the first
    assert (tmp_path / "f0" / "calibration.json").exists() and (tmp_path / "f1" / "calibration.json").exists()
