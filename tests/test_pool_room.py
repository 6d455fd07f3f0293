"""The memory a fellow has for one more model (swarm.leader.planning.auto_load.room) and what a fellow lends under
SWARM_SERVE_MEMORY_GB (swarm.fellow.hardware.lent), over made-up inventories."""

from __future__ import annotations

import types

from swarm.config import Settings
from swarm.fellow.hardware import lent
from swarm.leader.planning.auto_load import room
from swarm.leader.planning.placement import OVERHEAD_BYTES, StagePlan
from swarm.leader.serving.models import ModelServing, StageState
from swarm.messages import Gpu, Hardware

GB = 10**9


def fellow(fid: int, free: int):
    return types.SimpleNamespace(id=fid, name=f"fellow-{fid}", hardware=Hardware(2, 8 * GB, free))


def model(name: str, fellow_ids: list[int], weight: int, kv: int, status: str = "ready") -> ModelServing:
    stages = [StageState(StagePlan(i, fid, f"fellow-{fid}", i, i + 1, weight, kv)) for i, fid in enumerate(fellow_ids)]
    return ModelServing(name, "l1", stages, status=status)


def serving(models: list[ModelServing], placements: dict) -> types.SimpleNamespace:
    return types.SimpleNamespace(settings=Settings(), models={m.name: m for m in models}, placements=placements)


def test_a_fellow_holding_nothing_has_what_it_reports():
    assert [c.free_bytes for c in room(serving([], {}), [fellow(1, 3 * GB)])] == [3 * GB]


def test_loaded_stages_count_at_their_whole_need_not_only_their_weights():
    # 3 GB free after 1 GB of weights loaded: 4 GB for serving, less 1 GB weights, 0.5 GB KV and the working memory
    a = model("a", [1], GB, GB // 2)
    got = room(serving([a], {1: {"a": {"bytes": GB}}}), [fellow(1, 3 * GB)])
    assert got[0].free_bytes == 4 * GB - GB - GB // 2 - OVERHEAD_BYTES


def test_a_stage_still_loading_is_counted_before_the_fellow_reports_it():
    a = model("a", [1], GB, GB // 2, status="loading")
    got = room(serving([a], {}), [fellow(1, 3 * GB)])
    assert got[0].free_bytes == 3 * GB - GB - GB // 2 - OVERHEAD_BYTES


def test_models_being_released_and_failed_ones_leave_room():
    a, b = model("a", [1, 2], GB, 0), model("b", [1], GB, 0, status="failed")
    placements = {1: {"a": {"bytes": GB}, "b": {"bytes": GB}}, 2: {"a": {"bytes": GB}}}
    s = serving([a, b], placements)
    kept = room(s, [fellow(1, GB), fellow(2, 2 * GB)])
    assert [c.free_bytes for c in kept] == [3 * GB - GB - OVERHEAD_BYTES, 3 * GB - GB - OVERHEAD_BYTES]
    released = room(s, [fellow(1, GB), fellow(2, 2 * GB)], frozenset({"a"}))
    assert [c.free_bytes for c in released] == [GB, 2 * GB]  # nothing else placed: as reported


def test_a_fellow_lends_at_most_its_limit_less_what_its_stages_hold():
    hw = Hardware(2, 16 * GB, 10 * GB, gpus=[Gpu(0, "card", 12 * GB, 6 * GB)])
    assert lent(hw, 0, GB) == hw  # no limit
    capped = lent(hw, 4 * GB, GB)
    assert capped.ram_free_bytes == 3 * GB and capped.gpus[0].free_bytes == 3 * GB
    assert lent(hw, 4 * GB, 5 * GB).ram_free_bytes == 0
    assert lent(Hardware(2, 16 * GB, 2 * GB), 4 * GB, 0).ram_free_bytes == 2 * GB  # less free than the limit
