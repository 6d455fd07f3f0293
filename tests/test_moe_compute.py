"""Computing a mixture of experts well: a pass reads only its routed experts' matrices, each once for all the rows
routed to it (a prompt chunk, a batch of decode steps), in float and quantized; quantized loads quantize the experts
and reply as the same quantization in one process, over stages and over real fellows; placement counts the
quantized bytes and the planner the active ones."""

from __future__ import annotations

import collections
import json
from pathlib import Path

import pytest
import torch
import trio
from torch.overrides import TorchFunctionMode

from conftest import shared_once
from exactness import check_reply, reference

NEW_TOKENS = 10
_COMMON = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, vocab_size=320,
               max_position_embeddings=256, initializer_range=0.2, bos_token_id=1, eos_token_id=2, pad_token_id=0,
               num_hidden_layers=4, tie_word_embeddings=False)
MODELS = {  # expert rows of 32: whole int4 groups along every expert matrix's input
    "qwen3_moe": ("Qwen3MoeConfig", dict(head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)),
    "qwen2_moe": ("Qwen2MoeConfig", dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=32,
                                         shared_expert_intermediate_size=64)),
}


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory) -> dict[str, Path]:
    """family -> its imported model dir."""
    import transformers

    from swarm.store.importer import import_model

    def build(root: Path) -> None:
        for kind, (class_name, kwargs) in MODELS.items():
            config = getattr(transformers, class_name)(**_COMMON, **kwargs)
            torch.manual_seed(99)
            transformers.AutoModelForCausalLM.from_config(config).save_pretrained(root / f"src-{kind}")
            import_model(str(root / f"src-{kind}"), root / "models", kind)

    root = shared_once(tmp_path_factory, "moe-compute", build)
    return {kind: root / "models" / kind for kind in MODELS}


class _ExpertReads(TorchFunctionMode):
    """Every use of a fused expert tensor in the pass: (layer, matrix, expert) for a view of one expert's slice, or
    (layer, matrix, the function's name) for any other use (the whole tensor, a gathered copy)."""

    def __init__(self, watched: dict[int, tuple[int, str]]):
        super().__init__()
        self.watched, self.reads = watched, []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if args and isinstance(args[0], torch.Tensor) and id(args[0]) in self.watched:
            layer, matrix = self.watched[id(args[0])]
            index = args[1] if func is torch.Tensor.__getitem__ and len(args) > 1 else None
            # an int index takes a view of the expert's slice; a tensor index gathers a copy of it (a read and a
            # write of the whole matrix), which counts as a use of its own
            single = isinstance(index, int)
            self.reads.append((layer, matrix, index if single else getattr(func, "__name__", str(func))))
        for a in [*args[1:], *(kwargs or {}).values()]:
            if isinstance(a, torch.Tensor) and id(a) in self.watched:
                self.reads.append((*self.watched[id(a)], getattr(func, "__name__", str(func))))
        return func(*args, **(kwargs or {}))


def _pass_reads(stage, run):
    """(expert slices read per layer and matrix, experts routed per layer) in the pass ``run()``."""
    from swarm.stage.moe_experts import QuantizedExperts

    routed: dict[int, list[int]] = {}
    handles, watched, reads = [], {}, []
    for i, layer in enumerate(stage.layers):
        experts = layer.mlp.experts

        def note(module, args, i=i):
            routed[i] = args[1].flatten().tolist()
        handles.append(experts.register_forward_pre_hook(note))
        if isinstance(experts, QuantizedExperts):
            for matrix, linears in (("up", experts.up), ("down", experts.down)):
                for e, linear in enumerate(linears):
                    handles.append(linear.register_forward_pre_hook(
                        lambda m, a, i=i, matrix=matrix, e=e: reads.append((i, matrix, e))))
        else:
            watched[id(experts.gate_up_proj)] = (i, "up")
            watched[id(experts.down_proj)] = (i, "down")
    try:
        mode = _ExpertReads(watched)
        with mode:
            run()
        reads += mode.reads
    finally:
        for h in handles:
            h.remove()
    return collections.Counter(reads), routed


@pytest.mark.parametrize("kind", ["none", "int8"])
def test_a_pass_reads_only_its_routed_experts_each_once_for_all_its_rows(moe_dirs, kind):
    from swarm.stage.ragged import forward_batch
    from swarm.stage.slice import StageModel
    from swarm.stage.slice_load import stage_specs

    (spec,) = stage_specs(4, 1)
    stage = StageModel.load_dir(moe_dirs["qwen3_moe"], spec, quantization=kind)
    prompts = [[5, 17, 42, 99, 7, 150, 3, 88, 21, 64, 9, 200], [11, 12, 13], [300, 4, 8, 1], [60, 61, 250]]
    for i in range(len(prompts)):
        stage.new_request(f"r{i}")

    def prefill():
        for i, p in enumerate(prompts):
            stage.forward(f"r{i}", 0, input_ids=torch.tensor([p]), want_logits=False)

    def batched_decode():  # one pass: a row of each of the 4 requests
        forward_batch(stage, [(f"r{i}", len(p), torch.tensor([[7 + i]]), True) for i, p in enumerate(prompts)],
                      alone=[True] * len(prompts))

    def one_step():  # a decode step of one request
        stage.forward("r1", len(prompts[1]) + 1, input_ids=torch.tensor([[9]]))

    for run, rows in ((lambda: stage.forward("r0", 0, input_ids=torch.tensor([prompts[0]]), want_logits=False), 12),
                      (batched_decode, 4), (one_step, 1)):
        if rows == 4:
            stage.drop("r0")
            stage.new_request("r0")
            prefill()
        reads, routed = _pass_reads(stage, run)
        if rows == 1:  # its top-2, once each
            assert all(len(set(routed[layer])) == 2 and reads[(layer, "up", routed[layer][0])] == 1
                       for layer in range(4))
            assert sum(reads.values()) == 4 * 2 * 2
            continue
        shared = 0
        for layer in range(4):
            hit = sorted(set(routed[layer]))
            for matrix in ("up", "down"):
                # each routed expert's matrix once for all its rows, no other expert's, never the whole tensor
                assert {e: reads[(layer, matrix, e)] for e in hit} == dict.fromkeys(hit, 1), (layer, matrix)
            assert sum(n for (lay, _, _), n in reads.items() if lay == layer) == 2 * len(hit)
            shared += len(routed[layer]) - len(hit)
        assert shared > 0  # some expert took several rows of the pass, and was read once for them


@pytest.mark.parametrize("kind", ["int8", "int4-fast"])
@pytest.mark.parametrize("family", list(MODELS))
def test_quantized_moe_over_two_stages_is_the_quantized_model_in_one_process(moe_dirs, family, kind):
    from reference_model import load_reference_model
    from swarm.leader.planning.placement import stage_weight_bytes
    from swarm.leader.serving.models import model_size
    from swarm.stage.local import LocalRing
    from swarm.stage.moe_experts import QuantizedExperts
    from swarm.stage.quantize import Int4Linear, Int8Linear, quantize_model
    from swarm.stage.slice import StageModel
    from swarm.stage.slice_load import stage_specs
    from swarm.store.manifest import load_manifest

    model_dir = moe_dirs[family]
    specs = stage_specs(4, 2)
    full = [StageModel.load_dir(model_dir, s) for s in specs]
    stages = [StageModel.load_dir(model_dir, s, quantization=kind) for s in specs]
    linear = Int8Linear if kind == "int8" else Int4Linear
    for stage in stages:
        for layer in stage.layers:
            assert isinstance(layer.mlp.experts, QuantizedExperts)
            assert all(isinstance(m, linear) for m in [*layer.mlp.experts.up, *layer.mlp.experts.down])
    # held near the plan: the plan counts the quantized experts (a router stays float32: a few percent here)
    size = model_size(json.loads(load_manifest(model_dir).to_json()), cpu=True, quantization=kind)
    for spec, stage, whole in zip(specs, stages, full):
        planned = stage_weight_bytes(size, spec.first_layer, spec.end_layer, spec.is_first, spec.is_last)
        assert 0.9 * planned < stage.parameter_bytes() < 1.1 * planned, (planned, stage.parameter_bytes())
        assert stage.parameter_bytes() < 0.5 * whole.parameter_bytes()

    prompt = [1, 17, 42, 99, 7, 250, 31, 5]
    want, margins = reference(quantize_model(load_reference_model(model_dir), kind), prompt, NEW_TOKENS)
    assert check_reply(LocalRing(stages).generate(prompt, NEW_TOKENS), want, margins) == "identical"


def test_the_plan_counts_a_token_s_active_experts(moe_dirs):
    from swarm.leader.planning.planner import active_layer_bytes
    from swarm.leader.serving.models import model_size
    from swarm.stage.slice import StageModel
    from swarm.stage.slice_load import stage_specs
    from swarm.store.manifest import load_manifest

    model_dir = moe_dirs["qwen2_moe"]
    config = json.loads((model_dir / "config.json").read_text())
    size = model_size(json.loads(load_manifest(model_dir).to_json()), cpu=True)
    active = active_layer_bytes(size.layer_bytes, config, 4)
    (spec,) = stage_specs(4, 1)
    layer = StageModel.load_dir(model_dir, spec).layers[0]
    experts = layer.mlp.experts
    # what a token reads: the layer less its unpicked experts (attention, router, shared expert and 2 experts stay)
    every = sum(p.numel() * 4 for p in layer.parameters())
    picked = 2 * (experts.gate_up_proj[0].numel() + experts.down_proj[0].numel()) * 4
    read = every - sum(p.numel() * 4 for p in experts.parameters()) + picked
    assert all(read <= a < read + 4096 for a in active)  # a layer file's header besides
    assert all(a < b for a, b in zip(active, size.layer_bytes))
    dense = {k: v for k, v in config.items() if k not in ("num_experts", "num_experts_per_tok")}
    assert active_layer_bytes(size.layer_bytes, dense, 4) == size.layer_bytes


@pytest.mark.e2e
async def test_quantized_moe_over_two_fellows_replies_as_in_one_process(tmp_path, moe_dirs):
    from harness import running_swarm
    from reference_model import load_reference_model
    from swarm.stage.quantize import quantize_model

    name = "qwen3_moe"
    prompt = [5, 17, 42, 99, 7, 150, 3, 88]

    async def tokens(swarm):
        return await swarm.greedy(name, prompt, NEW_TOKENS)

    with trio.fail_after(280):
        async with running_swarm(tmp_path, [moe_dirs[name]], fellows=2) as swarm:
            for kind in ("int8", "int4-fast"):
                r = await swarm.http.post(f"/api/v1/models/{name}/load", json={"num_stages": 2, "quantization": kind})
                assert r.status_code == 202, r.text
                await swarm.leader.serving.loader.wait_ready(name, 120)
                view = (await swarm.http.get(f"/api/v1/models/{name}")).json()
                assert view["quantization"] == kind and view["compression"] > 2
                held = [s.driver.stage_model.parameter_bytes() for f in swarm.fellows for s in f.stages.values()]
                planned = [s["memory_bytes"] for s in view["stages"]]
                assert all(0.9 * p < h < 1.1 * p for h, p in zip(held, planned)), (held, planned)
                want, margins = await trio.to_thread.run_sync(lambda kind=kind: reference(
                    quantize_model(load_reference_model(moe_dirs[name]), kind), prompt, NEW_TOKENS))
                assert check_reply(await tokens(swarm), want, margins) == "identical", kind


def test_the_plan_of_a_moe_adds_its_routing_to_its_active_weights():
    from swarm.leader.planning.placement import ModelSize, StagePlan
    from swarm.leader.planning.planner import layer_speed, predict, with_active_experts

    points = [{"weight_bytes": b, "decode_ms": 0.5 + b * 1e-6, "prefill_ms": 10 + b * 1e-5, "pass_ms": 0.1}
              for b in (1_000_000, 4_000_000)]
    speed = layer_speed({"points": points, "prefill_tokens": 1000, "moe": {"router_ms": 0.2, "expert_ms": 0.05}})
    assert (speed.moe_router_ms, speed.moe_expert_ms) == (0.2, 0.05)
    # Qwen3-30B-A3B's shape (config.json: hidden 2048, 128 experts of 768 rows, top-8), layers at a byte a weight
    config = {"hidden_size": 2048, "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768}
    expert = 3 * 2048 * 768
    layer = 128 * expert + 20_000_000  # its experts, and attention and router besides
    size = with_active_experts(ModelSize((layer,) * 4, 0, 0, False, 0), config, 1.0)
    assert size.compute_bytes == (8 * expert + 20_000_000,) * 4 and (size.experts, size.experts_per_token) == (128, 8)
    plan = [StagePlan(0, 1, "pc", 0, 4, 4 * layer, 0)]
    got = predict(plan, size, {1: speed}, [], 4096, prefill_chunk=256)["stages"][0]["decode_ms"]
    per_layer = 0.5 + (8 * expert + 20_000_000) * 1e-6 + 0.2 + 8 * 0.05
    assert got == pytest.approx(0.1 + 4 * per_layer)
    # an older calibration (no routing measured): shares of the dense layer's fixed cost
    older = layer_speed({"points": points, "prefill_tokens": 1000})
    assert older.moe_ms(8) == pytest.approx(0.5 * (0.25 + 0.33 * 8))


def test_the_plan_of_a_quantized_moe_counts_its_experts_at_the_kind_s_own_speed():
    from swarm.leader.planning.placement import ModelSize, StagePlan
    from swarm.leader.planning.planner import layer_speed, predict, with_active_experts

    points = [{"weight_bytes": b, "decode_ms": 0.5 + b * 1e-6, "prefill_ms": 10 + b * 1e-5, "pass_ms": 0.1}
              for b in (1_000_000, 4_000_000)]
    # one routed expert at int8: 0.05 ms + 2e-7 ms a byte (its kernel calls cost more per byte than float32's)
    moe = {"router_ms": 0.2, "expert_ms": 0.05,
           "kinds": {"int8": [[400_000, 0.05 + 400_000 * 2e-7], [1_200_000, 0.05 + 1_200_000 * 2e-7]]}}
    calibration = {"points": points, "prefill_tokens": 1000, "moe": moe}
    speed = layer_speed(calibration, kind="int8")
    assert speed.expert_fixed_ms == pytest.approx(0.05) and speed.expert_per_byte_ms == pytest.approx(2e-7)
    assert layer_speed(calibration, kind="nf4").expert_per_byte_ms is None  # int4-fast not timed: no figure for nf4
    config = {"hidden_size": 512, "num_experts": 32, "num_experts_per_tok": 4, "moe_intermediate_size": 256}
    expert = 3 * 512 * 256  # a byte a weight
    layer = 32 * expert + 800_000  # its experts, and attention and router besides
    size = with_active_experts(ModelSize((layer,) * 2, 0, 0, False, 0), config, 1.0)
    assert size.expert_bytes == expert
    plan = [StagePlan(0, 1, "pc", 0, 2, 2 * layer, 0)]
    got = predict(plan, size, {1: speed}, [], 2048)["stages"][0]["decode_ms"]
    # the layer's line for what is not an expert, then the routing and four experts at int8's own figures
    assert got == pytest.approx(0.1 + 2 * (0.5 + 800_000 * 1e-6 + 0.2 + 4 * (0.05 + expert * 2e-7)))
    # a kind the fellow did not time: every active byte at the layer's line, the routing beside
    plain = predict(plan, size, {1: layer_speed(calibration, kind="none")}, [], 2048)["stages"][0]["decode_ms"]
    assert plain == pytest.approx(0.1 + 2 * (0.5 + (800_000 + 4 * expert) * 1e-6 + 0.2 + 4 * 0.05))
    # unquantized experts timed too: int8's at a quarter of the bytes took 0.5x the time, so a byte of the layer's
    # attention at int8 counts as 4 * 0.5 = 2 of the dense line's float bytes
    moe["kinds"]["none"] = [[1_600_000, 0.2], [4_800_000, (0.05 + 1_200_000 * 2e-7) / 0.5]]
    speed = layer_speed(calibration, kind="int8")
    assert speed.kind_byte_factor == pytest.approx(4_800_000 / 1_200_000 * 0.5)
    got = predict(plan, size, {1: speed}, [], 2048)["stages"][0]["decode_ms"]
    assert got == pytest.approx(0.1 + 2 * (0.5 + 2 * 800_000 * 1e-6 + 0.2 + 4 * (0.05 + expert * 2e-7)))


def test_a_fellow_times_routed_experts_at_each_kind_it_serves():
    import torch

    from swarm.fellow import calibration
    from swarm.fellow.moe_calibration import EXPERT_SHAPES, measure_moe
    from swarm.quantization import kinds_on

    with torch.inference_mode():
        moe = measure_moe("cpu", torch.float32, lambda: None,
                          lambda fn, on, repeats, budget_s: calibration._typical(fn, on, 3, 0.05))
    assert set(moe["kinds"]) == {"none", "int8", "int4-fast"} & set(kinds_on("cpu"))
    for kind, points in moe["kinds"].items():
        assert len(points) == len(EXPERT_SHAPES) and all(ms > 0 for _, ms in points), (kind, points)
    none, int8 = moe["kinds"]["none"], moe["kinds"]["int8"]
    assert [b for b, _ in none] == [3 * h * r * 4 for h, r, _ in EXPERT_SHAPES]  # float32: 4 bytes a weight
    assert all(i < n / 3.9 for (i, _), (n, _) in zip(int8, none))  # a byte a weight and a scale per row


def test_the_readme_table_of_real_models_is_the_planner_s(tmp_path):
    from real_moe_models import table_rows

    rows = table_rows(tmp_path)  # headers of the real models' GGUFs, no weights, through the planner's functions
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    assert all(f"  {row}\n" in readme for row in rows), rows
    # the headers are the real files' (sizes as the Hub lists them: Qwen3-30B-A3B-Q4_K_M.gguf 18.6 GB,
    # Qwen3-235B-A22B Q4_K_M 142 GB in its parts)
    assert rows[0].startswith("| Qwen3-30B-A3B Q4_K_M | 18.6 GB |") and "| 142.1 GB |" in rows[3]
