"""GGUF's Q8_0, Q5_0, Q5_1, Q5_K, Q6_K and MXFP4 tensors on swarm's 8-bit kernel (swarm.stage.q8_kernel, gguf_q8):
repacked without loss (gguf-py's dequantization to the bit), computing what the float layer computes to within the 8-bit
rounding of the activations (a bound computed per output), each row alone whatever the batch and thread count, the
same on the kernel's other builds, and on torch where the kernel cannot be built; wrong inputs are refused."""

from __future__ import annotations

import platform

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from gguf_files import quantized_blocks
from kernel_reference import q8_activations, q8_reference
from swarm.errors import KernelMismatch, ModelError
from swarm.stage import gguf_q8, q8_kernel

pytestmark = pytest.mark.skipif(q8_kernel.kernel() is None, reason="no C compiler here to build the kernel")

TYPES = sorted(gguf_q8.SUPPORTED)
# fp16 scales of the K types' blocks (ggml-common.h: block_q5_K's d and dmin, block_q6_K's d), set to random values
# per block so that the random bytes make blocks of many scales, negative ones included
_K_SCALES = {"Q5_K": (0, 2), "Q6_K": (208,)}
# 576 inputs: a block of 16 groups and a last block of 2 (SmolLM2's hidden size); 1536: whole blocks; 96: a last
# block alone. The K types' rows are whole blocks of 256: 768 (a block of 16 groups and one of 8), 512.
SHAPES = {"MXFP4": (576, 96), "Q8_0": (576, 1536, 96), "Q5_0": (576, 96), "Q5_1": (576, 96), "Q5_K": (768, 512),
          "Q6_K": (768, 512)}


def blocks(kind: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """(rows, bytes per row) blocks of ``kind``: random data quantized by gguf-py where it can (Q8_0, Q5_0, Q5_1), else
    random bytes with random finite fp16 scales"""
    rng = np.random.default_rng(seed)
    if kind in _K_SCALES:
        data = quantized_blocks(kind, rows, cols, rng).reshape(rows, cols // 256, -1)
        for at in _K_SCALES[kind]:
            scales = (rng.standard_normal((rows, cols // 256)) * 0.003).astype(np.float16)
            data[:, :, at : at + 2] = scales.view(np.uint8).reshape(rows, cols // 256, 2)
        return data.reshape(rows, -1)
    return quants.quantize((0.05 * rng.standard_normal((rows, cols))).astype(np.float32), GGMLQuantizationType[kind])


def layer(kind: str, rows: int, cols: int, seed: int = 0, bias: torch.Tensor | None = None):
    raw = blocks(kind, rows, cols, seed)
    return gguf_q8.q8_linear(torch.from_numpy(raw), kind, (rows, cols), bias), raw


def activations(rows: int, cols: int, seed: int = 1) -> torch.Tensor:
    x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed))
    x[0, 5] = 40.0  # an outlier: its group's other activations get a coarser step
    return x


@pytest.mark.parametrize("kind", TYPES)
def test_repacked_blocks_dequantize_to_gguf_pys_values_to_the_bit(kind):
    for cols in SHAPES[kind]:
        linear, raw = layer(kind, 37, cols)
        want = torch.from_numpy(quants.dequantize(raw, GGMLQuantizationType[kind]).astype(np.float32))
        got = linear.dequantized()
        assert got.dtype == torch.float32 and got.shape == (37, cols)
        assert torch.equal(got.view(torch.int32), want.view(torch.int32)), kind  # the bits, signed zeros included
        # a byte a weight for Q8_0, 5/8 for the 5-bit types and 6/8 for Q6_K (each output's last 64 inputs padded),
        # and scales: one row of them per group (two for Q6_K's halves, one more for offsets)
        # fp16 scales (and offsets) where the file's are fp16 (Q8_0, Q5_0, Q5_1); the K types' as their int8 sub-scales
        # plus an fp16 multiplier per 8 of them (1.25 bytes a scale)
        held = linear.packed.numel() + linear.scales.element_size() * linear.scales.numel()
        parts = 1 + (kind == "Q6_K") + (kind in ("Q5_1", "Q5_K"))
        level_bytes = {"Q8_0": cols, "Q6_K": -(-cols // 64) * 48}.get(kind, -(-cols // 64) * 40)
        scale_bytes = 2 if kind in ("Q8_0", "Q5_0", "Q5_1", "MXFP4") else 1.25
        assert held == 37 * (level_bytes + cols // 32 * parts * scale_bytes)


def bound(linear, x: torch.Tensor) -> torch.Tensor:
    """Per row and output, how far the kernel may be from the float layer: each activation is rounded to d/2 at
    most (d = its group's max |x| / 127), which moves the result by sum |s q| d / 2; plus float32 rounding, counted
    generously as 4 k float32 epsilons of sum |x| |w| (the kernel's and the dequantized weights' own roundings)."""
    q, scale, offset = linear.grid()
    rows, k = x.shape
    _, d = q8_activations(x)
    scaled = (q.double() * scale.double().repeat_interleave(16, -1)).abs()
    rounding = (d.double().repeat_interleave(32, -1) / 2) @ scaled.T
    w = scaled if offset is None else scaled + offset.double().abs().repeat_interleave(32, -1)
    return rounding + 4 * k * 2.0**-24 * (x.double().abs() @ w.T)


@pytest.mark.parametrize("kind", TYPES)
def test_the_layer_is_the_float_layer_to_within_the_activations_8_bits(kind):
    for cols in SHAPES[kind]:
        bias = torch.randn(45, generator=torch.Generator().manual_seed(2))
        linear, _ = layer(kind, 45, cols, seed=3, bias=bias)
        x = activations(6, cols)
        got = linear(x)
        assert got.shape == (6, 45) and got.dtype == torch.float32
        exact = x.double() @ linear.dequantized().double().T + bias.double()
        err = (got.double() - exact).abs()
        limit = bound(linear, x)
        assert (err <= limit).all(), (kind, cols, (err / limit).max())
        # and exactly the kernel's arithmetic: the rows quantized to 8 bits, in integers, to float32 rounding
        q, scale, offset = linear.grid()
        want = q8_reference(x, q, scale, offset) + bias.double()
        assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


def test_any_leading_dims_and_half_precision_rows():
    linear, _ = layer("Q8_0", 40, 576)
    x = activations(6, 576).reshape(2, 3, 576)
    y = linear(x)
    assert y.shape == (2, 3, 40) and torch.equal(y.reshape(6, 40), linear(x.reshape(6, 576)))
    half = linear(x.bfloat16())
    assert half.dtype == torch.bfloat16 and torch.equal(half, linear(x.bfloat16().float()).bfloat16())


@pytest.mark.parametrize("kind", ["Q8_0", "Q6_K", "Q5_K"])  # one scale a group; two; with offsets
def test_each_row_is_computed_alone_whatever_the_batch_and_the_thread_count(kind):
    cols = SHAPES[kind][0]
    linear, _ = layer(kind, 200, cols, seed=4)
    x = activations(11, cols, seed=5)
    batch = linear(x)
    for row in range(11):  # a chat's row alone, or batched with any others, gives the same bits
        assert torch.equal(linear(x[row : row + 1])[0], batch[row])
    assert torch.equal(linear(x[3:8]), batch[3:8])  # a batch of 5
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = linear(x)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(alone, batch)


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="the other builds are x86-64's")
@pytest.mark.parametrize("march,path", [("x86-64-v3", "avx2"), ("x86-64-v3 -mavxvnni", "avx2-vnni"),
                                        ("x86-64", "generic")])  # AVX2 (AMD before Zen 4), with AVX-VNNI, plain C
def test_the_kernels_other_builds_compute_the_same(march, path):
    flags = tuple(f for flag in q8_kernel.FLAGS for f in (("-march=" + march).split() if flag == "-march=native"
                                                           else [flag]))
    other = q8_kernel.kernel(flags)
    assert other is not None and other.simd == path
    for kind in TYPES:
        for cols in SHAPES[kind]:
            linear, _ = layer(kind, 29, cols, seed=6)
            x = activations(9, cols, seed=7)
            got = other.matmul(x, linear.packed, linear.scales, linear.halves, linear.offsets, None, linear.bits,
                               linear.zero)
            want = q8_reference(x, *linear.grid())
            assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-5 * want.abs().max().item()), (kind, cols)
            if linear.bits != 8:  # the planes and a byte a level: the same integers, the same float steps
                wide = gguf_q8.q8_linear(torch.from_numpy(blocks(kind, 29, cols, 6)), kind, (29, cols), None, False)
                assert torch.equal(got, other.matmul(x, wide.packed, wide.scales, wide.halves, wide.offsets, None))


def test_without_the_kernel_layers_compute_on_torch_and_say_why(monkeypatch, caplog):
    monkeypatch.setattr(q8_kernel._kernels, "built", {})
    monkeypatch.setattr(q8_kernel.c_build.shutil, "which", lambda name: None)  # no C compiler on this machine
    linear, raw = layer("Q5_K", 40, 768)
    assert linear.kernel is None
    assert "no C compiler" in caplog.text and "install gcc" in caplog.text
    x = activations(3, 768)
    assert torch.allclose(linear(x), x @ linear.dequantized().T, rtol=1e-5, atol=1e-4)
    want = quants.dequantize(raw, GGMLQuantizationType.Q5_K).astype(np.float32)
    assert torch.equal(linear.dequantized(), torch.from_numpy(want))
    monkeypatch.undo()
    q8_kernel.use(False)  # SWARM_INT4_KERNEL=0: swarm's kernels off
    try:
        assert layer("Q8_0", 8, 96)[0].kernel is None
    finally:
        q8_kernel.use(True)
    assert layer("Q8_0", 8, 96)[0].kernel is not None


def test_a_compiler_that_fails_is_said_and_leaves_nothing_half_built(monkeypatch, tmp_path, caplog):
    broken = tmp_path / "cc"
    broken.write_text("#!/bin/sh\necho 'cc: internal error' >&2\nexit 1\n")
    broken.chmod(0o755)
    monkeypatch.setattr(q8_kernel._kernels, "built", {})
    monkeypatch.setattr(q8_kernel.c_build.shutil, "which", lambda name: str(broken))
    monkeypatch.setattr(q8_kernel.c_build.platformdirs, "user_cache_dir", lambda name: str(tmp_path / "cache"))
    assert q8_kernel.kernel() is None
    assert "could not be built" in caplog.text and "internal error" in caplog.text
    assert not list((tmp_path / "cache").rglob("*.so*"))


N, K = 48, 576


@pytest.fixture(scope="module")
def q6():
    linear, _ = layer("Q6_K", N, 768)
    return linear


@pytest.mark.parametrize("case,words", [
    ("packed transposed", "the packed weights"),
    ("packed as int8", "torch.int8"),
    ("packed not contiguous", "not contiguous"),
    ("packed in 1-D", "2-D tensor"),
    ("scales as bfloat16", "torch.bfloat16"),
    ("scales without the second halves", "the scales and offsets"),
    ("scales not contiguous", "not contiguous"),
    ("bias of another size", "the bias"),
    ("activations in 3-D", "2-D CPU tensor"),
    ("activations of another width", "the packed weights"),
    ("activations off the CPU", "on meta"),
    ("inputs not whole groups", "whole number of groups of 32"),
    ("levels of 7 bits", "8/6/5-bit levels"),
    ("a zero beyond 6 bits", "6 bits with zero 64"),
])
def test_matmul_refuses_what_the_c_code_would_misread(q6, case, words):
    kernel = q8_kernel.kernel()
    packed, scales, x, bias, bits, zero = q6.packed, q6.scales, activations(3, 768), None, q6.bits, q6.zero
    if case == "packed transposed":
        packed = packed.t().contiguous()
    elif case == "packed as int8":
        packed = packed.view(torch.int8)
    elif case == "packed not contiguous":
        packed = torch.cat([packed, packed], 1)[:, : packed.shape[1]]
    elif case == "packed in 1-D":
        packed = packed.reshape(-1)
    elif case == "scales as bfloat16":
        scales = scales.bfloat16()
    elif case == "scales without the second halves":
        scales = scales[:, :1].contiguous()
    elif case == "scales not contiguous":
        scales = torch.cat([scales, scales], 1)[:, : scales.shape[1]]  # Q6_K's int8 sub-scales and fp16 d, as bytes
    elif case == "bias of another size":
        bias = torch.zeros(N + 1)
    elif case == "activations in 3-D":
        x = x[None]
    elif case == "activations of another width":
        x = activations(3, 768 - 64)  # at 6 bits, 768 - 32 pads to the same bytes: the scales say it
    elif case == "activations off the CPU":
        x = torch.empty(3, 768, device="meta")
    elif case == "inputs not whole groups":
        x = activations(3, 768 - 16)
    elif case == "levels of 7 bits":
        bits = 7
    elif case == "a zero beyond 6 bits":
        zero = 64
    with pytest.raises(KernelMismatch) as caught:
        kernel.matmul(x, packed, scales, True, False, bias, bits, zero)
    message = str(caught.value)
    assert words in message and "bug in swarm" in message, message


@pytest.mark.parametrize("case,words", [
    ("a type the kernel does not take", "Q4_K"),
    ("blocks of another shape", "cannot hold a weight of shape (40, 576)"),
    ("blocks as int8", "2-D uint8"),
    ("a bias of another size", "does not fit a weight"),
])
def test_q8_linear_refuses_blocks_that_do_not_fit(case, words):
    raw = torch.from_numpy(blocks("Q8_0", 40, 576))
    kind, shape, bias = "Q8_0", (40, 576), None
    if case == "a type the kernel does not take":
        kind = "Q4_K"
    elif case == "blocks of another shape":
        raw = raw[:, :-34]
    elif case == "blocks as int8":
        raw = raw.view(torch.int8)
    elif case == "a bias of another size":
        bias = torch.zeros(41)
    with pytest.raises(ModelError, match=words.replace("(", r"\(").replace(")", r"\)")):
        gguf_q8.q8_linear(raw, kind, shape, bias)
    linear, _ = layer("Q8_0", 40, 576)
    with pytest.raises(ModelError, match="rows of 512"):
        linear(torch.randn(2, 512))


def test_the_built_in_models_q8_0_head_repacks_to_the_bit_and_computes_within_the_bound():
    """The built-in GGUF's one Q8_0 tensor, token_embd (49152 x 576, the tied head): real blocks, not made-up ones"""
    from swarm.errors import ImportFailed
    from swarm.store.gguf_source import GGUFSource
    from swarm.store.importer import builtin_gguf_path

    try:
        path = builtin_gguf_path()
    except ImportFailed as exc:
        pytest.skip(str(exc))
    tensor = next(t for t in GGUFSource(path).reader.tensors if t.name == "token_embd.weight")  # the lean reader: 4 s
    assert tensor.tensor_type == GGMLQuantizationType.Q8_0
    raw = np.asarray(tensor.data)[:8192]  # a sixth of its rows (each row's blocks stand alone): a few seconds
    rows, cols = 8192, 576
    head = gguf_q8.q8_linear(torch.from_numpy(raw.copy()), "Q8_0", (rows, cols), None)
    want = torch.from_numpy(quants.dequantize(raw, GGMLQuantizationType.Q8_0).astype(np.float32))
    assert torch.equal(head.dequantized().view(torch.int32), want.view(torch.int32))
    some = gguf_q8.q8_linear(torch.from_numpy(raw[:4096].copy()), "Q8_0", (4096, cols), None)
    x = activations(3, cols) * 0.1
    got = some(x)
    assert torch.equal(got, head(x)[:, :4096])  # the same outputs whatever else the layer holds
    err = (got.double() - x.double() @ want[:4096].double().T).abs()
    assert (err <= bound(some, x)).all()


@pytest.mark.parametrize("kind", ["Q8_0", "Q5_1"])
def test_fp16_scales_of_any_value_are_held_and_computed_exactly(kind):
    """Q8_0's d and Q5_1's d and m stay the file's fp16 values: zero, negative, subnormal and large ones included, on
    every build of the kernel (the plain-C conversion of halves too)"""
    values, size = {"Q8_0": (32, 34), "Q5_1": (32, 24)}[kind]
    raw = blocks(kind, 16, 576, seed=8).reshape(16, 576 // values, size).copy()
    special = np.array([0.0, -0.0, 6e-8, -3e-6, 6.1e-5, -2.5, 60000.0, 1e-3], dtype=np.float16)
    picked = special[np.random.default_rng(9).integers(0, len(special), raw.shape[:2] + (2,))]  # d, m per block
    raw[:, :, 0:2] = picked[..., 0:1].view(np.uint8)
    if kind == "Q5_1":
        raw[:, :, 2:4] = picked[..., 1:2].view(np.uint8)
    raw = raw.reshape(16, -1)
    linear = gguf_q8.q8_linear(torch.from_numpy(raw), kind, (16, 576), None)
    assert linear.scales.dtype == torch.float16
    want = torch.from_numpy(quants.dequantize(raw, GGMLQuantizationType[kind]).astype(np.float32))
    assert torch.equal(linear.dequantized().view(torch.int32), want.view(torch.int32))
    x = activations(3, 576, seed=10) * 0.01
    reference = q8_reference(x, *linear.grid())
    builds = [q8_kernel.FLAGS]
    if platform.machine() in ("x86_64", "AMD64"):
        builds += [tuple(f for flag in q8_kernel.FLAGS for f in ([f"-march={march}"] if flag == "-march=native"
                                                                 else [flag])) for march in ("x86-64-v3", "x86-64")]
    for flags in builds:
        built = q8_kernel.kernel(flags)
        assert built is not None
        got = built.matmul(x, linear.packed, linear.scales, False, linear.offsets, None, linear.bits, linear.zero)
        assert torch.allclose(got.double(), reference, rtol=1e-5, atol=1e-5 * reference.abs().max().item()), flags


def test_mxfp4_every_nibble_and_every_exponent_fp16_holds_repack_to_the_bit_and_others_widen(caplog):
    """MXFP4's 16 E2M1 nibbles (-0 included) with the E8M0 exponents at fp16's ends (2^-24, 2^15) repack to gguf-py's
    values to the bit; a tensor with one scale fp16 cannot hold (2^-25, 2^16, ggml's subnormal e < 2) is refused by
    the kernel's layer and widens to float32 at gguf_linear, saying so"""
    from swarm.stage.gguf_linear import gguf_linear

    rng = np.random.default_rng(11)
    raw = rng.integers(0, 256, (8, 576 // 32, 17), dtype=np.uint8)
    raw[:, :, 0] = rng.choice(np.array([104, 105, 120, 127, 128, 130, 143], dtype=np.uint8), raw.shape[:2])
    raw = raw.reshape(8, -1)
    linear = gguf_q8.q8_linear(torch.from_numpy(raw), "MXFP4", (8, 576), None)
    assert linear.scales.dtype == torch.float16 and (linear.bits, linear.zero) == (5, 16)
    want = torch.from_numpy(quants.dequantize(raw, GGMLQuantizationType.MXFP4).astype(np.float32))
    assert torch.equal(linear.dequantized().view(torch.int32), want.view(torch.int32))
    x = activations(3, 576, seed=12)
    assert torch.allclose(linear(x).double(), q8_reference(x, *linear.grid()), rtol=1e-5, atol=1e-9)
    for e in (0, 1, 103, 144):
        wide = raw.reshape(8, -1, 17).copy()
        wide[3, 2, 0] = e
        wide = torch.from_numpy(wide.reshape(8, -1))
        assert not gguf_q8.fits(wide, "MXFP4")
        with pytest.raises(ModelError, match="float16"):
            gguf_q8.q8_linear(wide, "MXFP4", (8, 576), None)
        caplog.clear()
        with caplog.at_level("WARNING"):
            plain = gguf_linear(wide, "MXFP4", (8, 576), None)
        assert isinstance(plain, torch.nn.Linear) and "widens to float32" in caplog.text
        exact = torch.from_numpy(quants.dequantize(wide.numpy(), GGMLQuantizationType.MXFP4).astype(np.float32))
        assert torch.equal(plain.weight.view(torch.int32), exact.view(torch.int32))
        assert torch.equal(gguf_q8.widen(wide, "MXFP4", 576).view(torch.int32), exact.view(torch.int32))
