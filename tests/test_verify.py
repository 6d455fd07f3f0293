"""The leader's spot checks as plain logic (swarm.leader.serving.verify): which passes are picked, how outputs compare,
and what two failures in a row do -- over made-up fleets, without processes (tests/test_verify_e2e.py runs real
ones)."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from honest_checks import KINDS, honest_checks, requests_for
from swarm import control_messages as cm
from swarm import messages, wire
from swarm.config import Settings
from swarm.errors import ConfigError
from swarm.leader.serving.verify import (
    MAX_PICKS,
    TOLERANCE_FLOAT32,
    TOLERANCE_GPU,
    TOLERANCES,
    Verifier,
    difference,
    draw,
    pass_starts,
    tolerance,
)


def test_the_passes_of_a_request_are_its_prompt_chunks_and_its_decode_steps():
    assert pass_starts(600, 4, 256, last_stage=False) == [0, 256, 512, 600, 601, 602]
    assert pass_starts(600, 4, 256, last_stage=True) == [512, 600, 601, 602]  # only the chunk that draws
    assert pass_starts(10, 1, 256, last_stage=False) == [0]


def test_each_pass_is_picked_with_the_fraction_asked_and_a_request_checks_a_few_at_most():
    rng = random.Random(7)
    starts = list(range(40))
    picked = sum(len(draw(starts, 0.02, rng)) for _ in range(5000))  # 200,000 passes
    assert abs(picked - 4000) < 5 * (200_000 * 0.02 * 0.98) ** 0.5
    assert len(draw(list(range(100)), 1.0, rng)) == MAX_PICKS
    assert draw(starts, 0.0, rng) == []


def test_the_tolerance_follows_the_kind_and_a_cpu_cannot_check_a_gpus_quantized_weights():
    assert tolerance("none", False, False) == TOLERANCE_FLOAT32
    assert tolerance("none", True, True) == TOLERANCE_GPU
    assert tolerance("none", False, True) == TOLERANCE_GPU
    assert tolerance("int8", False, False) == TOLERANCES["int8"]
    assert tolerance("nf4", True, True) == TOLERANCE_GPU
    assert tolerance("nf4", False, True) is None  # bitsandbytes' nf4 against the CPU's grid: other weights


HONEST_CHECKS_CI = 2_500  # bench/verify_bounds.py runs 10,000 (and prints the figures); this keeps CI near 30 s


def test_honest_stages_of_every_kind_are_never_flagged(tiny_model_dirs):
    """Every pass of a 3-stage ring of each kind -- prompt chunks, single and batched decode steps, drafting's
    verifying passes -- recomputed by a second copy as a checker does, judged by the leader's comparison."""
    flagged, total = [], 0
    for kind in KINDS:
        checks = honest_checks(tiny_model_dirs["llama"], kind, requests_for(HONEST_CHECKS_CI // len(KINDS)))
        tol = tolerance(KINDS[kind][1], kind == "bfloat16", False)  # bfloat16 on CPU stands in for a GPU's 16 bits
        assert tol is not None
        assert {c.path for c in checks} == {"prompt chunk", "decode", "batched decode", "verifying pass"}
        assert {c.stage for c in checks} == {0, 1, 2}
        flagged += [c for c in checks if c.difference > tol]
        total += len(checks)
    assert total >= HONEST_CHECKS_CI * 0.8
    assert not flagged, flagged[:5]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_differences_are_relative_to_the_output_and_read_every_dtype_that_travels(dtype):
    x = torch.randn(1, 3, 64) * 10
    same = wire.tensor_to_wire(x.to(dtype))
    assert difference({"hidden": same}, {"hidden": same}) == 0.0
    off = x.clone()
    off[0, 1, 5] += 0.1 * float(x.abs().max())
    assert difference({"hidden": wire.tensor_to_wire(off.to(dtype))}, {"hidden": same}) == \
        pytest.approx(0.1, rel=0.05)
    bad = x.clone()
    bad[0, 0, 0] = float("nan")
    assert difference({"hidden": wire.tensor_to_wire(bad.to(dtype))}, {"hidden": same}) == float("inf")
    # the last stage: the same token, or how far below the greedy one the claimed token's logit is
    assert difference({"token": 5}, {"token": 5, "gap": 0.0, "scale": 20.0}) == 0.0
    assert difference({"token": 6}, {"token": 5, "gap": 2.0, "scale": 20.0}) == pytest.approx(0.1)


def test_the_fraction_is_checked_when_the_leader_starts():
    assert Settings.from_env({"SWARM_SERVE_VERIFY": "0.02"}).serve_verify == 0.02
    with pytest.raises(ConfigError, match="SWARM_SERVE_VERIFY"):
        Settings.from_env({"SWARM_SERVE_VERIFY": "2"})


# --- a made-up fleet: two stages, a standby (fellow 3) holding a copy of stage 0 -------------------------------------


class Conn:
    def __init__(self, fellow_id: int, name: str):
        self.id, self.name = fellow_id, name
        self.hardware = SimpleNamespace(gpus=[])
        self.posted: list = []

    def post(self, message) -> None:
        self.posted.append({"t": wire.type_of(message), **wire.to_map(message)})  # as the fellow reads it


def fleet(fraction: float):
    conns = {1: Conn(1, "pc-a"), 2: Conn(2, "pc-b"), 3: Conn(3, "standby")}
    stages = [SimpleNamespace(plan=SimpleNamespace(index=i, fellow_id=i + 1, first_layer=i * 15, end_layer=i * 15 + 15,
                                                   need_bytes=2_500_000_000),
                              cover=3 if i == 0 else None, cover_ready=i == 0, failed_on=set()) for i in range(2)]
    model = SimpleNamespace(name="m", load_id="L", stages=stages, quantization="none", status="ready",
                            slot_of=lambda fid: next((s for s in stages if s.plan.fellow_id == fid), None))
    taken_out = []
    request = SimpleNamespace(id="req-1", owner=7)
    serving = SimpleNamespace(settings=Settings(serve_verify=fraction, serve_prefill_chunk=256),
                              book=SimpleNamespace(by_rid={"r1": request}), hub=SimpleNamespace(online=conns),
                              models={"m": model},
                              recovery=SimpleNamespace(take_out=lambda m, slot, why: taken_out.append((slot, why))))
    return Verifier(serving, random.Random(1)), model, conns, taken_out


def sample(check: str, output: dict, path: str | None = None) -> cm.VerifySample:
    """pc-a's sample of the picked pass: prompt positions 0-2."""
    return cm.VerifySample("m", check, "r1", [[0, 3]], [1, 2, 3], 3, output, path=path)


def result(check: str, output: dict, path: str | None = None) -> cm.VerifyResult:
    return cm.VerifyResult(check, output, path)


def generate(rid: str = "r1") -> messages.Generate:
    return messages.Generate("m", rid, [1, 2, 3], 30, [0], messages.Sampling())


def answer(verifier: Verifier, conns, diff_scale: float) -> None:
    """Every picked pass of stage 0 sampled by pc-a and recomputed by the standby, off by ``diff_scale``."""
    x = torch.ones(1, 1, 8)
    for pick in [m for m in conns[1].posted if m["t"] == "verify_pick"]:
        for _, check in pick["picks"]:
            if check not in verifier.pending:
                continue
            verifier.on_message(conns[1], sample(check, {"hidden": wire.tensor_to_wire(x * (1 + diff_scale))}))
            run = conns[3].posted[-1]
            assert run["t"] == "verify_run" and run["check"] == check and run["inputs"] == [1, 2, 3]
            verifier.on_message(conns[3], result(check, {"hidden": wire.tensor_to_wire(x)}))


def test_only_the_stage_with_a_checker_is_picked_and_honest_results_pass():
    verifier, model, conns, taken_out = fleet(1.0)
    verifier.on_generate(model, generate())
    picks = [m for m in conns[1].posted if m["t"] == "verify_pick"]
    assert len(picks) == 1 and len(picks[0]["picks"]) == MAX_PICKS
    assert not conns[2].posted  # stage 1 has no copy to check it against
    answer(verifier, conns, 0.0)
    assert verifier.checks == MAX_PICKS and verifier.failures == 0 and not verifier.pending and not taken_out


def test_a_stage_off_twice_is_suspect_then_taken_out_with_the_requests_that_went_through_it():
    verifier, model, conns, taken_out = fleet(1.0)
    verifier.on_generate(model, generate())
    pick = conns[1].posted[0]
    check = pick["picks"][0][1]
    verifier.on_message(conns[1], sample(check, {"hidden": wire.tensor_to_wire(torch.ones(1, 1, 8) * 2)}))
    verifier.on_message(conns[3], result(check, {"hidden": wire.tensor_to_wire(torch.ones(1, 1, 8))}))
    assert verifier.failures == 1 and verifier.view()["suspects"][0]["fellow"] == "pc-a" and not taken_out
    answer(verifier, conns, 0.5)  # the rest of the picks: the second failure takes it out
    assert len(taken_out) == 1 and taken_out[0][0] is model.stages[0]
    alert = verifier.alerts[0]
    assert (alert["fellow"], alert["stage"], alert["requests"]) == ("pc-a", 0, [{"id": "req-1", "user_id": 7}])
    assert alert["difference"] == pytest.approx(0.5)
    assert {"t": "unload", "model": "m"} in conns[1].posted
    assert all(1 in s.failed_on for s in model.stages)  # no stage of the model goes back to it


def test_a_forged_result_from_a_fellow_that_is_not_the_checker_is_ignored():
    verifier, model, conns, taken_out = fleet(1.0)
    verifier.on_generate(model, generate())
    check = conns[1].posted[0]["picks"][0][1]
    verifier.on_message(conns[1], sample(check, {"hidden": wire.tensor_to_wire(torch.ones(1, 1, 8))}))
    # the checked fellow vouching for itself
    verifier.on_message(conns[1], result(check, {"hidden": wire.tensor_to_wire(torch.ones(1, 1, 8))}))
    assert verifier.checks == 0 and check in verifier.pending


def test_off_picks_nothing():
    verifier, model, conns, _ = fleet(0.0)
    verifier.on_generate(model, generate())
    assert not conns[1].posted and not verifier.pending


def test_a_stage_nothing_checks_is_named_with_what_to_do():
    verifier, model, conns, _ = fleet(0.02)
    unchecked = verifier.view()["unchecked"]
    assert [(u["model"], u["stage"]) for u in unchecked] == [("m", 1)]  # stage 0 has the standby's copy
    assert unchecked[0]["message"].startswith("no checker for stage 1 of m: no standby has room")
    assert "2.5 GB" in unchecked[0]["message"] and "swarm join --standby" in unchecked[0]["message"]
    model.stages[0].cover_ready = False
    assert "still loading" in verifier.view()["unchecked"][0]["message"]
    model.stages[0].cover_ready = True
    model.quantization = "nf4"
    conns[3].hardware.gpus = ["a GPU"]  # the standby would compute nf4 on its GPU, pc-a on its CPU
    view = verifier.view()
    assert "different devices" in view["unchecked"][0]["message"]
    verifier.on_generate(model, generate())
    assert not conns[1].posted  # nothing picked: the standby could not judge pc-a's passes
    assert fleet(0.0)[0].view()["unchecked"] == []  # checks off: nothing to say


def test_a_checker_on_another_4_bit_kernel_is_not_used_and_the_admin_is_told_why():
    """Honest int4-fast fellows on swarm's kernel and on torch's differ by up to 1.9e-1 (bench/verify_bounds.py):
    as much as a broken one. Such a pair is not judged, and not picked again."""
    verifier, model, conns, taken_out = fleet(1.0)
    model.quantization = "int4-fast"
    verifier.on_generate(model, generate())
    check = conns[1].posted[0]["picks"][0][1]
    verifier.on_message(conns[1], sample(check, {"hidden": wire.tensor_to_wire(torch.ones(1, 1, 8) * 1.1)}, "swarm"))
    verifier.on_message(conns[3], result(check, {"hidden": wire.tensor_to_wire(torch.ones(1, 1, 8))}, "torch"))
    assert verifier.checks == 0 and verifier.failures == 0 and not verifier.recheck and not taken_out
    message = verifier.view()["unchecked"][0]["message"]
    assert message.startswith("no checker for stage 0 of m: its checker standby computes 4 bits with torch's")
    assert "SWARM_INT4_KERNEL" in message
    conns[1].posted.clear()
    verifier.on_generate(model, generate())
    assert not conns[1].posted
