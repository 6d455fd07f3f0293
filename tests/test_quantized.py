"""Quantized loads: the CPU kernels against their own dequantized weights, a quantized ring against the same
quantization in one process (tiny models here; the built-in model over real fellows in the e2e test), placement at
the quantized sizes, and loads refused early on a fellow that cannot run the kind."""

from __future__ import annotations

import types

import pytest
import torch
import trio

from exactness import check_reply, reference
from harness import running_swarm

QUANTIZED = ["int8", "nf4", "int4-fast"]


def _linear(n_out: int, n_in: int, seed: int = 0) -> torch.nn.Linear:
    torch.manual_seed(seed)
    linear = torch.nn.Linear(n_in, n_out, bias=False)
    torch.nn.init.normal_(linear.weight, std=0.05)
    return linear


def test_cpu_int8_linear_computes_with_its_int8_weights():
    from swarm.stage.quantize import quantize_linear

    linear = _linear(192, 576)
    q = quantize_linear(linear, "int8")
    assert q.qweight.dtype == torch.int8 and q.qweight.shape == (192, 576)
    x = torch.randn(3, 5, 576)
    got = q(x)
    # the kernel takes bfloat16 activations (and answers in bfloat16): within its rounding of the exact product
    exact = x.bfloat16().float() @ q.dequantized().T
    assert (got - exact).norm() / exact.norm() < 0.005
    # per-row absmax / 127: each weight within half a step of the float one (a bfloat16 scale rounds a little)
    steps = (q.dequantized() - linear.weight).abs() / q.scales.float()[:, None]
    assert steps.max() <= 0.51
    assert (got - linear(x)).norm() / linear(x).norm() < 0.01


@pytest.mark.parametrize("kind", ["nf4", "int4-fast"])
def test_cpu_4bit_linear_holds_half_a_byte_per_weight_and_stays_close(kind):
    from swarm.stage.quantize import module_bytes, quantize_linear

    linear = _linear(1536, 576)
    q = quantize_linear(linear, kind)
    assert q.packed.dtype == torch.uint8 and q.packed.numel() == 1536 * 576 // 2
    assert module_bytes(q) == 1536 * 576 // 2 + (576 // 32) * 1536 * 2 * 2  # + a bfloat16 scale and offset per group
    x = torch.randn(2, 576)
    rel = ((q(x) - linear(x)).norm() / linear(x).norm()).item()
    assert 0.01 < rel < 0.12, rel  # 4 bits in groups of 32: a few percent off, not float


def test_a_layer_whose_inputs_do_not_fill_whole_groups_keeps_8_bits():
    from swarm.stage.quantize import Int8Linear, quantize_linear

    assert isinstance(quantize_linear(_linear(64, 48), "int4-fast"), Int8Linear)


def test_unknown_kind_is_a_bad_request():
    from swarm.errors import BadRequest
    from swarm.quantization import check_kind

    assert check_kind(None) == "none"
    with pytest.raises(BadRequest, match="none, int8, nf4, int4-fast"):
        check_kind("int3")


@pytest.mark.parametrize("kind", QUANTIZED)
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_quantized_ring_over_two_stages_is_the_quantized_model_in_one_process(tiny_model_dirs, family, kind):
    from reference_model import load_reference_model
    from swarm.stage.local import LocalRing
    from swarm.stage.quantize import quantize_model
    from swarm.stage.slice import StageModel
    from swarm.stage.slice_load import stage_specs

    model_dir = tiny_model_dirs[family]
    num_layers = len(load_reference_model(model_dir).model.layers)
    full = [StageModel.load_dir(model_dir, s) for s in stage_specs(num_layers, 2)]
    stages = [StageModel.load_dir(model_dir, s, quantization=kind) for s in stage_specs(num_layers, 2)]
    assert all(s.quantization == kind for s in stages)
    # decoder layers at 8 or 4 bits: every stage holds less
    assert all(q.parameter_bytes() < f.parameter_bytes() for q, f in zip(stages, full))

    prompt = [1, 17, 42, 99, 7, 250, 31, 5]
    want, margins = reference(quantize_model(load_reference_model(model_dir), kind), prompt, 24)
    float_want, _ = reference(load_reference_model(model_dir), prompt, 24)
    got = LocalRing(stages).generate(prompt, 24)
    assert check_reply(got, want, margins) == "identical"
    assert want != float_want or kind == "int8"  # the quantized reference is not simply the float one


def test_placement_and_budget_use_the_quantized_sizes():
    from swarm.errors import PlacementError
    from swarm.leader.planning.placement import FellowCapacity, place
    from swarm.leader.serving.models import model_size

    manifest = {"dtype": "bfloat16", "num_layers": 4, "tie_word_embeddings": True, "kv_bytes_per_token": 1000,
                "files": [{"kind": "layer", "layer": i, "size": 200_000_000} for i in range(4)]
                + [{"kind": "embed", "size": 50_000_000}, {"kind": "final", "size": 1000}]}
    full, int8, int4 = (model_size(manifest, cpu=True, quantization=k) for k in ("none", "int8", "int4-fast"))
    assert full.layer_bytes == (400_000_000,) * 4  # bfloat16 widened to float32 on CPU
    assert int8.layer_bytes == (100_000_000,) * 4  # a byte per weight
    assert int4.layer_bytes == (62_500_000,) * 4  # half a byte, plus a bfloat16 scale and offset per 32
    assert model_size(manifest, cpu=False, quantization="nf4").layer_bytes[0] < 0.27 * 200_000_000
    assert int8.kv_bytes_per_token_per_layer == full.kv_bytes_per_token_per_layer  # KV stays in float

    fellows = [FellowCapacity(1, "a", 700_000_000), FellowCapacity(2, "b", 700_000_000)]
    with pytest.raises(PlacementError, match="needs"):
        place(full, fellows, 2, 1024)
    plans = place(int8, fellows, 2, 1024)
    assert [p.weight_bytes for p in plans] == [300_000_000, 225_002_000]  # + the float32 embedding; an int8 head


def _fellow(fid: int, name: str, kinds: dict | None, gpus: list | None = None):
    from swarm.messages import Hardware

    hardware = Hardware(cpu_cores=2, ram_total_bytes=8 << 30, ram_free_bytes=4 << 30, gpus=gpus or [],
                        quantization=kinds)
    return types.SimpleNamespace(id=fid, name=name, hardware=hardware)


def test_a_fellow_that_cannot_run_the_kind_is_named_with_what_it_needs():
    from swarm.errors import PlacementError
    from swarm.leader.planning.placement import StagePlan
    from swarm.leader.serving.models import check_quantization
    from swarm.messages import Gpu

    cpu = _fellow(1, "pc-1", {"cpu": ["none", "int8", "nf4", "int4-fast"]})
    gpu = _fellow(2, "gpu-1", {"cpu": ["none", "int8", "nf4", "int4-fast"], "cuda": ["none"]},
                  [Gpu(0, "RTX 3060", 12 << 30, 10 << 30)])
    plans = [StagePlan(0, 1, "pc-1", 0, 2, 1, 1), StagePlan(1, 2, "gpu-1", 2, 4, 1, 1)]
    check_quantization("none", plans, {1: cpu, 2: gpu}, "auto")
    with pytest.raises(PlacementError) as refused:
        check_quantization("nf4", plans, {1: cpu, 2: gpu}, "auto")
    text = str(refused.value)
    assert "stage 1 on gpu-1 cannot load nf4 on its CUDA" in text and "pip install bitsandbytes" in text
    # the same fellow serving on its CPU (SWARM_DEVICE=cpu) runs it
    check_quantization("nf4", plans, {1: cpu, 2: gpu}, "cpu")


def test_too_few_fellows_on_the_current_version_load_in_full_precision():
    from swarm.leader.serving.models import quantized_fellows

    kinds = {"cpu": ["none", "int8"]}
    new, old = _fellow(1, "new", kinds), _fellow(2, "old", None)
    assert quantized_fellows("int8", [new, old], 1, "auto") == ([new], "int8")
    assert quantized_fellows("int8", [new, old], 2, "auto") == ([new, old], "none")
    assert quantized_fellows("none", [new, old], 2, "auto") == ([new, old], "none")


def test_this_machine_reports_the_kinds_it_runs():
    from swarm.fellow.hardware import probe
    from swarm.messages import Hardware

    hardware = Hardware.from_wire(probe().to_wire())
    assert hardware.quantization["cpu"] == ["none", "int8", "nf4", "int4-fast", "gguf"]
    assert hardware.quantization_kinds("cpu") == ["none", "int8", "nf4", "int4-fast", "gguf"]
    assert Hardware.from_wire({"cpu_cores": 1, "ram_total_bytes": 1, "ram_free_bytes": 1}).quantization is None


# --- end to end: the built-in model over two fellows ---------------------------------------------------------------

PROMPT = "Write a haiku about the sea."


@pytest.mark.e2e
async def test_quantized_loads_over_two_fellows_reply_as_the_same_quantization_in_one_process(
    tmp_path, smollm_model_dir
):
    from reference_model import load_reference_model
    from swarm.leader.chat.chat_format import encode_chat
    from swarm.stage.quantize import quantize_model

    name = smollm_model_dir.name
    ids = encode_chat(smollm_model_dir, [{"role": "user", "content": PROMPT}], None)
    with trio.fail_after(600):
        async with running_swarm(tmp_path, [smollm_model_dir]) as swarm:
            r = await swarm.http.post(f"/api/v1/models/{name}/load", json={"num_stages": 2, "quantization": "int2"})
            assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_quantization"
            full = await swarm.load(name, 2)
            assert full["quantization"] == "none" and full["compression"] == 1.0
            for kind in QUANTIZED:
                r = await swarm.http.post(f"/api/v1/models/{name}/load", json={"num_stages": 2, "quantization": kind})
                assert r.status_code == 202, r.text
                await swarm.leader.serving.loader.wait_ready(name, 120)
                view = (await swarm.http.get(f"/api/v1/models/{name}")).json()
                assert view["quantization"] == kind
                # float32 decoder layers at a byte (int8) or three quarters of one (4 bits) per weight
                assert view["compression"] > 1.5
                assert [s.driver.stage_model.quantization for f in swarm.fellows for s in f.stages.values()] == \
                    [kind, kind]
                held = [s.driver.stage_model.parameter_bytes() for f in swarm.fellows for s in f.stages.values()]
                assert sum(held) <= view["weight_bytes"], (held, view)

                data = await swarm.chat(name, [{"role": "user", "content": PROMPT}], max_tokens=24)
                want, margins = await trio.to_thread.run_sync(lambda kind=kind: reference(
                    quantize_model(load_reference_model(smollm_model_dir), kind), ids, 24, [2]))
                assert check_reply(data["choices"][0]["token_ids"], want, margins) == "identical", kind


def test_cuda_paths_without_their_libraries_degrade_then_say_what_to_install(monkeypatch):
    """No GPU here: the CUDA path runs on a CPU layer as far as it can. torchao's int4 that cannot run falls back to
    plain nf4 (the seed's rule), and nf4 without bitsandbytes is a ModelError naming the package to install."""
    import importlib.util

    import swarm.stage.quantize as quantize
    from swarm.errors import ModelError

    if importlib.util.find_spec("bitsandbytes") is not None:
        pytest.skip("bitsandbytes is installed here")
    monkeypatch.setattr(quantize, "cuda_path", lambda kind: "torchao")
    with pytest.raises(ModelError, match="pip install bitsandbytes"):
        quantize._cuda_linear(_linear(64, 64), "int4-fast")
