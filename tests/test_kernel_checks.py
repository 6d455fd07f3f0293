"""The C kernel's Python face (swarm.stage.int4_kernel, swarm.stage.compiled_decode) refuses tensors the C code would
misread -- wrong shape, dtype, layout or device -- and a struct mirror whose layout is not the C file's, with
KernelMismatch, before any C code runs."""

from __future__ import annotations

import ctypes

import pytest
import torch
from transformers.cache_utils import DynamicCache

from swarm.errors import KernelMismatch
from swarm.stage import compiled_decode, int4_kernel
from swarm.stage.slice import StageModel
from swarm.stage.slice_load import stage_specs
from swarm.store.manifest import load_manifest

pytestmark = pytest.mark.skipif(int4_kernel.kernel() is None, reason="no C compiler here to build the kernel")

N, K = 48, 576  # a block of 512 inputs and a tail pair


@pytest.fixture(scope="module")
def layer():
    g = torch.Generator().manual_seed(0)
    q = torch.randint(0, 16, (N, K), generator=g)
    scale = (torch.rand(N, K // 32, generator=g) * 0.02 + 1e-3).to(torch.bfloat16)
    zero = (torch.randn(N, K // 32, generator=g) * 0.01).to(torch.bfloat16)
    packed, scale_zeros = int4_kernel.kernel().pack(q, scale, zero)
    return packed, scale_zeros, torch.randn(3, K, generator=g)


def test_the_packed_layout_is_what_matmul_takes(layer):
    packed, scale_zeros, x = layer
    assert packed.shape == (N, K // 2) and packed.dtype == torch.uint8
    assert scale_zeros.shape == (N, 2, K // 32) and scale_zeros.dtype == torch.bfloat16
    y = int4_kernel.kernel().matmul(x, packed, scale_zeros, N, torch.zeros(N))
    assert y.shape == (3, N) and y.isfinite().all()


def _other_k(layer):
    """Scales and offsets of a layer with 64 more inputs: right dtype and layout, the wrong group count."""
    return torch.zeros((N, 2, (K + 64) // 32), dtype=torch.bfloat16)


@pytest.mark.parametrize("case,words", [
    ("packed transposed", "the packed weights"),
    ("packed for fewer outputs", "the packed weights"),
    ("packed as int32", "torch.int32"),
    ("packed not contiguous", "not contiguous"),
    ("scales as float64", "torch.float64"),  # bfloat16, or pack_exact's float32 / float16: nothing else
    ("scales of another layer", "the scales and offsets"),
    ("scales not contiguous", "not contiguous"),
    ("bias of another size", "the bias"),
    ("activations in 3-D", "2-D CPU tensor"),
    ("activations of another width", "the packed weights"),
    ("activations off the CPU", "on meta"),
    ("inputs not whole pairs of groups", "multiple of 64"),
])
def test_matmul_refuses_what_the_c_code_would_misread(layer, case, words):
    packed, scale_zeros, x = layer
    bias = None
    out = N
    if case == "packed transposed":
        packed = packed.t().contiguous()
    elif case == "packed for fewer outputs":
        packed = packed[:-1].contiguous()
    elif case == "packed as int32":
        packed = packed.to(torch.int32)
    elif case == "packed not contiguous":
        packed = torch.cat([packed, packed], 1)[:, : K // 2]
    elif case == "scales as float64":
        scale_zeros = scale_zeros.double()
    elif case == "scales of another layer":
        scale_zeros = _other_k(layer)
    elif case == "scales not contiguous":
        scale_zeros = scale_zeros.transpose(1, 2).contiguous().transpose(1, 2)
    elif case == "bias of another size":
        bias = torch.zeros(N + 1)
    elif case == "activations in 3-D":
        x = x[None]
    elif case == "activations of another width":
        x = torch.randn(3, K - 64)
    elif case == "activations off the CPU":
        x = torch.empty(3, K, device="meta")
    elif case == "inputs not whole pairs of groups":
        x = torch.randn(3, K - 32)
    with pytest.raises(KernelMismatch) as caught:
        int4_kernel.kernel().matmul(x, packed, scale_zeros, out, bias)
    message = str(caught.value)
    assert words in message and "bug in swarm" in message
    assert isinstance(caught.value, ValueError)  # what torch's own operations raise for such inputs


def test_the_c_struct_layout_is_the_python_mirrors():
    kernel = int4_kernel.kernel()
    mirror = compiled_decode._Layer
    size, *offsets = kernel.layer_layout
    assert size == ctypes.sizeof(mirror)
    assert offsets == [getattr(mirror, name).offset for name, _ in mirror._fields_]
    assert len(offsets) == 22  # 5 ints, 2 floats, 14 pointers, the scales' format
    assert kernel.layer_calls(mirror) == kernel.layer_calls(mirror)


def _mirror(fields):
    return type("_Other", (ctypes.Structure,), {"_fields_": fields})


@pytest.mark.parametrize("change", ["eps as a double", "a pointer dropped", "two pointers swapped in type"])
def test_a_mirror_of_another_layout_is_refused(change):
    fields = list(compiled_decode._Layer._fields_)
    if change == "eps as a double":
        fields[5] = ("eps", ctypes.c_double)
    elif change == "a pointer dropped":
        fields = fields[:-1]
    else:  # the same names, one pointer now an int: every later offset moves
        fields[7] = ("in_norm", ctypes.c_int)
    with pytest.raises(KernelMismatch, match="mirror _Other is .* bytes with fields at .* is a bug in swarm"):
        int4_kernel.kernel().layer_calls(_mirror(fields))


@pytest.fixture(scope="module")
def stage(tiny_model_dirs):
    model_dir = tiny_model_dirs["qwen3"]
    spec = stage_specs(load_manifest(model_dir).num_layers, 1)[0]
    return StageModel.load_dir(model_dir, spec, quantization="int4-fast")


def test_a_stage_is_not_loaded_with_a_mirror_of_another_layout(tiny_model_dirs, monkeypatch):
    fields = list(compiled_decode._Layer._fields_)[:-1]
    monkeypatch.setattr(compiled_decode, "_Layer", _mirror(fields))
    model_dir = tiny_model_dirs["qwen3"]
    spec = stage_specs(load_manifest(model_dir).num_layers, 1)[0]
    with pytest.raises(KernelMismatch, match="layer struct"):
        StageModel.load_dir(model_dir, spec, quantization="int4-fast")


def _inputs(stage, rows=2):
    step = stage.layers[0].compiled_step
    x = torch.randn(rows, step.hidden)
    cos, sin = (t.reshape(1, -1).expand(rows, -1).contiguous() for t in compiled_decode._rotary(1, 3, step.head_dim))
    caches = [DynamicCache(config=stage.config) for _ in range(rows)]
    return step, x, cos, sin, caches


def test_the_decode_step_computes_with_what_it_takes(stage):
    step, x, cos, sin, caches = _inputs(stage)
    with torch.inference_mode():
        out = step.step(x.clone(), cos, sin, caches)
    assert out.shape == x.shape and out.isfinite().all() and not torch.equal(out, x)
    assert caches[0].layers[step.index].keys.shape[2] == 1


@pytest.mark.parametrize("case,words", [
    ("rows as float64", "torch.float64"),
    ("rows not contiguous", "not contiguous"),
    ("rows of another width", "the decode step's rows"),
    ("cosines of another head size", "the rotary cosines"),
    ("sines as bfloat16", "the rotary sines"),
    ("more rows than caches", "2 rows for 1 caches"),
    ("sizes that do not add up", "sizes summing to 3"),
    ("a cache of bfloat16", "a cache's keys"),
])
def test_the_decode_step_refuses_what_the_c_code_would_misread(stage, case, words):
    step, x, cos, sin, caches = _inputs(stage)
    sizes = None
    if case == "rows as float64":
        x = x.double()
    elif case == "rows not contiguous":
        x = torch.cat([x, x], 1)[:, : step.hidden]
    elif case == "rows of another width":
        x = torch.randn(2, step.hidden + 64)
    elif case == "cosines of another head size":
        cos = torch.randn(2, step.head_dim // 2)
    elif case == "sines as bfloat16":
        sin = sin.bfloat16()
    elif case == "more rows than caches":
        caches = caches[:1]
    elif case == "sizes that do not add up":
        sizes = [1, 2]
    elif case == "a cache of bfloat16":  # a cache the library's update filled in half precision
        keys = torch.randn(1, step.kv_heads, 2, step.head_dim, dtype=torch.bfloat16)
        compiled_decode.append(caches[0].layers[step.index], keys, keys.clone())
    with torch.inference_mode(), pytest.raises(KernelMismatch) as caught:
        step.step(x, cos, sin, caches, sizes)
    assert words in str(caught.value), caught.value


def test_a_step_over_weights_of_another_shape_is_refused(stage, monkeypatch):
    layer = stage.layers[0]
    down = layer.mlp.down_proj
    monkeypatch.setattr(down, "packed", down.packed[:, :-32].contiguous())  # a layer with 64 fewer inputs
    with pytest.raises(KernelMismatch, match="layer 0's down weights"):
        compiled_decode.CompiledStep(layer, stage.config, int4_kernel.kernel())
