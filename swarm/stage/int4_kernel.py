"""swarm's int4 kernel for CPUs (int4_kernel.c), which int4-fast layers compute with: 4-bit weights against
activations quantized to 8 bits per group of 32 as they come in, as llama.cpp computes its Q4 x Q8 dot products.

Why: torch's int4 kernel (``_weight_int4pack_mm_for_cpu``) takes bfloat16 activations, so every call is wrapped in two
casts, and widens each weight to multiply in floating point; a byte dot product does 64 multiply-adds in one VNNI
instruction. Measured on this repository's machine (bench/HISTORY.md, "swarm's int4 kernel"): 1.1-1.45x torch's for
one row, on a par for 4 rows, 1.1-1.4x for 5; in a whole model, where each token streams every weight from memory,
the gain is smaller. The cost is the activations' 8 bits: 1.6 % perplexity on the built-in model -- so nf4, the
quality choice, keeps torch's kernel.

The C file is compiled once per CPU and source with the machine's C compiler (``cc -O3 -march=native -fopenmp``,
~1 s) into the user's cache folder and loaded with ctypes (which lets go of the GIL while it computes). Where there is
no compiler, or it fails, int4-fast runs on torch's kernel and the log says why, once.

Every row is computed alone and every output by one thread in a fixed order, so a chat's tokens depend neither on the
chats batched with it nor on the thread count -- what the ring's exact-match tests rely on.
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Any

import torch

from swarm.errors import KernelMismatch
from swarm.stage import c_build

SOURCE = Path(__file__).with_name("int4_kernel.c")
FLAGS = c_build.FLAGS
GROUP = 32  # inputs per scale and offset
PAIR = 64  # inputs two groups share in the packed layout: a layer's in_features must be a multiple of it
BLOCK = 512  # inputs of a block (16 groups) in the packed layout; the rest of a row is packed in pairs
# The C file's scale formats (SCALES_BF16 = 0, SCALES_F32, SCALES_F16) by the dtype the scales are held in
SCALE_FORMATS = {torch.bfloat16: 0, torch.float32: 1, torch.float16: 2}
EXACT_SCALES = (torch.float32, torch.float16)  # pack_exact's: w = q s + m with s and m as a GGUF has them


class Int4Kernel:
    """The compiled kernel: :meth:`pack` lays out a quantized matrix for it, :meth:`matmul` computes with it."""

    def __init__(self, lib: ctypes.CDLL, path: Path):
        self.path = path
        self._lib = lib
        self._mm = lib.swarm_int4_mm
        self._mm.restype = ctypes.c_int
        self._mm.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_void_p,
                             ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
        # float32 or float16 scales and offsets' factors (pack_exact's): a GGUF's Q4 blocks held exactly
        self._mm_exact = lib.swarm_int4_mm_exact
        self._mm_exact.restype = ctypes.c_int
        self._mm_exact.argtypes = [*self._mm.argtypes[:6], ctypes.c_int, *self._mm.argtypes[6:]]
        lib.swarm_int4_path.restype = ctypes.c_char_p
        self.simd = lib.swarm_int4_path().decode()  # which of the C file's paths this CPU got (avx512-vnni, ...)
        qkv, rest = lib.swarm_layer_qkv, lib.swarm_layer_rest
        pointer, number = ctypes.c_void_p, ctypes.c_int
        qkv.restype = rest.restype = ctypes.c_int
        qkv.argtypes = [pointer, pointer, number, pointer, pointer, pointer, ctypes.POINTER(pointer),
                        ctypes.POINTER(pointer), ctypes.POINTER(number), number]
        rest.argtypes = [pointer, pointer, number, pointer, ctypes.POINTER(pointer), ctypes.POINTER(pointer),
                         ctypes.POINTER(number), ctypes.POINTER(number), number]
        self._layer = (qkv, rest)
        layout = lib.swarm_layer_layout
        layout.restype = ctypes.c_int
        layout.argtypes = [ctypes.POINTER(ctypes.c_longlong), ctypes.c_int]
        numbers = (ctypes.c_longlong * layout(None, 0))()
        layout(numbers, len(numbers))
        self.layer_layout = tuple(numbers)  # the C struct swarm_layer: its size, then each field's offset
        self._mirrors: set[type] = set()

    def exp(self, x: torch.Tensor) -> torch.Tensor:
        """e^x as the C decode step's SiLU and softmax compute it (float32), for the tests."""
        if not x.is_cpu:
            raise _mismatch("e^x's input", "a CPU tensor", f"on {x.device}")
        x = x.float().contiguous()
        out = torch.empty_like(x)
        self._lib.swarm_exp(ctypes.c_void_p(x.data_ptr()), ctypes.c_int(x.numel()), ctypes.c_void_p(out.data_ptr()))
        return out

    def layer_calls(self, mirror: type[ctypes.Structure]) -> tuple[Any, Any]:
        """The C file's decoder-layer step (swarm.stage.compiled_decode): swarm_layer_qkv and swarm_layer_rest, once
        ``mirror`` -- the ctypes copy of the C struct swarm_layer they take -- is checked to have its size and field
        offsets (KernelMismatch otherwise: a struct read at the wrong offsets would follow garbage pointers)."""
        if mirror not in self._mirrors:
            ours = (ctypes.sizeof(mirror), *(getattr(mirror, field[0]).offset for field in mirror._fields_))
            if ours != self.layer_layout:
                raise KernelMismatch(
                    f"swarm's int4 kernel ({self.path}) lays out its layer struct as {self.layer_layout[0]} bytes "
                    f"with fields at {list(self.layer_layout[1:])}, but the Python side's mirror {mirror.__name__} "
                    f"is {ours[0]} bytes with fields at {list(ours[1:])}, so the compiled decode step is refused: "
                    "this is a bug in swarm (the C file and compiled_decode._Layer differ); report it, and run "
                    "with SWARM_INT4_KERNEL=0 meanwhile")
            self._mirrors.add(mirror)
        return self._layer

    @staticmethod
    def pack(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(packed, scale_zeros) for levels ``q`` (out, in; 0..15) with a bfloat16 ``scale`` and ``zero`` per group
        of 32 inputs (out, in / 32), in the C file's layout. Each output's blocks of 512 inputs: 8 vectors of 64
        levels, vector v holding levels 4v..4v+3 of each of the block's 16 groups (group g in bytes 4g..4g+3), stored
        in 256 bytes with vector c in the low nibbles of bytes 64c..64c+63 and vector c + 4 in their high ones. Then
        the tail's pairs of groups, 32 bytes each (byte j: the first group's level j low, the second's high), before
        the blocks on odd outputs where the tail has an odd number of pairs. Each output's scales then its offsets,
        (out, 2, in / 32)."""
        n, k = q.shape
        blocked = k // BLOCK * BLOCK
        levels = q.to(torch.uint8)
        vectors = (levels[:, :blocked].reshape(n, blocked // BLOCK, BLOCK // GROUP, GROUP // 4, 4)
                   .transpose(2, 3).reshape(n, blocked // BLOCK, GROUP // 4, PAIR))
        blocks = (vectors[:, :, :4] | (vectors[:, :, 4:] << 4)).reshape(n, blocked // 2)
        pairs = levels[:, blocked:].reshape(n, (k - blocked) // PAIR, PAIR)
        tail = (pairs[..., : PAIR // 2] | (pairs[..., PAIR // 2 :] << 4)).reshape(n, (k - blocked) // 2)
        packed = torch.cat([blocks, tail], 1)
        if pairs.shape[1] % 2:
            packed[1::2] = torch.cat([tail[1::2], blocks[1::2]], 1)  # odd outputs: the tail first
        return packed.contiguous(), torch.stack([scale, zero], dim=1).to(torch.bfloat16).contiguous()

    @classmethod
    def pack_exact(cls, q: torch.Tensor, scale: torch.Tensor, factor: torch.Tensor,
                   dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """(packed, scales) for levels ``q`` (out, in; 0..15) with weights w = q * scale + factor per group of 32
        inputs (``scale``, ``factor``: (out, in / 32)), the scales kept in ``dtype``, float32 or float16 -- which hold
        a GGUF's Q4 scales exactly (float16: Q4_0's and Q4_1's, which the file has in float16), where bfloat16 would
        round them: (out, 2, in / 32), each output's scales then its factors. The kernel computes such a matrix through
        swarm_int4_mm_exact (:meth:`matmul` picks it by the scales' dtype)."""
        if dtype not in EXACT_SCALES:
            raise KernelMismatch(f"pack_exact keeps scales in float32 or float16, not {dtype}: a bug in swarm")
        both = torch.stack([scale, factor], dim=1)
        held = both.to(dtype)
        if not torch.equal(held.to(both.dtype), both):
            raise KernelMismatch(f"scales that {dtype} cannot hold exactly were given to pack_exact: a bug in swarm")
        return cls.pack(q, scale, factor)[0], held.contiguous()

    @staticmethod
    def unpack(packed: torch.Tensor, k: int) -> torch.Tensor:
        """The levels (out, in) of a matrix :meth:`pack` laid out: its inverse, for tests and checks."""
        n = packed.shape[0]
        blocked = k // BLOCK * BLOCK
        pairs = (k - blocked) // PAIR
        data = packed.clone()
        if pairs % 2:
            data[1::2] = torch.cat([packed[1::2, pairs * PAIR // 2 :], packed[1::2, : pairs * PAIR // 2]], 1)
        blocks = data[:, : blocked // 2].reshape(n, blocked // BLOCK, 4, PAIR)
        vectors = torch.cat([blocks & 0x0F, blocks >> 4], 2)  # (n, blocks, 8 vectors, 64)
        levels = (vectors.reshape(n, blocked // BLOCK, GROUP // 4, BLOCK // GROUP, 4).transpose(2, 3)
                  .reshape(n, blocked))
        tail = data[:, blocked // 2 :].reshape(n, pairs, PAIR // 2)
        rest = torch.cat([tail & 0x0F, tail >> 4], 2).reshape(n, k - blocked)
        return torch.cat([levels, rest], 1)

    def matmul(self, x: torch.Tensor, packed: torch.Tensor, scale_zeros: torch.Tensor, out_features: int,
               bias: torch.Tensor | None) -> torch.Tensor:
        """x (rows, in) @ W.T (+ bias) in float32: x is taken as float32 rows, the bias where it is float32 (else
        added after)."""
        if x.dim() != 2 or not x.is_cpu:
            raise _mismatch("the activations", "a 2-D CPU tensor (rows, in)", _describe(x))
        if x.dtype != torch.float32 or not x.is_contiguous():
            x = x.float().contiguous()
        rows, k = x.shape
        if k % PAIR:
            raise KernelMismatch(f"the int4 kernel takes layers whose inputs are a multiple of {PAIR}, not {k}: "
                                 "this is a bug in swarm (int4_kernel.takes decides which layers it gets)")
        expect(packed, "the packed weights", torch.uint8, (out_features, k // 2))
        fmt = SCALE_FORMATS.get(scale_zeros.dtype, 0)  # bfloat16, or pack_exact's float32 or float16
        expect(scale_zeros, "the scales and offsets", scale_zeros.dtype if fmt else torch.bfloat16,
               (out_features, 2, k // GROUP))
        if bias is not None and (bias.shape != (out_features,) or not bias.is_cpu):
            raise _mismatch("the bias", f"a CPU tensor ({out_features},)", _describe(bias))
        y = torch.empty((rows, out_features), dtype=torch.float32)
        fused_bias = bias is not None and bias.dtype == torch.float32 and bias.is_contiguous()
        bias_ptr = bias.data_ptr() if bias is not None and fused_bias else None
        if not rows:
            status = 0
        elif fmt:
            status = self._mm_exact(x.data_ptr(), rows, k, out_features, packed.data_ptr(), scale_zeros.data_ptr(),
                                    fmt, bias_ptr, y.data_ptr(), torch.get_num_threads())
        else:
            status = self._mm(x.data_ptr(), rows, k, out_features, packed.data_ptr(), scale_zeros.data_ptr(),
                              bias_ptr, y.data_ptr(), torch.get_num_threads())
        if status:
            raise MemoryError(f"the int4 kernel could not allocate scratch for {rows} rows of {k} inputs")
        if bias is not None and not fused_bias:
            y = y + bias
        return y


def expect(t: torch.Tensor, name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    """Raise KernelMismatch unless ``t`` is a contiguous CPU tensor of ``dtype`` and ``shape``: what the C code reads
    through a raw pointer."""
    c_build.expect(t, name, dtype, shape, "int4 kernel")


_describe = c_build.describe


def _mismatch(name: str, wanted: str, got: str) -> KernelMismatch:
    return c_build.mismatch("int4 kernel", name, wanted, got)


def takes(in_features: int) -> bool:
    """Whether a layer with this many inputs has the kernel's shape (whole pairs of groups)."""
    return in_features % PAIR == 0


_kernels: c_build.Kernels[Int4Kernel] = c_build.Kernels(SOURCE, Int4Kernel, "int4-fast layers", "torch's int4 kernel")
use = _kernels.use


def kernel(flags: tuple[str, ...] = FLAGS) -> Int4Kernel | None:
    """The kernel built for this CPU (once per process; ``flags`` for other builds, as the tests compile the AVX2 and
    plain-C paths), or None where it cannot be built here."""
    return _kernels.get(flags)
