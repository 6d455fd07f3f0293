"""What joining costs a fellow's PC: the calibration (swarm.fellow.calibration) runs once per machine and hardware,
in a process of its own at the lowest priority, within a CPU budget (SWARM_CALIBRATE_CPU_S). It used to run on the
fellow's one compute thread -- a load or a chat sent meanwhile waited behind it, up to 20 s of waiting for a quiet
machine and ~10 s of timing -- and again for every fresh data dir: 82-112 s of a busy PC each time."""

from __future__ import annotations

import logging
import time

import pytest
import trio

from harness import running_swarm, wait_until
from swarm.fellow import calibration, calibration_cache, calibration_process, compute, hardware


def test_a_spent_budget_times_each_figure_from_one_warm_up_and_one_run():
    calls = []

    def step():
        calls.append(1)

    calibration._typical(step, lambda: None, 30, 60.0, cpu=calibration.CpuBudget(until=0.0))  # spent already
    assert len(calls) == 2
    calls.clear()
    calibration._typical(step, lambda: None, 30, 60.0, cpu=calibration.CpuBudget.from_now(60.0))
    assert len(calls) == 3 + 30  # within the budget: three warm-ups and every run asked for


def test_the_cache_is_the_machines_keyed_by_the_hardware(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    key = calibration.hardware_key("auto", {"cpu_cores": 2, "gpus": []})
    other = calibration.hardware_key("auto", {"cpu_cores": 4, "gpus": []})
    result = {"version": calibration.VERSION, "device": "cpu", "points": [{"hidden": 256}]}
    calibration_cache.store(key, result, tmp_path / "fellow-a")
    assert calibration_cache.cache_file(key).is_relative_to(tmp_path / "cache")
    assert calibration_cache.cached(key, tmp_path / "fellow-b") == result  # another data dir, the same machine
    assert calibration_cache.cached(key) == result
    assert calibration_cache.cached(other, tmp_path / "fellow-b") is None  # other hardware: measured again
    # a fellow's calibration from before the machine-wide cache (in its data dir) is taken, and kept machine-wide
    calibration_cache.store(other, result, tmp_path / "fellow-old")
    calibration_cache.cache_file(other).unlink()
    assert calibration_cache.cached(other, tmp_path / "fellow-old") == result
    assert calibration_cache.cached(other) == result


@pytest.mark.e2e
async def test_fellows_on_one_machine_calibrate_once_without_holding_up_their_compute(
        tmp_path, tiny_model_dirs, monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="swarm.fellow.calibration_process")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # the children measure into this machine cache
    model_dir = tiny_model_dirs["llama"]
    with trio.fail_after(240):
        async with running_swarm(tmp_path, [model_dir], fellow_env={"SWARM_CALIBRATE": "1",
                                                                    "SWARM_CALIBRATE_CPU_S": "5"}) as swarm:
            fellows = swarm.fellows
            await wait_until(lambda: any(f.calibrating_key for f in fellows), 10)
            await trio.sleep(0.5)  # under way
            # while they calibrate, their compute thread answers at once and a model loads
            began = time.monotonic()
            await compute.run(lambda: None)
            assert time.monotonic() - began < 1.0
            loading = await swarm.http.post(f"/api/v1/models/{model_dir.name}/load", json={"num_stages": 2})
            assert loading.status_code == 202, loading.text
            await swarm.leader.serving.loader.wait_ready(model_dir.name, 60)
            await wait_until(lambda: all(f.calibration for f in fellows), 200)
            # one child measured; the other fellow took what it measured (the same figures, not measured again)
            assert fellows[0].calibration == fellows[1].calibration
            assert len(fellows[0].calibration["points"]) == len(calibration.HIDDEN_SIZES)
            measured = [r.getMessage() for r in caplog.records if "at the lowest priority" in r.getMessage()]
            assert len(measured) == 1, measured

    # a third data dir on this machine: the cached result, no child started
    async def no_child(*args):
        raise AssertionError("measured again")

    monkeypatch.setattr(calibration_process, "measure_in_child", no_child)
    hw = (await trio.to_thread.run_sync(hardware.probe)).to_wire()
    found = await calibration_process.calibrate(tmp_path / "fellow-new", "auto", hw, None, 5.0)
    assert found == fellows[0].calibration
