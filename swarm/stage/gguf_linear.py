"""The ``gguf`` kind: a GGUF model's linear layers computed on the file's own quantized blocks.

A stage at ``gguf`` reads each linear weight as the import kept it -- the GGUF's block bytes (swarm.store.gguf_blocks)
-- and builds its module from those bytes with :func:`gguf_linear`, never from a float copy:

- Q4_0, Q4_1 and Q4_K are 4-bit levels in groups of 32 with a scale and an offset per group, which is swarm's int4
  kernel's grid (swarm.stage.int4_kernel): they are repacked losslessly into its layout, w = q s + m, with s and m
  in a type that holds them exactly -- float16 for Q4_0 (d and -8 d) and Q4_1 (d and m), as the file has them, so a
  weight takes 0.625 bytes as in a Q4_1 file; float32 for Q4_K (d sc and -dmin m per sub-block of 32: products of an
  fp16 and a 6-bit integer), 0.75 bytes against the file's 0.5625 -- where bfloat16, the kernel's int4-fast scale
  type, would round them all. Dequantized
  from that layout the weights are gguf-py's, to the bit (tests/test_gguf_kind.py); the kernel computes them against
  activations quantized to 8 bits per group of 32, as llama.cpp does.
- the 8-bit group types (Q8_0, Q6_K, Q5_0, Q5_1, Q5_K) are repacked losslessly for swarm's 8-bit kernel
  (swarm.stage.gguf_q8, swarm.stage.q8_kernel): 5- and 6-bit levels in nibbles and high-bit planes, scales as the
  file has them -- Q8_0, Q5_0, Q5_1 at their file's size, Q5_K 0.703 bytes a weight (0.6875), Q6_K 0.828 (0.820);
- every other type, and every type where swarm's kernel cannot run (no C compiler, SWARM_INT4_KERNEL=0, a CUDA
  device), is dequantized with gguf-py to float -- the file's values, only larger.

Llama's q/k fix-up (transformers' ``TENSOR_PROCESSORS``) permutes output rows: it is applied to the blocks' rows
(:func:`row_order`), which holds whole rows of blocks, so nothing widens for it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from swarm.errors import ModelError
from swarm.stage import gguf_q8, int4_kernel

log = logging.getLogger(__name__)

# Types repacked into swarm's int4 kernel: bytes per block and values per block (ggml-common.h's block_q4_0,
# block_q4_1, block_q4_K)
REPACKED = {"Q4_0": (18, 32), "Q4_1": (20, 32), "Q4_K": (144, 256)}
# The 8-bit group kernel's module (another change): imported only where it is installed


@dataclass
class GGUFBlocks:
    """A linear weight as the GGUF holds it: ``blocks`` (rows, bytes per row) uint8, or the file's float tensor for
    F32/F16/BF16; ``ggml_type`` its GGUF type name; ``shape`` (out_features, in_features). A MoE layer's expert
    tensor holds ``experts`` such weights, one after another in its rows (swarm.stage.gguf_experts), and may be a
    part of a tensor joined from several (``into``, ``part``, ``join``: swarm.store.gguf_source)."""

    blocks: torch.Tensor
    ggml_type: str
    shape: tuple[int, int]
    experts: int = 0
    into: str = ""
    part: int = 0
    join: str = ""


def levels(blocks: torch.Tensor, ggml_type: str, shape: tuple[int, int]) -> tuple[torch.Tensor, ...]:
    """(q, scale, factor) of a Q4_0/Q4_1/Q4_K tensor's blocks: levels q (out, in) in 0..15 and float32 ``scale`` and
    ``factor`` (out, in / 32) with w = q * scale + factor, exactly the values gguf-py dequantizes."""
    size, per_block = REPACKED[ggml_type]
    n, k = shape
    raw = blocks.contiguous().numpy()
    if raw.shape != (n, k // per_block * size) or k % per_block:
        raise ModelError(f"{ggml_type} blocks of shape {tuple(raw.shape)} cannot hold a {n} x {k} matrix")
    b = raw.reshape(n, k // per_block, size)

    def halves(data: np.ndarray) -> np.ndarray:  # 32 values a group from 16 bytes: low nibbles, then high
        return np.concatenate([data & 0x0F, data >> 4], axis=-1)

    if ggml_type == "Q4_K":
        from gguf.quants import Q4_K

        d = b[..., 0:2].copy().view(np.float16).astype(np.float32)  # (n, blocks, 1)
        dmin = b[..., 2:4].copy().view(np.float16).astype(np.float32)
        sc, mn = Q4_K.get_scale_min(b[..., 4:16].reshape(-1, 12))
        scale = (d * sc.reshape(n, -1, 8).astype(np.float32)).reshape(n, k // 32)
        factor = -(dmin * mn.reshape(n, -1, 8).astype(np.float32)).reshape(n, k // 32)
        qs = b[..., 16:].reshape(n, k // 256, 4, 32)  # 4 chunks of 64 values: sub-block 2c low nibbles, 2c+1 high
        q = halves(qs).reshape(n, k)
    else:
        d = b[..., 0:2].copy().view(np.float16).astype(np.float32)[..., 0]
        if ggml_type == "Q4_0":
            scale, factor, qs = d, -8 * d, b[..., 2:]
        else:
            scale, factor, qs = d, b[..., 2:4].copy().view(np.float16).astype(np.float32)[..., 0], b[..., 4:]
        q = halves(qs).reshape(n, k)
    return (torch.from_numpy(np.ascontiguousarray(q)), torch.from_numpy(np.ascontiguousarray(scale)),
            torch.from_numpy(np.ascontiguousarray(factor)))


def gguf_linear(blocks: torch.Tensor, ggml_type: str, shape: tuple[int, int], bias: torch.Tensor | None,
                device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32) -> nn.Module:
    """The module computing ``x @ W.T + bias`` for a weight kept as GGUF ``ggml_type`` blocks (rows, bytes per row) of
    logical ``shape`` (out, in): on the blocks where a kernel takes them, else on their float values (see the module
    doc). ``device`` and ``dtype``: where and in what a widened layer computes."""
    n, k = shape
    device = torch.device(device)
    if device.type == "cpu" and ggml_type in REPACKED and int4_kernel.takes(k):
        kernel = int4_kernel.kernel()
        if kernel is not None:
            from swarm.stage.quantize import Int4Linear

            q, scale, factor = levels(blocks, ggml_type, shape)
            packed, scales = kernel.pack_exact(q, scale, factor, scale_dtype(scale, factor))
            kept = bias.detach().float().contiguous() if bias is not None else None
            return Int4Linear(packed, scales, int4_kernel.GROUP, k, n, kept, kernel)
    if device.type == "cpu" and gguf_q8.fits(blocks, ggml_type):
        return gguf_q8.q8_linear(blocks, ggml_type, shape, bias)
    if device.type == "cpu" and ggml_type in gguf_q8.SUPPORTED:
        log.warning("a %s weight %s has a block scale float16 cannot hold: it widens to float32 (4 bytes a weight)",
                    ggml_type, tuple(shape))
    return widened(blocks, ggml_type, shape, bias, device, dtype)


def scale_dtype(scale: torch.Tensor, factor: torch.Tensor) -> torch.dtype:
    """float16 where it holds every scale and factor exactly (Q4_0's d and -8 d, Q4_1's d and m: the file's own
    float16 values, 2 bytes each), else float32 (Q4_K's d sc and -dmin m)."""
    for t in (scale, factor):
        if not torch.equal(t.to(torch.float16).float(), t):
            return torch.float32
    return torch.float16


def widened(blocks: torch.Tensor, ggml_type: str, shape: tuple[int, int], bias: torch.Tensor | None,
            device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32) -> nn.Linear:
    """A plain ``nn.Linear`` holding the blocks' values dequantized by gguf-py (the file's values), in ``dtype``."""
    from swarm.stage.weights import dequantize

    weight = dequantize(blocks, ggml_type, shape).to(device=device, dtype=dtype)
    linear = nn.Linear(shape[1], shape[0], bias=bias is not None, device="meta")
    linear.weight = nn.Parameter(weight, requires_grad=False)
    if bias is not None:
        linear.bias = nn.Parameter(bias.to(device=device, dtype=dtype), requires_grad=False)
    return linear


def dequantized(module: nn.Module) -> torch.Tensor:
    """The float32 weights a :func:`gguf_linear` module computes with, rebuilt from its own layout (for tests)."""
    kernel: Any = getattr(module, "kernel", None)
    if kernel is not None:
        held: Any = module
        q = kernel.unpack(held.packed, held.in_features).float()
        scales = held.scale_zeros
        s, m = scales[:, 0].repeat_interleave(int4_kernel.GROUP, 1), scales[:, 1].repeat_interleave(
            int4_kernel.GROUP, 1)
        return q * s + m
    weight = getattr(module, "weight", None)
    if isinstance(weight, torch.Tensor):
        return weight.detach().float()
    raise ModelError(f"{type(module).__name__} keeps no weights this function can read")


def row_order(processor: Any, name: str, rows: int) -> torch.Tensor | None:
    """The order of output rows transformers' GGUF fix-up ``processor`` gives tensor ``name``'s rows, or None where
    the fix-up is more than a permutation of rows (the tensor then widens)."""
    index = np.arange(rows, dtype=np.int64).reshape(rows, 1)
    done = processor.process(weights=index, name=name).weights
    order = np.asarray(done).reshape(-1)
    if order.shape != (rows,) or not np.array_equal(np.sort(order), np.arange(rows)):
        return None
    return torch.from_numpy(order.astype(np.int64))


def place_linears(module: nn.Module, kept: dict[str, GGUFBlocks], tensors: dict[str, torch.Tensor],
                  device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32) -> None:
    """Put into ``module`` (a decoder layer on the meta device) a :func:`gguf_linear` for each weight in ``kept``
    (state-dict names: "self_attn.q_proj.weight" ...), taking each one's bias out of ``tensors``. Siblings that read
    the same input (swarm.stage.quantize.SIBLINGS: q/k/v, gate/up) of one repacked type become one matrix -- their
    blocks' rows stacked, which is exact, as every block lies within a row -- computed in one kernel call."""
    from swarm.stage.quantize import SIBLINGS, Computed, FusedPart

    def bias_of(path: str) -> torch.Tensor | None:
        return tensors.pop(f"{path}.bias", None)

    paths = {key[: -len(".weight")]: value for key, value in kept.items() if key.endswith(".weight")}
    if len(paths) != len(kept):
        odd = sorted(set(kept) - {p + ".weight" for p in paths})
        raise ModelError(f"quantized tensors that are not linear weights: {odd}")
    for parent_name, parent in list(module.named_modules()):
        prefix = f"{parent_name}." if parent_name else ""
        for names in SIBLINGS:
            members = [paths.get(prefix + name) for name in names]
            if any(m is None for m in members):
                continue
            first = members[0]
            assert first is not None
            if (torch.device(device).type != "cpu" or first.ggml_type not in REPACKED
                    or any(m.ggml_type != first.ggml_type or m.shape[1] != first.shape[1] for m in members if m)):
                continue
            biases = [bias_of(prefix + name) for name in names]
            if any(b is None for b in biases) and any(b is not None for b in biases):
                raise ModelError(f"{prefix}{', '.join(names)}: some have a bias and some not")
            sizes = [m.shape[0] for m in members if m]
            stacked = torch.cat([m.blocks for m in members if m])
            bias = torch.cat([b for b in biases if b is not None]) if biases[0] is not None else None
            fused = gguf_linear(stacked, first.ggml_type, (sum(sizes), first.shape[1]), bias, device, dtype)
            shared = Computed()
            for index, name in enumerate(names):
                setattr(parent, name, FusedPart(fused, sizes, index, shared))
                del paths[prefix + name]
    for path, weight in paths.items():
        parent_name, _, name = path.rpartition(".")
        parent = module.get_submodule(parent_name)
        setattr(parent, name, gguf_linear(weight.blocks, weight.ggml_type, weight.shape, bias_of(path), device,
                                          dtype))


class GGUFEmbedding(nn.Module):
    """An embedding kept as the file's blocks: a lookup dequantizes only the rows it looks up (the file's values, in
    float32: gguf-py's, or for the 8-bit group types swarm.stage.gguf_q8's torch decoding of the same bits). For a
    large vocabulary the embedding is most of a first stage's weights (a 262k-token Gemma's); a decode step looks up
    one row a request. ``scale``: the family's embedding scale (Gemma multiplies by sqrt(hidden), in float32 as
    transformers' scaled embedding does), None for none. Where the stage also holds the tied head on the 8-bit
    kernel, :meth:`share` looks rows up in the head's bytes instead and drops the blocks: the matrix is held once."""

    blocks: torch.Tensor  # a buffer (register_buffer), declared for type checkers

    def __init__(self, weight: GGUFBlocks, padding_idx: int | None = None, scale: float | None = None):
        super().__init__()
        self.register_buffer("blocks", weight.blocks)
        self.ggml_type, self.num_embeddings, self.embedding_dim = weight.ggml_type, *weight.shape
        self.padding_idx = padding_idx
        self.scale = scale
        self.head: nn.Module | None
        object.__setattr__(self, "head", None)  # not a submodule: the stage holds the head (one copy, counted once)

    def share(self, head: nn.Module) -> bool:
        """Look rows up in ``head`` (the tied head of the same stage) where it is an 8-bit kernel layer over the same
        matrix, dropping this module's blocks; False, and nothing changed, where it is not."""
        if not isinstance(head, gguf_q8.GgufQ8Linear) or head.ggml_type != self.ggml_type or \
                (head.out_features, head.in_features) != (self.num_embeddings, self.embedding_dim):
            return False
        object.__setattr__(self, "head", head)
        self.register_buffer("blocks", torch.empty(0, dtype=torch.uint8))
        return True

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1).cpu()
        rows: torch.Tensor
        if isinstance(self.head, gguf_q8.GgufQ8Linear):
            rows = self.head.weight_rows(flat)
        elif self.ggml_type in gguf_q8.SUPPORTED:
            rows = gguf_q8.widen(self.blocks[flat], self.ggml_type, self.embedding_dim)
        else:
            from swarm.stage.weights import dequantize

            rows = dequantize(self.blocks[flat], self.ggml_type, (flat.numel(), self.embedding_dim), "the embedding")
        if self.scale is not None:  # transformers: weight rows * torch.tensor(scale) (float32)
            rows = rows * torch.tensor(self.scale, dtype=torch.float32)
        return rows.reshape(*ids.shape, self.embedding_dim).to(ids.device)

    def extra_repr(self) -> str:
        held = "the tied head's bytes" if self.head is not None else f"{self.ggml_type} blocks"
        scale = f", scaled by {self.scale:g}" if self.scale is not None else ""
        return f"{self.num_embeddings}, {self.embedding_dim}, {held} (rows dequantized as looked up){scale}"


def is_linear_weight(layer: nn.Module, key: str) -> bool:
    """Whether state-dict name ``key`` is the weight of an ``nn.Linear`` in ``layer``."""
    path, _, leaf = key.rpartition(".")
    if leaf != "weight":
        return False
    try:
        return isinstance(layer.get_submodule(path), nn.Linear)
    except AttributeError:
        return False
