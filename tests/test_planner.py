"""The planner's arithmetic over made-up fleets (swarm.leader.planning.planner), each figure worked out by hand
below."""

import math

import pytest

from swarm.errors import PlacementError
from swarm.leader.planning.placement import FellowCapacity, ModelSize, StagePlan, place
from swarm.leader.planning.planner import (
    Hop,
    hop_round_trips,
    layer_speed,
    missing_speeds,
    predict,
    sentence,
    takes_lean_step,
)

# Four layers of 1 MB, an untied head of 10 kB.
SIZE = ModelSize(layer_bytes=(1_000_000,) * 4, embed_bytes=500_000, final_bytes=10_000, tied_embeddings=False,
                 kv_bytes_per_token_per_layer=100)


def calibration(decode_small, decode_large, prefill_small, prefill_large):
    return {"prefill_tokens": 1000, "points": [
        {"weight_bytes": 1_000_000, "decode_ms": decode_small, "prefill_ms": prefill_small},
        {"weight_bytes": 3_000_000, "decode_ms": decode_large, "prefill_ms": prefill_large}]}


# pc-1: decode 1 ms + 1e-6 ms/byte (2 ms per 1 MB layer), prefill 1e-4 ms/byte (100 ms per layer per 1,000 tokens).
# pc-2: twice as slow: decode 2 ms + 2e-6 ms/byte (4 ms per layer), prefill 200 ms per layer.
SPEEDS = {1: layer_speed(calibration(2, 4, 100, 300)), 2: layer_speed(calibration(4, 8, 200, 600))}
TWO = [StagePlan(0, 1, "pc-1", 0, 2, 0, 0), StagePlan(1, 2, "pc-2", 2, 4, 0, 0)]


def test_layer_speed_is_a_line_through_the_two_widths():
    speed = SPEEDS[1]
    assert speed.decode_fixed_ms == pytest.approx(1.0)
    assert speed.decode_per_byte_ms == pytest.approx(1e-6)
    assert speed.prefill_fixed_ms == pytest.approx(0.0)
    assert speed.prefill_per_byte_ms == pytest.approx(1e-4)
    # noise made the wider layer time faster: read as proportional to the wider point (6 ms / 3 MB)
    noisy = layer_speed(calibration(9, 6, 300, 300))
    assert (noisy.decode_fixed_ms, noisy.decode_per_byte_ms) == (0.0, pytest.approx(2e-6))
    # a prefill measured over 500 tokens counts double for 1,000
    half = layer_speed({"prefill_tokens": 500, "points": [{"weight_bytes": 1_000_000, "decode_ms": 1,
                                                           "prefill_ms": 50}]})
    assert half.prefill_ms(1_000_000) == pytest.approx(100.0)


def test_a_stage_pays_its_pass_embedding_and_head_as_measured():
    """A calibration that also timed what a decode pass costs besides its layers (pass_ms), the embedding and the
    head (swarm.fellow.calibration VERSION 3): each stage pays its pass, the first its embedding, the last its head
    at the head's own line."""
    cal = calibration(2, 4, 100, 300)
    for point, (pass_ms, embed_ms, head_bytes, head_ms) in zip(cal["points"], [(0.5, 0.01, 10_000_000, 5.0),
                                                                               (0.7, 0.03, 30_000_000, 13.0)]):
        point.update(pass_ms=pass_ms, embed_ms=embed_ms, head_bytes=head_bytes, head_ms=head_ms)
    speed = layer_speed(cal)
    # the per-pass costs hardly depend on the width: their mean; the head: 1 ms + 4e-7 ms/byte
    assert (speed.pass_ms, speed.embed_ms) == (pytest.approx(0.6), pytest.approx(0.02))
    assert (speed.head_fixed_ms, speed.head_per_byte_ms) == (pytest.approx(1.0), pytest.approx(4e-7))
    p = predict(TWO, SIZE, {1: speed, 2: speed}, [Hop(2.0, False), Hop(2.0, False)], 2500, prefill_chunk=256)
    # stage 0: pass 0.6 + embedding 0.02 + 2 layers x 2 ms = 4.62 ms; stage 1: 0.6 + 4 + head 1 + 4e-7 x 10,000
    assert [s["decode_ms"] for s in p["stages"]] == [pytest.approx(4.62), pytest.approx(5.604)]
    # the prompt: 4 chunks of 256, each paying the pass (and on stage 0 the embedding); the head once at its end
    assert [s["prefill_ms"] for s in p["stages"]] == [pytest.approx(4 * 0.62 + 200), pytest.approx(2.4 + 200 + 1.004)]
    # an older calibration (no head timed): the head at the layers' cost per byte, no pass cost
    assert SPEEDS[1].head_ms(10_000) == pytest.approx(0.01) and SPEEDS[1].pass_ms == 0.0


def test_a_ring_of_several_stages_counts_its_layers_after_idle():
    """A calibration that also timed the decode step after the core waited (swarm.fellow.calibration VERSION 4): a
    ring of several stages counts each stage's layers at that speed (it waits for the others between its passes);
    one stage holding the whole model decodes back to back, at the plain figure."""
    cal = calibration(2, 4, 100, 300)
    for point, idle in zip(cal["points"], (3, 7)):
        point["decode_idle_ms"] = idle
    speed = layer_speed(cal)
    # after idle: 1 ms + 2e-6 ms/byte (3 ms per 1 MB layer)
    assert (speed.idle_fixed_ms, speed.idle_per_byte_ms) == (pytest.approx(1.0), pytest.approx(2e-6))
    two = predict(TWO, SIZE, {1: speed, 2: speed}, [Hop(2.0, False), Hop(2.0, False)], 2500, prefill_chunk=256)
    # stage 0: 2 layers x 3 ms; stage 1: 2 x 3 ms + the head at 1e-6 ms/byte x 10,000 (the head is not idle-scaled)
    assert [s["decode_ms"] for s in two["stages"]] == [pytest.approx(6.0), pytest.approx(6.01)]
    one = predict([StagePlan(0, 1, "pc-1", 0, 4, 0, 0)], SIZE, {1: speed}, [], 2500, prefill_chunk=256)
    assert one["stages"][0]["decode_ms"] == pytest.approx(4 * 2.0 + 0.01)  # back to back: the plain figure
    # prefill is not idle-bound: the same in both
    assert two["stages"][0]["prefill_ms"] == pytest.approx(200.0)
    # an older calibration has no idle figure: the plain one counts everywhere
    assert SPEEDS[1].idle_per_byte_ms is None and SPEEDS[1].decode_ms(1_000_000, after_idle=True) == pytest.approx(2.0)


def test_a_family_that_takes_the_lean_step_counts_its_calibrated_speed():
    """A calibration that also timed the lean decode step (swarm.fellow.calibration VERSION 6): a Llama-shaped model
    without sliding windows counts it, back to back and after idle; others, and older calibrations, the library's."""
    cal = calibration(2, 4, 100, 300)
    for point, (idle, lean, lean_idle) in zip(cal["points"], [(3, 1.5, 2), (7, 2.5, 5)]):
        point.update(decode_idle_ms=idle, lean_decode_ms=lean, lean_decode_idle_ms=lean_idle)
    library, lean = layer_speed(cal), layer_speed(cal, lean=True)
    # lean: 1 ms + 0.5e-6 ms/byte back to back, 0.5 ms + 1.5e-6 ms/byte after idle; the prefill is the library's
    assert (lean.decode_fixed_ms, lean.decode_per_byte_ms) == (pytest.approx(1.0), pytest.approx(0.5e-6))
    assert (lean.idle_fixed_ms, lean.idle_per_byte_ms) == (pytest.approx(0.5), pytest.approx(1.5e-6))
    assert lean.prefill_ms(1_000_000) == library.prefill_ms(1_000_000) == pytest.approx(100.0)
    assert library.decode_ms(1_000_000) == pytest.approx(2.0) and lean.decode_ms(1_000_000) == pytest.approx(1.5)
    # a calibration from before the lean step was timed: the library's figures
    assert layer_speed(calibration(2, 4, 100, 300), lean=True) == layer_speed(calibration(2, 4, 100, 300))
    # which models count it: the families the lean step computes, without sliding windows
    assert takes_lean_step("llama", {}) and takes_lean_step("qwen3", {"sliding_window": None})
    assert takes_lean_step("mistral", {"sliding_window": 4096, "use_sliding_window": False})
    assert not takes_lean_step("mistral", {"sliding_window": 4096})
    assert not takes_lean_step("gemma3_text", {}) and not takes_lean_step("phi3", {})


def test_two_stages_compute_bound_on_the_slower_fellow():
    hops = [Hop(10.0, True, "direct"), Hop(2.0, False)]
    p = predict(TWO, SIZE, SPEEDS, hops, hidden_bytes_per_token=2500, prefill_chunk=256)
    # stage 0: 2 layers x (1 + 1) ms = 4 ms; prompt 2 x 100 ms = 200 ms
    # stage 1: 2 layers x (2 + 2) ms + head 2e-6 x 10,000 = 8.02 ms; prompt 2 x 200 + 0.02 = 400.02 ms
    assert [s["decode_ms"] for s in p["stages"]] == [pytest.approx(4.0), pytest.approx(8.02)]
    assert [s["prefill_ms"] for s in p["stages"]] == [pytest.approx(200.0), pytest.approx(400.02)]
    # hop 0: 10/2 + 2,500 B at 12.5 MB/s (0.2 ms) = 5.2 ms; hop 1 (the token back): 2/2 + 64 B (0.00512 ms)
    assert [link["ms_per_token"] for link in p["links"]] == [pytest.approx(5.2), pytest.approx(1.00512)]
    assert p["ms_per_token"] == pytest.approx(4 + 8.02 + 5.2 + 1.00512)
    assert p["tokens_per_s"] == pytest.approx(1000 / 18.22512)
    # prompt: 4 chunks of 256 through the ring as a pipeline: a chunk takes 50 ms on stage 0, 640 kB (51.2 ms) on
    # hop 0 (plus its 5 ms latency once) and 100 ms on stage 1; then 3 more chunks at the slowest (100 ms); the head
    assert p["time_to_first_token_s"] == pytest.approx((50 + 51.2 + 5 + 100 + 3 * 100 + 0.02) / 1000)
    assert [link["prompt_ms"] for link in p["links"]] == [pytest.approx(220), pytest.approx(4.00512)]  # busy time
    assert p["bottleneck"] == {"kind": "compute", "stage": 1, "fellow": "pc-2", "ms_per_token": pytest.approx(8.02),
                               "text": "stage 1 on pc-2 (compute)"}
    assert sentence(p) == ("about 55 tokens/s, first token of a 1,000-token prompt in 0.5 s over 2 stages; the "
                           "slowest part is stage 1 on pc-2 (compute) (links not measured yet: assumed 2 ms round "
                           "trip)")
    # below 10 with one decimal; a rate that rounds to 10.0 is said as a whole number
    assert [sentence({**p, "tokens_per_s": r}).split(",")[0] for r in (9.94, 9.97, 10.4)] == [
        "about 9.9 tokens/s", "about 10 tokens/s", "about 10 tokens/s"]


def test_slow_links_are_the_bottleneck():
    p = predict(TWO, SIZE, SPEEDS, [Hop(40.0, True, "relay"), Hop(40.0, True, "relay")], 2500)
    # links: 20.2 + 20.00512 ms a token > 8.02 ms of stage 1
    assert p["bottleneck"]["kind"] == "link"
    assert p["bottleneck"]["ms_per_token"] == pytest.approx(40.20512)
    assert p["tokens_per_s"] == pytest.approx(1000 / (12.02 + 40.20512))
    assert sentence(p).endswith("the slowest part is the links between stages")


def test_one_stage_has_no_link():
    one = [StagePlan(0, 1, "pc-1", 0, 4, 0, 0)]
    p = predict(one, SIZE, SPEEDS, [], 2500)
    # 4 layers x 2 ms + head 1e-6 x 10,000 = 8.01 ms a token; prompt 4 x 100 + 0.01 ms
    assert p["links"] == []
    assert p["tokens_per_s"] == pytest.approx(1000 / 8.01)
    assert p["time_to_first_token_s"] == pytest.approx(0.40001)
    assert sentence(p) == ("about 125 tokens/s, first token of a 1,000-token prompt in 0.4 s on pc-1; the slowest "
                           "part is stage 0 on pc-1 (compute)")


def test_tied_head_costs_the_embedding_and_the_placement_is_the_loads():
    tied = ModelSize((1_000_000,) * 4, 500_000, 1_000, True, 100)
    fleet = [FellowCapacity(1, "pc-1", 10_000_000_000), FellowCapacity(2, "pc-2", 10_000_000_000)]
    plans = place(tied, fleet, 2, 1024)
    assert [(p.first_layer, p.end_layer) for p in plans] == [(0, 2), (2, 4)]
    p = predict(plans, tied, SPEEDS, hop_round_trips(plans, {(2, 1): Hop(6.0, True)}), 2500)
    # head: the 500 kB embedding at pc-2's 2e-6 ms/byte = 1 ms; hop 0 (pc-1 -> pc-2) and the way back both
    # take the round trip measured from pc-2 to pc-1
    assert p["stages"][1]["decode_ms"] == pytest.approx(8 + 1.0)
    assert [link["rtt_ms"] for link in p["links"]] == [6.0, 6.0]
    assert all(link["rtt_measured"] for link in p["links"])


def test_a_fellow_without_its_speed_is_named():
    with pytest.raises(PlacementError, match=r"pc-2 has not reported its speed yet.*Try again in a few seconds"):
        missing_speeds(TWO, {1: SPEEDS[1]})
    assert math.isfinite(predict(TWO, SIZE, SPEEDS, hop_round_trips(TWO, {}), 0)["ms_per_token"])
