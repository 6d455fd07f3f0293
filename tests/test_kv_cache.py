"""KV caches held at another kind than the compute dtype (swarm.stage.kv_cache, ``--kv-cache``): q8's rounding,
q8 logits against float32 keys and values through real stages, the rollback and sharing a ring does, and the paths
that write a plain cache in place staying off a packed one."""

from __future__ import annotations

import copy

import pytest
import torch

from reference_model import load_reference_model
from swarm.kv_kinds import Q8_GROUP, check_kv_kind, kv_element_bytes
from swarm.stage import LocalRing, StageModel, stage_specs
from swarm.stage.kv_cache import PackedCache, Q8Layer, dequantize_q8, held_bytes, is_packed, new_cache, quantize_q8
from swarm.stage.local import forward_through
from swarm.store.manifest import load_manifest

PROMPT = [1, 300, 200, 100, 50, 25, 12, 6, 3, 77, 78, 79, 80, 81, 82, 83, 84, 85, 86, 87, 88, 17, 42, 99, 3, 250, 7]
# Measured on the tiny models (conftest.TINY_MODELS: random weights, head dimension 16, logits up to ~6), a 27-token
# prompt in chunks of 8 then 12 decode steps: the largest relative error of a position's logits (L2 norm of the
# difference over the norm of float32 KV's logits) was 0.052 at q8 (llama), 0.027 (qwen3), 0.0014 (gemma3: one global
# layer of six), against 0.0023 at f16 (llama); largest single logit difference 0.26. The bounds leave ~1.5x room.
# Random tiny models attend sharply (initializer_range 0.2); on the built-in model q8 costs 0.09 % perplexity
# (bench/kv_cache.py).
Q8_RELATIVE = 0.08
Q8_LARGEST = 0.4


def test_q8_rounds_each_value_within_half_a_step_of_its_group():
    x = torch.randn(1, 2, 9, 64, generator=torch.Generator().manual_seed(3)) * 4
    x[0, 0, 0, :Q8_GROUP] = 0  # a group of zeros stays zeros
    values, scale = quantize_q8(x)
    assert values.dtype == torch.int8 and scale.dtype == torch.float16 and scale.shape == (1, 2, 9, 64 // Q8_GROUP)
    back = dequantize_q8(values, scale, torch.float32)
    step = scale.float().repeat_interleave(Q8_GROUP, dim=-1)
    assert torch.all((back - x).abs() <= step / 2 + 1e-6)
    assert torch.all(back[0, 0, 0, :Q8_GROUP] == 0)
    assert values.abs().max() == 127  # each group's largest value uses the full range
    # bytes: an int8 per value and a float16 per 32 -- 0.53x of f16, as placement counts them
    held = values.numel() + scale.numel() * 2
    assert held / (x.numel() * 2) == pytest.approx(kv_element_bytes("q8", 4) / 2) == pytest.approx(0.53125)


def test_a_head_dimension_that_is_no_multiple_of_32_groups_by_its_divisor():
    x = torch.randn(1, 1, 3, 16)
    values, scale = quantize_q8(x)
    assert scale.shape == (1, 1, 3, 1)
    assert torch.allclose(dequantize_q8(values, scale, torch.float32), x, atol=float(scale.max()) / 2 + 1e-6)


def _stages(model_dir, kind: str, count: int = 2):
    stages = [StageModel.load_dir(model_dir, s) for s in stage_specs(load_manifest(model_dir).num_layers, count)]
    for stage in stages:
        stage.kv_cache = kind
    return stages


def _logits(stages, prompt: list[int], follow: list[int], chunk: int = 8) -> list[torch.Tensor]:
    """The last stage's logits at the end of each prompt chunk and after each token of ``follow`` (decode steps)."""
    for stage in stages:
        stage.new_request("r")
    out = []
    for start in range(0, len(prompt), chunk):
        out.append(forward_through(stages, "r", start, prompt[start:start + chunk]))
    for i, token in enumerate(follow):
        out.append(forward_through(stages, "r", len(prompt) + i, [token]))
    return out


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3"])
def test_q8_kv_logits_stay_within_the_measured_tolerance_of_float32_kv(tiny_model_dirs, family):
    f32 = _stages(tiny_model_dirs[family], "f32")
    q8 = _stages(tiny_model_dirs[family], "q8")
    f32[-1].new_request("x")
    q8[-1].new_request("x")
    assert not is_packed(f32[-1].request_cache("x"))
    cache = q8[-1].request_cache("x")
    assert is_packed(cache) and any(isinstance(layer, Q8Layer) for layer in cache.layers)
    follow = [5, 250, 17, 42, 99, 3, 7, 300, 12, 6, 80, 81]
    want, got = _logits(f32, PROMPT, follow), _logits(q8, PROMPT, follow)
    f16 = _logits(_stages(tiny_model_dirs[family], "f16"), PROMPT, follow)

    def relative(other):
        return max(float((a - b).norm() / a.norm()) for a, b in zip(want, other))

    largest = max(float((a - b).abs().max()) for a, b in zip(want, got))
    assert 0 < relative(got) < Q8_RELATIVE and largest < Q8_LARGEST, (family, relative(got), largest)
    assert relative(f16) < relative(got), "f16 keys and values are the closer to float32's"
    # an int8 and a float16 scale per group (16 values: the tiny models' head dimension) against 4 bytes a value
    # (gemma3's local layers keep their window as is)
    length = q8[0].cached_length("r")
    plain, packed = held_bytes(f32[0].request_cache("r")), held_bytes(q8[0].request_cache("r"))
    assert length == len(PROMPT) + 12
    if family != "gemma3":
        assert packed / plain == pytest.approx((1 + 2 / 16) / 4, rel=0.01)


def test_q8_caches_roll_back_share_and_recompute_as_plain_ones_do(tiny_model_dirs):
    """Rollback (a rejected draft, a retried chunk) and a group's shared prompt cache work on q8 layers: recomputing
    the rolled-back tokens gives the logits they gave before, and a copy goes on as the original."""
    stages = _stages(tiny_model_dirs["llama"], "q8")
    for stage in stages:
        stage.new_request("r")
    first = forward_through(stages, "r", 0, PROMPT)
    before = forward_through(stages, "r", len(PROMPT), [5, 6, 7])
    for stage in stages:
        stage.rollback("r", len(PROMPT))
        assert stage.cached_length("r") == len(PROMPT)
    again = forward_through(stages, "r", len(PROMPT), [5, 6, 7])
    assert torch.equal(before, again)
    for stage in stages:
        stage.fan_out("r", ["a", "b"])
    a, b = (forward_through(stages, rid, len(PROMPT) + 3, [9]) for rid in ("a", "b"))
    assert torch.equal(a, b) and first.shape == a.shape
    copied = copy.deepcopy(stages[0].request_cache("a"))
    assert isinstance(copied, PackedCache) and copied.get_seq_length() == len(PROMPT) + 4


def test_a_q8_ring_answers_what_generate_answers_with_a_q8_cache(tiny_model_dirs):
    """Over 2 stages with q8 KV, in prompt chunks and with requests in the ring at once, each reply is transformers'
    `generate` in one process given the same q8 cache class (near-tie rule: tests/exactness.py) -- the ring adds
    nothing to what q8 itself changes."""
    from exactness import check_reply

    model_dir = tiny_model_dirs["llama"]
    model = load_reference_model(model_dir)
    prompts = [PROMPT[: 20 + i] for i in range(3)]
    references = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False,
                                 eos_token_id=None, pad_token_id=0, cache=new_cache(model.config, "q8"),
                                 output_logits=True, return_dict_in_generate=True)
        margins = [float(torch.topk(step[0], 2).values.diff().abs()) for step in out.logits]
        references.append((out.sequences[0, len(prompt):].tolist(), margins))
    ring = LocalRing(_stages(model_dir, "q8"), prefill_chunk=8)
    replies = [ring.submit(f"r{i}", prompt, 16) for i, prompt in enumerate(prompts)]
    ring.run()
    for reply, (want, margins) in zip(replies, references):
        check_reply(reply.tokens, want, margins)
    assert all(stage.requests() == [] for stage in ring.stages)


def test_kv_kinds_are_checked_and_auto_keeps_the_librarys_cache(tiny_model_dirs):
    from swarm.errors import BadRequest
    from swarm.stage.architectures import config_from_dict

    assert check_kv_kind(None) == "auto" and check_kv_kind("q8") == "q8"
    with pytest.raises(BadRequest, match="kv_cache must be one of auto, f32, f16, q8"):
        check_kv_kind("q4")
    import json

    config = config_from_dict(json.loads((tiny_model_dirs["llama"] / "config.json").read_text()))
    assert type(new_cache(config, "auto")).__name__ == "DynamicCache"
    assert type(new_cache(config, "f32", torch.float32)).__name__ == "DynamicCache"  # the compute dtype: as it is
    assert isinstance(new_cache(config, "f16", torch.float32), PackedCache)
