"""swarm's 8-bit group kernel for CPUs (q8_kernel.c): weight levels of up to 8 bits per group of 32 inputs (a byte
each, or 5 or 6 bits in planes: :func:`pack_planes`) with scales (float32, fp16, or a K type's int8 sub-scales and
fp16 multipliers; one per group, or one per half group) and optional offsets, against activations quantized to 8
bits per group of 32 as they come in -- what GGUF's Q8_0, Q5_0, Q5_1, Q5_K and Q6_K blocks compute on without
widening to float (swarm.stage.gguf_q8 repacks them).

It follows swarm's int4 kernel (int4_kernel.py): the C file is compiled once per CPU and source with the machine's C
compiler (``cc -O3 -march=native -fopenmp``) into the user's cache folder and loaded with ctypes; where there is no
compiler, or it fails, layers compute with torch on their dequantized weights and the log says why, once. Every row is
computed alone and every output by one thread in a fixed order, so a chat's tokens depend neither on the chats batched
with it nor on the thread count.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch
from torch.nn import functional as F

from swarm.errors import KernelMismatch
from swarm.stage import c_build

SOURCE = Path(__file__).with_name("q8_kernel.c")
FLAGS = c_build.FLAGS
GROUP = 32  # inputs per group: a layer's in_features must be a multiple of it
BLOCK = 512  # inputs of a whole block (16 groups) in the packed layout; the last block holds what is left
CHUNK = 64  # inputs whose 5- or 6-bit levels are laid out together (pack_planes): one 64-byte vector of the C file
BITS = (8, 6, 5)  # the level widths the C file reads
K_BLOCK = 256  # inputs a K type's fp16 multiplier covers: scales held as int8 sub-scales need rows of whole blocks
# how the C file reads scales of each dtype (its SCALES_*): float32; the file's fp16 d, m; a K type's int8 sub-scales
# then per 8 of them the fp16 they multiply (gguf_q8._k_scales), as raw bytes
_SCALE_FORMATS = {torch.float32: 0, torch.float16: 1, torch.uint8: 2}


class Q8Kernel:
    """The compiled kernel: :meth:`matmul` computes with levels laid out by :func:`pack`."""

    def __init__(self, lib: ctypes.CDLL, path: Path):
        self.path = path
        self._lib = lib
        self._mm = lib.swarm_q8_mm
        self._mm.restype = ctypes.c_int
        pointer, number = ctypes.c_void_p, ctypes.c_int
        self._mm.argtypes = [pointer, number, number, number, pointer, pointer, number, number, number, number,
                             number, pointer, pointer, number]
        lib.swarm_q8_path.restype = ctypes.c_char_p
        self.simd = lib.swarm_q8_path().decode()  # which of the C file's paths this CPU got (avx512-vnni, ...)
        lib.swarm_q8_row_bytes.restype = ctypes.c_int
        lib.swarm_q8_row_bytes.argtypes = [number, number]
        for k, bits in ((32, 5), (576, 5), (640, 6), (1536, 8), (2048, 6)):  # the C file reads what pack lays out
            if lib.swarm_q8_row_bytes(k, bits) != row_bytes(k, bits):
                raise KernelMismatch(f"swarm's 8-bit kernel ({path}) takes {lib.swarm_q8_row_bytes(k, bits)} bytes "
                                     f"for an output of {k} {bits}-bit levels where swarm packs {row_bytes(k, bits)}: "
                                     "its C file and q8_kernel.py are from different versions; reinstall swarm")

    def matmul(self, x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, halves: bool, offsets: bool,
               bias: torch.Tensor | None, bits: int = 8, zero: int = 128) -> torch.Tensor:
        """x (rows, in) @ W.T (+ bias) in float32. ``packed``: (out, row_bytes(in, bits)) bytes from :func:`pack`
        (bits 8) or :func:`pack_planes` (5 or 6), a level q held as q + ``zero``; ``scales``: float32, or float16 (the
        file's own fp16 d and m), (out, parts, in / 32), parts being the scales (of each group's first 16 inputs,
        then of its last 16 where ``halves``) then the offsets where ``offsets``; or uint8 (out, parts x in / 32 x
        5 / 4): a K type's int8 sub-scales and fp16 multipliers (gguf_q8._k_scales). x is taken as float32 rows, the
        bias where it is float32 (else added after)."""
        if x.dim() != 2 or not x.is_cpu:
            raise _mismatch("the activations", "a 2-D CPU tensor (rows, in)", _describe(x))
        if x.dtype != torch.float32 or not x.is_contiguous():
            x = x.float().contiguous()
        rows, k = x.shape
        if k % GROUP or k == 0:
            raise _mismatch("the activations", f"rows of a whole number of groups of {GROUP} inputs", _describe(x))
        if packed.dim() != 2:
            raise _mismatch("the packed weights", "a 2-D tensor (out, in)", _describe(packed))
        out_features = packed.shape[0]
        if bits not in BITS or not 0 <= zero < 1 << bits:
            raise _mismatch("the levels", f"{'/'.join(map(str, BITS))}-bit levels with a zero in their range",
                            f"{bits} bits with zero {zero}")
        expect(packed, "the packed weights", torch.uint8, (out_features, row_bytes(k, bits)))
        parts = 1 + halves + offsets
        scale_format = _SCALE_FORMATS.get(scales.dtype, 0)
        if scale_format == 2 and k % K_BLOCK:
            raise _mismatch("the scales and offsets", f"int8 sub-scales of rows of whole blocks of {K_BLOCK}",
                            f"rows of {k} inputs")
        groups = k // GROUP
        shape = (out_features, parts * groups * 5 // 4) if scale_format == 2 else (out_features, parts, groups)
        expect(scales, "the scales and offsets", scales.dtype if scale_format else torch.float32, shape)
        if bias is not None and (bias.shape != (out_features,) or not bias.is_cpu):
            raise _mismatch("the bias", f"a CPU tensor ({out_features},)", _describe(bias))
        y = torch.empty((rows, out_features), dtype=torch.float32)
        fused_bias = bias is not None and bias.dtype == torch.float32 and bias.is_contiguous()
        bias_ptr = bias.data_ptr() if bias is not None and fused_bias else None
        status = self._mm(x.data_ptr(), rows, k, out_features, packed.data_ptr(), scales.data_ptr(), int(halves),
                          int(offsets), bits, zero, scale_format, bias_ptr, y.data_ptr(),
                          torch.get_num_threads()) if rows else 0
        if status == -3:
            raise _mismatch("the levels", "8-, 6- or 5-bit levels", f"{bits} bits with zero {zero}")
        if status:
            raise MemoryError(f"the 8-bit kernel could not allocate scratch for {rows} rows of {k} inputs")
        if bias is not None and not fused_bias:
            y = y + bias
        return y


def pack(q: torch.Tensor) -> torch.Tensor:
    """The C file's layout of levels ``q`` (out, in; -128..127), each level stored as the byte q + 128: each output's
    blocks of 16 groups of 32 inputs, a block being 8 vectors of 64 bytes, vector v holding inputs 4v..4v+3 of each
    group (group g in bytes 4g..4g+3); then the groups left over (the tail), in their own order."""
    return pack_bytes((q.to(torch.int16) + 128).to(torch.uint8))


def pack_bytes(u: torch.Tensor) -> torch.Tensor:
    """:func:`pack` of levels given as their bytes ``u`` = q + 128 (uint8, out x in)."""
    n, k = u.shape
    if k % GROUP or u.dtype != torch.uint8:
        raise _mismatch("the levels", f"uint8 rows of a whole number of groups of {GROUP} inputs",
                        f"{u.dtype} rows of {k}")
    blocked = k // BLOCK * BLOCK
    blocks = u[:, :blocked].reshape(n, blocked // BLOCK, BLOCK // GROUP, GROUP // 4, 4).transpose(2, 3)
    return torch.cat([blocks.reshape(n, blocked), u[:, blocked:]], 1).contiguous()


def row_bytes(k: int, bits: int) -> int:
    """Bytes an output of ``k`` inputs takes at ``bits`` bits a level: k bytes at 8; at 5 and 6, per 64 inputs (the
    last padded) 32 bytes of nibbles and 8 bytes per bit above the fourth (:func:`pack_planes`)."""
    return k if bits == 8 else -(-k // CHUNK) * (CHUNK // 2 + (bits - 4) * CHUNK // 8)


def pack_planes(u: torch.Tensor, bits: int) -> torch.Tensor:
    """The C file's 5- or 6-bit layout of bytes ``u`` (uint8, out x in, each below 2**bits) already in :func:`pack`'s
    order: per chunk of 64 inputs, 32 bytes whose low nibbles are inputs 0..31's low 4 bits and high nibbles inputs
    32..63's, then for each bit above the fourth 8 bytes holding that bit of the 64 inputs (bit i % 8 of byte i / 8).
    About 0.625 bytes a weight at 5 bits, 0.75 at 6."""
    n, k = u.shape
    if u.dtype != torch.uint8 or bits not in (5, 6) or k % GROUP:
        raise _mismatch("the levels", f"uint8 rows of whole groups of {GROUP} for 5 or 6 bits",
                        f"{u.dtype} rows of {k} for {bits} bits")
    chunks = -(-k // CHUNK)
    padded = F.pad(u, (0, chunks * CHUNK - k)).reshape(n, chunks, CHUNK)
    planes = [(padded[..., : CHUNK // 2] & 0x0F) | ((padded[..., CHUNK // 2 :] & 0x0F) << 4)]
    weights = (1 << torch.arange(8, dtype=torch.int32))
    for bit in range(4, bits):
        set_bits = ((padded >> bit) & 1).reshape(n, chunks, CHUNK // 8, 8).to(torch.int32)
        planes.append((set_bits * weights).sum(-1).to(torch.uint8))
    return torch.cat(planes, -1).reshape(n, -1).contiguous()


def unpack_planes(packed: torch.Tensor, k: int, bits: int) -> torch.Tensor:
    """The bytes u (uint8, out x k, in :func:`pack`'s order) that :func:`pack_planes` laid out as ``packed``."""
    n = packed.shape[0]
    chunks = -(-k // CHUNK)
    c = packed.reshape(n, chunks, -1)
    nib = c[..., : CHUNK // 2]
    u = torch.cat([nib & 0x0F, nib >> 4], -1)
    shifts = torch.arange(8, dtype=torch.uint8)
    for plane, bit in enumerate(range(4, bits)):
        at = CHUNK // 2 + plane * CHUNK // 8
        high = ((c[..., at : at + CHUNK // 8, None] >> shifts) & 1).reshape(n, chunks, CHUNK)
        u = u | (high << bit)
    return u.reshape(n, chunks * CHUNK)[:, :k]


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """The levels (out, in; int16) that :func:`pack` laid out as ``packed``."""
    n, k = packed.shape
    blocked = k // BLOCK * BLOCK
    blocks = packed[:, :blocked].reshape(n, blocked // BLOCK, GROUP // 4, BLOCK // GROUP, 4).transpose(2, 3)
    return torch.cat([blocks.reshape(n, blocked), packed[:, blocked:]], 1).to(torch.int16) - 128


def expect(t: torch.Tensor, name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    """Raise KernelMismatch unless ``t`` is a contiguous CPU tensor of ``dtype`` and ``shape``: what the C code reads
    through a raw pointer."""
    c_build.expect(t, name, dtype, shape, "8-bit kernel")


_describe = c_build.describe


def _mismatch(name: str, wanted: str, got: str) -> KernelMismatch:
    return c_build.mismatch("8-bit kernel", name, wanted, got)


def takes(in_features: int) -> bool:
    """Whether a layer with this many inputs has the kernel's shape (whole groups of 32)."""
    return in_features > 0 and in_features % GROUP == 0


_kernels: c_build.Kernels[Q8Kernel] = c_build.Kernels(SOURCE, Q8Kernel, "GGUF 8-bit layers (Q8_0, Q5_*, Q6_K)",
                                                      "torch, widened a slice at a time")
use = _kernels.use


def kernel(flags: tuple[str, ...] = FLAGS) -> Q8Kernel | None:
    """The kernel built for this CPU (once per process; ``flags`` for other builds, as the tests compile the AVX2 and
    plain-C paths), or None where it cannot be built here."""
    return _kernels.get(flags)
