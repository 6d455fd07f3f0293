"""swarm's int4 kernel (swarm/stage/int4_kernel.c): what it computes, that each row is computed alone, its other
builds, and int4-fast on torch's kernel where it cannot be built."""

from __future__ import annotations

import platform

import pytest
import torch

from kernel_reference import int4_reference
from swarm.stage import int4_kernel
from swarm.stage.quantize import Int4Linear, quantize_linears

pytestmark = pytest.mark.skipif(int4_kernel.kernel() is None, reason="no C compiler here to build the kernel")


def levels(n: int, k: int, seed: int = 0):
    """Random 4-bit levels with bfloat16 scales and offsets per group of 32, as Int4Linear holds them."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=g)
    scale = (torch.rand(n, k // 32, generator=g) * 0.02 + 1e-3).to(torch.bfloat16)
    zero = (torch.randn(n, k // 32, generator=g) * 0.01).to(torch.bfloat16)
    return q, scale, zero


# blocks of 512 inputs and a tail of pairs: only a tail (64, 192), one block and an odd tail, first on odd outputs
# (576, 1088), blocks alone (1536), an even tail (896)
@pytest.mark.parametrize("n,k", [(70, 64), (33, 192), (96, 576), (21, 1536), (19, 896), (35, 1088)])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9])
def test_the_kernel_computes_the_4_bit_weights_against_the_rows_quantized_to_8_bits(n, k, rows):
    kernel = int4_kernel.kernel()
    q, scale, zero = levels(n, k)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(1)) * 3
    x[0, 5] = 40.0  # an outlier: its group's other activations get a coarser step
    packed, scale_zeros = kernel.pack(q, scale, zero)
    got = kernel.matmul(x, packed, scale_zeros, n, None)
    want = int4_reference(x, q, scale, zero)
    assert got.shape == (rows, n) and got.dtype == torch.float32
    assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-4), (got.double() - want).abs().max()
    # and it is the float layer on those levels, to within the activations' 8 bits
    weights = (q - 8) * scale.float().repeat_interleave(32, 1) + zero.float().repeat_interleave(32, 1)
    exact = x.double() @ weights.double().T
    assert ((got.double() - exact).abs() / exact.abs().max()).max() < 0.02
    bias = torch.randn(n)
    assert torch.equal(kernel.matmul(x, packed, scale_zeros, n, bias), got + bias)


@pytest.mark.parametrize("k", [576, 1536])  # a block and a tail pair; blocks alone
def test_each_row_is_computed_alone_whatever_the_batch_and_the_thread_count(k):
    kernel = int4_kernel.kernel()
    q, scale, zero = levels(200, k, seed=3)
    packed, scale_zeros = kernel.pack(q, scale, zero)
    x = torch.randn(11, k, generator=torch.Generator().manual_seed(4))
    batch = kernel.matmul(x, packed, scale_zeros, 200, None)
    for row in range(11):  # a chat's row alone, or batched with any others, gives the same bits
        assert torch.equal(kernel.matmul(x[row : row + 1], packed, scale_zeros, 200, None)[0], batch[row])
    assert torch.equal(kernel.matmul(x[3:8], packed, scale_zeros, 200, None), batch[3:8])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = kernel.matmul(x, packed, scale_zeros, 200, None)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(alone, batch)


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="the other builds are x86-64's")
@pytest.mark.parametrize("march", ["x86-64-v3", "x86-64"])  # AVX2 (AMD before Zen 4, older Intel); plain C
@pytest.mark.parametrize("k", [576, 896, 1536])  # a block and an odd tail, an even tail, blocks alone
def test_the_kernels_other_builds_compute_the_same(march, k):
    flags = tuple("-march=" + march if f == "-march=native" else f for f in int4_kernel.FLAGS)
    other = int4_kernel.kernel(flags)
    assert other is not None and other.simd == ("avx2" if march == "x86-64-v3" else "generic")
    q, scale, zero = levels(37, k, seed=5)
    packed, scale_zeros = other.pack(q, scale, zero)
    x = torch.randn(6, k, generator=torch.Generator().manual_seed(6))
    got = other.matmul(x, packed, scale_zeros, 37, None)
    assert torch.allclose(got.double(), int4_reference(x, q, scale, zero), rtol=1e-5, atol=1e-4)


def test_the_steps_exponential_is_exp_to_float_rounding():
    """The C step's SiLU and softmax take e^x 16 at a time (a polynomial where the CPU has AVX512): within a float's
    rounding of exp over the range a float's exponential covers, 0 and infinity beyond it."""
    kernel = int4_kernel.kernel()
    x = torch.cat([torch.linspace(-87.0, 88.7, 200_003), torch.tensor([0.0, -1e-8, 1e-8, -200.0, -105.0, 89.0, 300.0])])
    got = kernel.exp(x).double()
    want = torch.exp(x.double())
    finite = (want > 1.2e-38) & (want < 3.4e38)
    assert ((got[finite] - want[finite]).abs() / want[finite]).max() < 1.5e-7
    assert got[-4:-2].tolist() == [0.0, 0.0] and got[-2:].isinf().all()
    assert got[-7] == 1.0


def test_int4_fast_layers_take_the_kernel_and_nf4_keeps_torchs():
    linear = torch.nn.Linear(576, 96, bias=True)
    fast = quantize_linears(torch.nn.Linear(576, 96).requires_grad_(False), "int4-fast")
    assert fast.kernel is not None and "kernel" in repr(fast)
    nf4 = quantize_linears(linear, "nf4")
    assert isinstance(nf4, Int4Linear) and nf4.kernel is None
    # a layer whose inputs are not whole pairs of groups keeps torch's kernel
    assert quantize_linears(torch.nn.Linear(96, 16), "int4-fast").kernel is None
    # the same grid either way: the two differ by the activations' precision only (8 bits a group, or bfloat16)
    with torch.inference_mode():
        x = torch.randn(3, 576)
        fast = quantize_linears(_copy(linear), "int4-fast")
        assert fast.kernel is not None
        assert torch.allclose(fast(x), nf4(x), atol=0.05)


def test_without_the_kernel_int4_fast_runs_on_torchs(monkeypatch, caplog):
    monkeypatch.setattr(int4_kernel._kernels, "built", {})
    monkeypatch.setattr(int4_kernel.c_build.shutil, "which", lambda name: None)  # no C compiler on this machine
    assert int4_kernel.kernel() is None
    assert "no C compiler" in caplog.text and "install gcc" in caplog.text
    layer = quantize_linears(torch.nn.Linear(576, 64), "int4-fast")
    assert layer.kernel is None and layer(torch.randn(2, 576)).shape == (2, 64)
    monkeypatch.setattr(int4_kernel._kernels, "built", {})
    monkeypatch.undo()
    int4_kernel.use(False)  # SWARM_INT4_KERNEL=0
    try:
        assert quantize_linears(torch.nn.Linear(576, 64), "int4-fast").kernel is None
    finally:
        int4_kernel.use(True)
    assert quantize_linears(torch.nn.Linear(576, 64), "int4-fast").kernel is not None


def test_a_compiler_that_fails_is_said_once_and_leaves_torchs_kernel(monkeypatch, tmp_path, caplog):
    broken = tmp_path / "cc"
    broken.write_text("#!/bin/sh\necho 'cc: internal error' >&2\nexit 1\n")
    broken.chmod(0o755)
    monkeypatch.setattr(int4_kernel._kernels, "built", {})
    monkeypatch.setattr(int4_kernel.c_build.shutil, "which", lambda name: str(broken))
    monkeypatch.setattr(int4_kernel.c_build.platformdirs, "user_cache_dir", lambda name: str(tmp_path / "cache"))
    assert int4_kernel.kernel() is None
    assert "could not be built" in caplog.text and "internal error" in caplog.text
    assert not list((tmp_path / "cache").rglob("*.so*"))  # nothing half-built left behind


def _copy(linear):
    import copy

    return copy.deepcopy(linear)
