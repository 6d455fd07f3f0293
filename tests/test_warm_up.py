"""A stage runs its first request's path -- a prompt and a few decode steps through the batch function the fellow's
driver calls (swarm.stage.warm_up) -- before it tells the leader it is loaded, so the first chat after a load does
not pay for it; and the warm-up leaves nothing behind."""

from __future__ import annotations

import threading

import pytest
import trio

from harness import running_swarm, wait_until
from swarm.stage import StageModel, stage_specs, warm_up
from swarm.stage.local import LocalRing


def _stages(model_dir, count=2):
    return [StageModel.load_dir(model_dir, spec) for spec in stage_specs(4, count)]


def test_the_warm_up_runs_the_batch_path_and_leaves_no_trace(tiny_model_dirs):
    model_dir = tiny_model_dirs["llama"]
    fresh = _stages(model_dir)
    warmed = _stages(model_dir)
    for stage in warmed:
        assert warm_up.warm_up_batch_path(stage, 1) == 1 + warm_up.DECODE_STEPS  # a prompt, then decode steps
        assert stage.warm_passes == 1 + warm_up.DECODE_STEPS
        assert stage.requests() == []  # no cache kept
    prompt = [5, 17, 42, 99, 3, 250, 7, 61]
    # the warmed stages answer a greedy request exactly as stages that never warmed up
    assert LocalRing(warmed).generate(prompt, 12) == LocalRing(fresh).generate(prompt, 12)


@pytest.mark.e2e
async def test_a_stage_reports_loaded_only_after_its_warm_up(tmp_path, tiny_model_dirs, monkeypatch):
    model_dir = tiny_model_dirs["llama"]
    name = model_dir.name
    release = threading.Event()
    real = warm_up.warm_up_batch_path

    def held(stage, threads=None):  # the last stage's warm-up waits until the test lets it go
        if stage.spec.is_last:
            release.wait(100)  # the test's own time limit is 120 s; a busy CI machine loads slowly
        return real(stage, threads)

    monkeypatch.setattr(warm_up, "warm_up_batch_path", held)
    with trio.fail_after(120):
        async with running_swarm(tmp_path, [model_dir]) as swarm:
            response = await swarm.http.post(f"/api/v1/models/{name}/load", json={"num_stages": 2})
            assert response.status_code == 202, response.text
            try:
                await wait_until(lambda: name in swarm.fellows[0].stages, 60)  # stage 0 is loaded and warmed
                await trio.sleep(1.0)
                # stage 1 is still warming up: not loaded as far as the leader knows, so neither is the model
                assert name not in swarm.fellows[1].stages
                assert swarm.leader.serving.status(name) == "loading"
            finally:
                release.set()
            await swarm.leader.serving.loader.wait_ready(name, 60)
            assert [f.stages[name].driver.stage_model.warm_passes for f in swarm.fellows] == \
                [1 + warm_up.DECODE_STEPS] * 2
