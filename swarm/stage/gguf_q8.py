"""GGUF's 8-bit-exact types as layers of swarm's 8-bit kernel (swarm.stage.q8_kernel): Q8_0, Q5_0, Q5_1, Q5_K,
Q6_K and MXFP4 blocks repacked losslessly at load -- every weight is s q (+ z) with an integer level q and the file's
own scale, so ``dequantized()`` is gguf-py's dequantization to the bit.

Per type (value = what gguf-py computes; level and scales = what the kernel holds):
- Q8_0: d q, q in -128..127 -> level q, scale d (fp16 in the file, held as fp16);
- Q5_0: d (q - 16), q in 0..31 -> level q - 16, scale d (fp16);
- MXFP4 (gpt-oss's experts): 2^(e - 128) v, v an E2M1 value doubled (0, 1, 2, 3, 4, 6, 8, 12 and negatives), e the
  block's E8M0 byte -> level v in Q5_0's layout (u = v + 16), scale 2^(e - 128) as fp16: exact where fp16 holds it
  (2^-24 to 2^15, :func:`fits`); a tensor with a scale outside that widens (swarm.stage.gguf_linear);
- Q5_1: d q + m -> level q, scale d, offset m (both fp16);
- Q5_K: (d sc) q - (dmin m), 6-bit sc and m per 32 values -> level q, scale d sc, offset -(dmin m) (exact in
  float32: an 11-bit fp16 mantissa times a 6-bit integer);
- Q6_K: (d sc) (q - 32), int8 sc per 16 values -> level q - 32, one scale per half group (d sc, exact).
  Two halves of a group of 32 have their own scales in the file; folding them into one per group is exact only where
  both scales are at most 4 times a common divisor (levels up to 32 x 4 still fit 8 bits), which a general block's
  6- to 7-bit scales do not give, so the kernel takes a scale per half group for Q6_K.

Levels: Q8_0 a byte each; the 5- and 6-bit types as the file's unsigned q in planes -- nibbles, then one plane per
higher bit (q8_kernel.pack_planes) -- unpacked to bytes in registers. Scales: the K types' as their int8 sub-scales and
fp16 d (and -dmin) per block (_k_scales), multiplied as an output is computed: exact. Bytes a weight held: Q8_0 1.0625,
Q5_0 and MXFP4 0.6875 (MXFP4's file 0.53125), Q5_1 0.75 (the others their files' sizes), Q5_K 0.703 (file 0.6875), Q6_K
0.828 (file 0.820). A byte a level (``planes=False``, the layout before the planes, for tests and the bench) computes
the same bits, within noise as fast on a stage's shapes (bench/RESULTS.md, Kernels). Where the kernel cannot be built
here, the layer computes with torch on its weights widened a few thousand outputs at a time.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from swarm.errors import ModelError
from swarm.stage import q8_kernel

SUPPORTED: frozenset[str] = frozenset({"Q8_0", "Q6_K", "Q5_0", "Q5_1", "Q5_K", "MXFP4"})

# values and bytes per block (ggml-common.h; gguf.constants.GGML_QUANT_SIZES)
_BLOCKS = {"MXFP4": (32, 17), "Q8_0": (32, 34), "Q5_0": (32, 22), "Q5_1": (32, 24), "Q5_K": (256, 176),
           "Q6_K": (256, 210)}
_HALVES = frozenset({"Q6_K"})  # a scale per 16 values
_OFFSETS = frozenset({"Q5_1", "Q5_K"})
# (bits, zero) of the levels as the kernel holds them, u = level + zero: the 5- and 6-bit types in planes of nibbles
# and high bits (q8_kernel.pack_planes), each level the file's own unsigned q (Q5_0's q - 16 is u - 16, Q6_K's
# q - 32 is u - 32); Q8_0 a byte a level
_LEVELS = {"MXFP4": (5, 16), "Q8_0": (8, 128), "Q5_0": (5, 16), "Q5_1": (5, 0), "Q5_K": (5, 0), "Q6_K": (6, 32)}
# types whose scales (and offsets) are the file's fp16 d (and m): held as fp16, exactly; the K types' d sc and
# dmin m are not fp16 values and stay float32
_HALF_SCALES = frozenset({"Q8_0", "Q5_0", "Q5_1", "MXFP4"})
# MXFP4's E2M1 values doubled (gguf-py's quants.MXFP4.kvalues), + 128: the kernel's byte of each nibble's level
_MXFP4_LEVELS = torch.tensor([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], dtype=torch.int16) + 128
# MXFP4's E8M0 exponents e whose scale 2^(e - 128) fp16 holds exactly (2^-24, its least subnormal, to 2^15)
_MXFP4_HALF = (128 - 24, 128 + 15)
_REPACK_VALUES = 1 << 22  # values decoded at a time: the intermediates stay tens of MB whatever the tensor
_FALLBACK_OUTPUTS = 4096  # outputs widened at a time where torch computes


def _fp16(b: torch.Tensor) -> torch.Tensor:
    """float32 of little-endian fp16 held in the last dimension's two bytes"""
    return b.contiguous().view(torch.float16).squeeze(-1).float()


def _e8m0_half(e: torch.Tensor) -> torch.Tensor:
    """float32 2^(e - 128) of E8M0 bytes ``e``: half the block's scale, as gguf-py's MXFP4.e8m0_to_fp32_half (ggml's
    GGML_E8M0_TO_FP32_HALF) builds its bits -- subnormal for e < 2."""
    e = e.to(torch.int32)
    bits = torch.where(e < 2, 0x00200000 << e, (e - 1) << 23)
    return bits.view(torch.float32)


def fits(blocks: torch.Tensor, ggml_type: str) -> bool:
    """Whether the kernel holds ``blocks`` (rows of ``ggml_type``'s blocks) exactly: always for the types of
    SUPPORTED but MXFP4, whose scales it holds as fp16, so every block's exponent must be one fp16 holds."""
    if ggml_type != "MXFP4":
        return ggml_type in SUPPORTED
    e = blocks.reshape(blocks.shape[0], -1, _BLOCKS["MXFP4"][1])[..., 0]
    return bool(((e >= _MXFP4_HALF[0]) & (e <= _MXFP4_HALF[1])).all())


def _bits(b: torch.Tensor, count: int) -> torch.Tensor:
    """(..., count): bit i of the little-endian bytes ``b`` (..., count / 8)"""
    shifts = torch.arange(8, dtype=torch.uint8)
    return ((b[..., None] >> shifts) & 1).reshape(*b.shape[:-1], count)


def _nibbles_32(qs: torch.Tensor) -> torch.Tensor:
    """(..., 32): 16 bytes' low nibbles, then their high ones (Q5_0, Q5_1)"""
    return torch.cat([qs & 0x0F, qs >> 4], -1)


def _decode(bl: torch.Tensor, ggml_type: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(levels + 128 (rows, blocks * values) uint8 -- the kernel's bytes, q8_kernel.pack_bytes --, scales per 16
    values float32, offsets per 32 values or None) of blocks ``bl`` (rows, blocks, bytes): ggml-quants.c's
    dequantize_row_* and gguf-py's quants.py, in integers (uint8 arithmetic: each level + 128 fits a byte)."""
    rows, n = bl.shape[:2]
    offset = None
    if ggml_type == "Q8_0":
        d = _fp16(bl[..., 0:2])
        q = bl[..., 2:] ^ 0x80  # two's complement q, + 128
        scale = d.repeat_interleave(2, -1)
    elif ggml_type in ("Q5_0", "Q5_1"):
        d = _fp16(bl[..., 0:2])
        at = 2 if ggml_type == "Q5_0" else 4
        high = _bits(bl[..., at : at + 4], 32)
        q = (_nibbles_32(bl[..., at + 4 : at + 20]) | (high << 4)) + (112 if ggml_type == "Q5_0" else 128)
        if ggml_type == "Q5_1":
            offset = _fp16(bl[..., 2:4])
        scale = d.repeat_interleave(2, -1)
    elif ggml_type == "MXFP4":  # d x (E2M1 doubled), d = 2^(e - 128): level the doubled value, Q5_0's q - 16
        q = _MXFP4_LEVELS[_nibbles_32(bl[..., 1:17]).long()].to(torch.uint8)
        scale = _e8m0_half(bl[..., 0]).repeat_interleave(2, -1)
    elif ggml_type == "Q5_K":
        d, dmin = _fp16(bl[..., 0:2]), _fp16(bl[..., 2:4])
        s = bl[..., 4:16].reshape(rows, n, 3, 4)
        a, m, md = s[..., 0, :], s[..., 1, :], s[..., 2, :]
        sc = torch.cat([a & 0x3F, (md & 0x0F) | ((a >> 2) & 0x30)], -1).float()
        mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], -1).float()
        qs = bl[..., 48:176].reshape(rows, n, 4, 1, 32)
        low = torch.cat([qs & 0x0F, qs >> 4], -2).reshape(rows, n, 8, 32)
        high = (bl[..., 16:48].reshape(rows, n, 1, 32) >> torch.arange(8, dtype=torch.uint8)[:, None]) & 1
        q = (low | (high << 4)) + 128
        scale = (d[..., None] * sc).repeat_interleave(2, -1)
        offset = -(dmin[..., None] * mn)
    elif ggml_type == "Q6_K":
        ql = bl[..., 0:128].reshape(rows, n, 2, 1, 64)
        low = (torch.cat([ql & 0x0F, ql >> 4], -2)).reshape(rows, n, 256)
        qh = bl[..., 128:192].reshape(rows, n, 2, 1, 32) >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8)[:, None]
        q = (low | ((qh & 3).reshape(rows, n, 256) << 4)) + 96  # q - 32, + 128
        sc = bl[..., 192:208].contiguous().view(torch.int8).float()
        scale = _fp16(bl[..., 208:210])[..., None] * sc
    else:
        raise ModelError(f"the 8-bit kernel takes GGUF types {', '.join(sorted(SUPPORTED))}, not {ggml_type}")
    return q.reshape(rows, -1), scale.reshape(rows, -1), None if offset is None else offset.reshape(rows, -1)


class GgufQ8Linear(nn.Module):
    """A linear layer over a GGUF tensor's blocks repacked for swarm's 8-bit kernel: x @ W.T + bias for any leading
    dims, W being the file's values exactly."""

    packed: torch.Tensor  # buffers (register_buffer), declared for type checkers
    scales: torch.Tensor
    bias: torch.Tensor | None

    def __init__(self, ggml_type: str, packed: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None,
                 kernel: q8_kernel.Q8Kernel | None, in_features: int, bits: int = 8, zero: int = 128):
        super().__init__()
        self.ggml_type = ggml_type
        self.out_features, self.in_features = packed.shape[0], in_features
        self.bits, self.zero = bits, zero
        self.scales_per_output = (1 + (ggml_type in _HALVES) + (ggml_type in _OFFSETS)) * in_features // 32
        self.halves, self.offsets = ggml_type in _HALVES, ggml_type in _OFFSETS
        self.kernel = kernel
        self.register_buffer("packed", packed)
        self.register_buffer("scales", scales)
        self.register_buffer("bias", bias)
        self._order: torch.Tensor | None = None  # rows(): the packed layout's order undone, built on first use

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        if flat.shape[-1] != self.in_features:
            raise ModelError(f"a {self.ggml_type} layer of {self.in_features} inputs was given rows of "
                             f"{flat.shape[-1]}: this is a bug in swarm (the stage's layers do not fit together)")
        if self.kernel is not None:
            y = self.kernel.matmul(flat, self.packed, self.scales, self.halves, self.offsets, self.bias, self.bits,
                                   self.zero)
        else:  # torch on the weights widened a slice of outputs at a time: the kernel's memory, float's results
            flat32 = flat.float()
            y = torch.cat([F.linear(flat32, self._widened(start, start + _FALLBACK_OUTPUTS))
                           for start in range(0, self.out_features, _FALLBACK_OUTPUTS)], -1)
            if self.bias is not None:
                y = y + self.bias
        y = y if flat.dtype == torch.float32 else y.to(flat.dtype)
        return y.reshape(*x.shape[:-1], self.out_features)

    def grid(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(levels (out, in) int16, scales per 16 inputs (out, in / 16) float32, offsets per 32 inputs or None): the
        weight is level x scale (+ offset)."""
        return self._grid(0, self.out_features)

    def _grid(self, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        return self._grid_of(slice(start, stop))

    def _grid_of(self, rows: slice | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        scales = self._scales_of(rows)
        first = scales[:, 0]
        second = scales[:, 1] if self.halves else first
        per_half = torch.stack([first, second], -1).reshape(first.shape[0], -1)
        return self._levels_of(rows), per_half, scales[:, -1] if self.offsets else None

    def _scales_of(self, rows: slice | torch.Tensor) -> torch.Tensor:
        """The scales (and offsets) of outputs ``rows`` as float32 (rows, parts, in / 32), whichever way held."""
        held = self.scales[rows]
        if held.dtype != torch.uint8:
            return held.float()
        return _k_floats(held, self.scales_per_output // (self.in_features // q8_kernel.GROUP))

    def _levels_of(self, rows: slice | torch.Tensor) -> torch.Tensor:
        """The levels (int16, rows x in) of outputs ``rows``, in their natural order."""
        if self.bits == 8:
            return q8_kernel.unpack(self.packed[rows])
        u = q8_kernel.unpack_planes(self.packed[rows], self.in_features, self.bits)
        return q8_kernel.unpack(u) + (128 - self.zero)

    def weight_rows(self, index: torch.Tensor) -> torch.Tensor:
        """The weight's rows ``index`` (a 1-D tensor of output numbers) in float32: a tied embedding's lookup on the
        head's own bytes, so a stage holding both keeps the matrix once."""
        if self.halves or self.bits != 8:
            return self._widened_of(index)
        if self._order is None:  # where each input's byte lies in a packed row (the kernel's layout, undone)
            self._order = _unpacked_order(self.in_features)
        scales = self._scales_of(index)
        q = self.packed[index][:, self._order].to(torch.int16) - 128
        w = scales[:, 0].repeat_interleave(q8_kernel.GROUP, -1) * q.float()
        return w if not self.offsets else w + scales[:, -1].repeat_interleave(q8_kernel.GROUP, -1)

    def _widened(self, start: int, stop: int) -> torch.Tensor:
        return self._widened_of(slice(start, stop))

    def _widened_of(self, rows: slice | torch.Tensor) -> torch.Tensor:
        if not self.halves:  # a scale per group of 32: taken as it is held (the same values as per half)
            scales = self._scales_of(rows)
            w = scales[:, 0].repeat_interleave(q8_kernel.GROUP, -1) * self._levels_of(rows).float()
            return w if not self.offsets else w + scales[:, -1].repeat_interleave(q8_kernel.GROUP, -1)
        q, scale, offset = self._grid_of(rows)
        # scale q, then + offset, each rounded to float32 as gguf-py computes (d * q) + m: the same bits
        w = scale.repeat_interleave(16, -1) * q.float()
        return w if offset is None else w + offset.repeat_interleave(q8_kernel.GROUP, -1)

    def dequantized(self) -> torch.Tensor:
        """The weight in float32 (out, in): gguf-py's dequantization of the file's blocks, to the bit."""
        return self._widened(0, self.out_features)

    def extra_repr(self) -> str:
        kernel = f"swarm's {self.kernel.simd} 8-bit kernel" if self.kernel is not None else "torch, widened"
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.ggml_type} on {kernel}"


def _unpacked_order(in_features: int) -> torch.Tensor:
    """For each input of a row, where its byte lies in the kernel's packed row (q8_kernel.pack's layout)."""
    at = torch.arange(in_features, dtype=torch.int64).reshape(1, -1)
    blocked = in_features // q8_kernel.BLOCK * q8_kernel.BLOCK
    positions = torch.empty_like(at)
    # pack_bytes moves input i to position p: scatter that move over the numbers 0..k-1
    moved = torch.cat([at[:, :blocked].reshape(1, blocked // q8_kernel.BLOCK, q8_kernel.BLOCK // q8_kernel.GROUP,
                                                q8_kernel.GROUP // 4, 4).transpose(2, 3).reshape(1, blocked),
                       at[:, blocked:]], 1)
    positions[0, moved[0]] = torch.arange(in_features)
    return positions[0]


def _k_scales(bl: torch.Tensor, ggml_type: str) -> torch.Tensor:
    """A K type's scales as the kernel takes them (q8_kernel: scales held as int8 sub-scales and fp16 multipliers):
    per output (rows), its parts x groups int8 -- Q6_K's sc of each group's first halves then of its second, Q5_K's
    6-bit sc then m -- then per 8 of them (a block) the fp16 they multiply: Q6_K's d; Q5_K's d, then -dmin (a sign
    flipped: exact). Their float32 products are the file's d sc and -(dmin m), exactly."""
    rows, n = bl.shape[:2]
    d = bl[..., 0:2] if ggml_type == "Q5_K" else bl[..., 208:210]
    if ggml_type == "Q6_K":
        sc = bl[..., 192:208]
        ints = torch.stack([sc[..., 0::2], sc[..., 1::2]], 1)  # (rows, 2, n, 8)
        supers = torch.stack([d, d], 1)
    else:
        s = bl[..., 4:16].reshape(rows, n, 3, 4)
        a, m, md = s[..., 0, :], s[..., 1, :], s[..., 2, :]
        sc = torch.cat([a & 0x3F, (md & 0x0F) | ((a >> 2) & 0x30)], -1)
        mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], -1)
        minus_dmin = bl[..., 2:4].clone()
        minus_dmin[..., 1] ^= 0x80  # the fp16 sign bit
        ints, supers = torch.stack([sc, mn], 1), torch.stack([d, minus_dmin], 1)
    return torch.cat([ints.reshape(rows, -1), supers.reshape(rows, -1)], 1)


def _k_floats(held: torch.Tensor, parts: int) -> torch.Tensor:
    """The float32 scales (rows, parts, groups) of K scales ``held`` as :func:`_k_scales` lays them out."""
    rows, size = held.shape
    count = size * 4 // 5
    ints = held[:, :count].view(torch.int8).float().reshape(rows, parts, -1)
    supers = held[:, count:].contiguous().view(torch.float16).float().reshape(rows, parts, -1)
    return ints * supers.repeat_interleave(8, -1)


def widen(blocks: torch.Tensor, ggml_type: str, in_features: int) -> torch.Tensor:
    """The float32 values (rows, in_features) of ``blocks`` (uint8 rows of one of SUPPORTED's blocks), computed in
    torch as the kernel's layers widen (level x scale, + offset): gguf-py's values, to the bit, without gguf-py's
    per-call overhead (~45 us a looked-up embedding row)."""
    values, size = _BLOCKS[ggml_type]
    rows = blocks.shape[0]
    if ggml_type == "Q8_0":  # the common embedding: d q in a few steps (gguf-py: int8 as float32 times fp16 d)
        b = blocks.reshape(rows, in_features // values, size)
        d = b[..., 0:2].contiguous().view(torch.float16).float()
        return (b[..., 2:].contiguous().view(torch.int8).float() * d).reshape(rows, in_features)
    u, per_half, offset = _decode(blocks.reshape(rows, in_features // values, size), ggml_type)
    w = per_half.repeat_interleave(16, -1) * (u.to(torch.int16) - 128).float()
    return w if offset is None else w + offset.repeat_interleave(q8_kernel.GROUP, -1)


def q8_linear(blocks: torch.Tensor, ggml_type: str, shape: tuple[int, int], bias: torch.Tensor | None,
              planes: bool = True) -> nn.Module:
    """A layer computing x @ W.T + bias on a GGUF tensor's ``blocks`` (uint8, rows x the row's block bytes) of
    ``ggml_type`` (one of SUPPORTED) and logical ``shape`` (out, in), repacked losslessly for swarm's 8-bit kernel:
    5- and 6-bit types in planes of nibbles and high bits, or a byte a level where ``planes`` is False."""
    if ggml_type not in SUPPORTED:
        raise ModelError(f"swarm's 8-bit kernel computes the GGUF types {', '.join(sorted(SUPPORTED))}; a tensor of "
                         f"type {ggml_type} needs another layer (this is a bug in swarm's loader)")
    out_features, in_features = shape
    values, size = _BLOCKS[ggml_type]
    if blocks.dtype != torch.uint8 or blocks.dim() != 2:
        raise ModelError(f"a {ggml_type} tensor's blocks come as a 2-D uint8 tensor (rows, bytes), not "
                         f"{blocks.dtype} {tuple(blocks.shape)}: the stored model file may be damaged; import it again")
    if in_features % values or tuple(blocks.shape) != (out_features, in_features // values * size):
        raise ModelError(f"{tuple(blocks.shape)} bytes of {ggml_type} blocks ({values} values in {size} bytes each) "
                         f"cannot hold a weight of shape {tuple(shape)}: the stored model file may be damaged; "
                         "import it again")
    if not fits(blocks, ggml_type):
        raise ModelError(f"a {ggml_type} tensor has a block scale outside what float16 holds (2^-24 to 2^15): the "
                         "8-bit kernel cannot hold it exactly (this is a bug in swarm's loader: such a tensor widens)")
    if bias is not None and tuple(bias.shape) != (out_features,):
        raise ModelError(f"a bias of shape {tuple(bias.shape)} does not fit a weight of shape {tuple(shape)}: the "
                         "stored model file may be damaged; import it again")
    parts = 1 + (ggml_type in _HALVES) + (ggml_type in _OFFSETS)
    bits, zero = _LEVELS[ggml_type] if planes else (8, 128)
    packed = torch.empty((out_features, q8_kernel.row_bytes(in_features, bits)), dtype=torch.uint8)
    groups = in_features // q8_kernel.GROUP
    k_type = ggml_type in ("Q5_K", "Q6_K")
    scales = torch.empty((out_features, parts * groups * 5 // 4), dtype=torch.uint8) if k_type else \
        torch.empty((out_features, parts, groups), dtype=torch.float16 if ggml_type in _HALF_SCALES else torch.float32)
    step = max(1, _REPACK_VALUES // in_features)
    for start in range(0, out_features, step):
        chunk = blocks[start : start + step]
        u, per_half, offset = _decode(chunk.reshape(chunk.shape[0], -1, size), ggml_type)
        stop = start + chunk.shape[0]
        ordered = q8_kernel.pack_bytes(u.reshape(chunk.shape[0], -1) - (128 - zero))  # uint8: u = level + zero
        packed[start:stop] = ordered if bits == 8 else q8_kernel.pack_planes(ordered, bits)
        if k_type:
            scales[start:stop] = _k_scales(chunk.reshape(chunk.shape[0], -1, size), ggml_type)
            continue
        if ggml_type in _HALVES:
            scales[start:stop, 0], scales[start:stop, 1] = per_half[:, 0::2], per_half[:, 1::2]
        else:
            scales[start:stop, 0] = per_half[:, 0::2]
        if offset is not None:
            scales[start:stop, -1] = offset
    kernel = q8_kernel.kernel() if q8_kernel.takes(in_features) else None
    return GgufQ8Linear(ggml_type, packed, scales, None if bias is None else bias.float().contiguous(), kernel,
                        in_features, bits, zero)
