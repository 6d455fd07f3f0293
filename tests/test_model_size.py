"""What placement counts a stage to hold at each quantization (swarm.leader.serving.models.model_size): every tensor
swarm.stage.quantize quantizes at swarm.quantization's bytes per weight, the rest in the compute dtype. The built-in
model's real stages (15 of 30 layers each, on CPU) held 4-36 KB less than this counts at every kind."""

from __future__ import annotations

import pytest

from swarm.leader.planning.placement import stage_weight_bytes
from swarm.leader.serving.models import model_size

HIDDEN, VOCAB, LAYERS = 1000, 50_000, 4
NORM = HIDDEN * 2  # one norm's weight in bfloat16
LAYER_FILE = 10_000_000 + 2 * NORM  # 5 M weights of linear layers and two norms, as stored in bfloat16
HEAD = VOCAB * HIDDEN * 2  # the embedding (or an untied head) in bfloat16


def manifest(tied: bool) -> dict:
    files = [{"kind": "layer", "layer": i, "size": LAYER_FILE} for i in range(LAYERS)]
    files += [{"kind": "embed", "size": HEAD}, {"kind": "final", "size": NORM + (0 if tied else HEAD)}]
    return {"dtype": "bfloat16", "num_layers": LAYERS, "hidden_size": HIDDEN, "tie_word_embeddings": tied,
            "kv_bytes_per_token": 512, "files": files}


def last_stage(size, first: int = 2) -> int:
    return stage_weight_bytes(size, first, LAYERS, first == 0, True)


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("kind, layer_byte, head_byte", [
    ("int8", 1.002, 1.002),  # int8 layers, an int8 head: a byte, and a bfloat16 scale per row of 1000
    ("nf4", 0.625, 1.002),  # 4 bits + a scale and offset per 32 weights; the head stays int8 (quality)
    ("int4-fast", 0.625, 0.625),  # the head at 4 bits too (speed)
])
def test_on_cpu_the_layers_linears_and_the_head_are_counted_quantized(tied, kind, layer_byte, head_byte):
    size = model_size(manifest(tied), cpu=True, quantization=kind)
    norms = 2 * HIDDEN * 4  # a layer's two norms stay in float32
    assert size.layer_bytes == pytest.approx((5_000_000 * layer_byte + norms,) * LAYERS, abs=1)
    assert size.embed_bytes == VOCAB * HIDDEN * 4  # the embedding is a lookup: float32, never quantized
    head = VOCAB * HIDDEN * head_byte
    # the last stage holds the layers, the float32 final norm and the quantized head -- and no float32 embedding for
    # a tied head (the stage quantizes a copy of it and drops the float one)
    assert last_stage(size) == pytest.approx(2 * size.layer_bytes[0] + HIDDEN * 4 + head, abs=2)
    # one stage holds the float32 embedding and the quantized head both
    assert last_stage(size, first=0) == pytest.approx(4 * size.layer_bytes[0] + VOCAB * HIDDEN * 4 + HIDDEN * 4 + head,
                                                      abs=2)
    full = model_size(manifest(tied), cpu=True)
    assert last_stage(size) < last_stage(full) / 2
    assert size.kv_bytes_per_token_per_layer == full.kv_bytes_per_token_per_layer == 1024  # the KV cache stays float32


@pytest.mark.parametrize("tied", [True, False])
def test_on_cuda_the_head_stays_in_half_precision(tied):
    size = model_size(manifest(tied), cpu=False, quantization="int4-fast")
    assert size.layer_bytes == (int(5_000_000 * (0.5 + 4 / 128) + 2 * NORM),) * LAYERS
    assert last_stage(size) == 2 * size.layer_bytes[0] + NORM + HEAD  # the bfloat16 head (tied: the embedding)


def test_unquantized_sizes_are_the_files_widened_on_cpu():
    for tied in (True, False):
        cpu, gpu = model_size(manifest(tied), cpu=True), model_size(manifest(tied), cpu=False)
        assert cpu.layer_bytes == (2 * LAYER_FILE,) * LAYERS and gpu.layer_bytes == (LAYER_FILE,) * LAYERS
        assert last_stage(cpu) == 2 * last_stage(gpu) == 2 * (2 * LAYER_FILE + NORM + HEAD)
