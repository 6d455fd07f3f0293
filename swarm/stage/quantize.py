"""Quantized loads: a stage's linear layers held and computed at 8 or 4 bits, quantized as they are loaded.

Kinds (the seed's "Quantized models"): ``none``, ``int8``, ``nf4``, ``int4-fast`` -- and ``gguf``, a GGUF model's
own blocks, which swarm.stage.gguf_linear builds as the stage reads them (nothing to quantize here). Each fellow
quantizes only its own layers, one decoder layer at a time right after its float weights are read, so the float copy
of the whole stage is never held at once. Embeddings, norms and the KV caches stay in the compute dtype.

On CUDA: int8 and nf4 with bitsandbytes (LLM.int8 and NF4 with 64-weight blocks); int4-fast with torchao's int4
weight-only kernels (tinygemm) where torchao is installed, else plain nf4 (the seed's rule).

On CPU, measured on this repository's machines (bench/quantized.py, bench/HISTORY.md), torch's own weight-only
kernels with bfloat16 activations are the fastest paths that keep every row of a batch independent:

- int8: ``aten._weight_int8pack_mm`` -- int8 weights with one scale per output row.
- nf4: ``aten._weight_int4pack_mm_for_cpu`` -- 4-bit weights in groups of 32 along the input, each group with its
  own scale and offset (the layout of torchao's and gpt-fast's int4). The NF4 code book (non-uniform levels) has no
  CPU kernel: dequantizing it for every pass runs slower than float32, so both 4-bit kinds hold this grid on CPU.
- int4-fast: the same grid, computed by swarm's own kernel (swarm.stage.int4_kernel, compiled for the CPU on first
  use) with the activations quantized to 8 bits per group of 32 as they come in, as llama.cpp computes its Q4 x Q8
  dot products: a byte dot product does 64 multiply-adds in one VNNI instruction and the kernel takes the float32 rows
  without the casts around torch's kernel. Measured here it is the faster path (1.1-1.45x a matrix for one row) at a
  quality cost -- 1.6 % perplexity for the built-in model -- which is the "fast" in the kind's name; nf4, the quality
  choice, keeps torch's kernel. Where the kernel cannot be built (no C compiler) or SWARM_INT4_KERNEL=0, int4-fast
  takes torch's kernel too.

torch.ao's dynamic int8 (``quantize_dynamic``) ran the small matrices faster still, but it quantizes the activations
with one scale over all the rows it is given: a chat's reply would then depend on the other chats batched with it
(and torch deprecates it). torchao's int8 paths run slower than float32 in eager mode (DESIGN.md).

The head (``lm_head``) is a linear layer too, and on a small model a large share of each token's time. On CPU it runs
at int8 for int8 and nf4 (the quality choice: 4 bits in the head cost the built-in model 9 % perplexity, where the
layers at 4 bits cost 0.4 %; llama.cpp also keeps its output matrix wider), and at 4 bits for int4-fast (the speed
choice: measured here, the built-in model's 49152 x 576 head took 2.1 ms at 4 bits, 6-10 ms at int8, 14-18 ms in
float32 -- though in the whole built-in model that gain stayed within the VM's noise, bench/HISTORY.md). On CUDA it
stays in half precision, as bitsandbytes' loaders leave it.

Every function here is deterministic: the same weights quantized by the same kind give the same tensors, so a ring's
stages and one whole model quantized alike (:func:`quantize_model`) compute the same tokens.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from swarm.errors import ModelError
from swarm.quantization import INT4_GROUP, KINDS, check_kind, cuda_path, needs  # noqa: F401 (re-exported)
from swarm.stage import int4_kernel

log = logging.getLogger(__name__)

# --- quantizing modules --------------------------------------------------------------------------------------------


def quantize_linears(module: Any, kind: str, *, skip: Iterable[str] = ()) -> Any:
    """Replace every ``nn.Linear`` inside ``module`` (at any depth) by its ``kind`` counterpart on the device its
    weight is on; ``module`` itself is returned (or its replacement, when it is a Linear itself)."""
    kind = check_kind(kind)
    if kind in ("none", "gguf"):  # gguf: built from the file's blocks as they are read (swarm.stage.gguf_linear)
        return module
    if isinstance(module, nn.Linear):
        return quantize_linear(module, kind)
    from swarm.stage.moe_experts import quantize_experts

    quantize_experts(module, quantize_linear, kind)  # a MoE layer's experts: a linear layer per expert matrix
    skip = set(skip)
    for parent in list(module.modules()):
        _fuse_siblings(parent, kind, skip)
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear) and name not in skip:
                setattr(parent, name, quantize_linear(child, kind))
    return module


# Linear layers that read the same input, in the order the families' forward() calls them: on CPU each group is
# quantized as one matrix and computed in one kernel call (see FusedPart).
SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def _fuse_siblings(parent: Any, kind: str, skip: set[str]) -> None:
    """On CPU, each group of :data:`SIBLINGS` under ``parent`` becomes one quantized matrix (their rows stacked) and
    each member a :class:`FusedPart` of it. Both kernels quantize row by row (a scale per output row, or per group of
    inputs in a row), so the stacked matrix holds exactly the weights each member would hold alone. Measured on the
    built-in model (bench/decode_profile.py): a decoder layer makes 4 kernel calls instead of 7, each with its casts
    to and from bfloat16."""
    for names in SIBLINGS:
        members = [m for m in (getattr(parent, name, None) for name in names) if isinstance(m, nn.Linear)]
        if any(name in skip for name in names) or len(members) != len(names):
            continue
        first = members[0]
        if (first.weight.device.type != "cpu" or first.in_features % INT4_GROUP
                or any(m.in_features != first.in_features or m.weight.device != first.weight.device
                       or m.weight.dtype != first.weight.dtype or (m.bias is None) != (first.bias is None)
                       for m in members)):
            continue
        sizes = [m.out_features for m in members]
        stacked = nn.Linear(first.in_features, sum(sizes), bias=first.bias is not None, device="meta")
        stacked.weight = nn.Parameter(torch.cat([m.weight.detach() for m in members]), requires_grad=False)
        if first.bias is not None:
            stacked.bias = nn.Parameter(torch.cat([m.bias.detach() for m in members]), requires_grad=False)
        fused = _cpu_linear(stacked, kind)
        shared = Computed()
        for index, name in enumerate(names):
            setattr(parent, name, FusedPart(fused, sizes, index, shared))


class Computed:
    """The last output of a fused matrix and the input it was computed for, until its last part took its share."""

    __slots__ = ("input", "parts")

    def __init__(self):
        self.input = self.parts = None


class FusedPart(nn.Module):
    """One member of a fused group (q_proj of q/k/v): the first member called computes the whole stacked
    matrix once and keeps the parts; the members after it that are called with the same input tensor -- the decoder
    layer's own order, q then k then v -- take their part without computing, and the last one lets the parts go. A
    member called with another input (or on its own) computes the stacked matrix itself and returns its part: always
    correct, only slower."""

    def __init__(self, fused: nn.Module, sizes: list[int], index: int, shared: Computed):
        super().__init__()
        self.fused = fused  # the same module in every member: its buffers are held (and counted) once
        self.sizes, self.index, self._shared = list(sizes), index, shared
        self.in_features, self.out_features = fused.in_features, sizes[index]

    def forward(self, x):
        shared = self._shared
        if self.index == 0 or shared.input is not x or shared.parts is None:
            shared.parts = self.fused(x).split(self.sizes, dim=-1)
            shared.input = x
        part = shared.parts[self.index]
        if self.index == len(self.sizes) - 1:
            shared.input = shared.parts = None
        return part

    def extra_repr(self) -> str:
        return f"part {self.index} ({self.out_features} outputs) of {len(self.sizes)}"


def quantize_head(lm_head: Any, kind: str) -> Any:
    """The head for a ``kind`` load: on CPU int8 for int8 and nf4, 4 bits for int4-fast; unchanged on CUDA (see the
    module doc)."""
    if kind in ("none", "gguf") or lm_head.weight.device.type != "cpu":  # gguf: the file's head, widened
        return lm_head
    return quantize_linear(lm_head, "int4-fast" if kind == "int4-fast" else "int8")


def quantize_model(model: Any, kind: str) -> Any:
    """A whole transformers causal LM quantized as a ring's stages quantize their parts: the decoder layers' linear
    layers by ``kind``, the head by :func:`quantize_head`. The one-process reference for a quantized ring."""
    kind = check_kind(kind)
    if kind == "none":
        return model
    for layer in model.model.layers:
        quantize_linears(layer, kind)
    from swarm.stage.compiled_decode import install

    install(model.model.layers, model.config)  # int4-fast on CPU: the stages' C step for single-row passes
    head = model.lm_head
    quantized = quantize_head(head, kind)
    if quantized is not head:
        model.lm_head = quantized
        # generate() must not tie the float embedding back onto the head
        model.config.tie_word_embeddings = False
        if hasattr(model, "_tied_weights_keys"):
            model._tied_weights_keys = None
    return model


def quantize_linear(linear: Any, kind: str) -> Any:
    device_type = linear.weight.device.type
    if device_type == "cpu":
        return _cpu_linear(linear, kind)
    if device_type == "cuda":
        return _cuda_linear(linear, kind)
    raise ModelError(f"{kind} quantization runs on CPU and CUDA devices, not on {device_type}")


def _cpu_linear(linear: Any, kind: str) -> Any:
    if kind == "int8":
        return Int8Linear.from_linear(linear)
    if linear.in_features % INT4_GROUP:
        # The int4 kernel needs whole groups along the input; such a layer (no real model has one) keeps 8 bits.
        return Int8Linear.from_linear(linear)
    return Int4Linear.from_linear(linear, INT4_GROUP, fast=kind == "int4-fast")


def _cuda_linear(linear: Any, kind: str) -> Any:
    if cuda_path(kind) == "torchao":
        try:
            return _torchao_int4(linear)
        except Exception as exc:  # noqa: BLE001 - an installed torchao that cannot run here: plain nf4 (the seed's rule)
            log.warning("torchao's int4 did not take this layer (%s: %s); it runs as plain nf4",
                        type(exc).__name__, exc)
            kind = "nf4"
    try:
        import bitsandbytes as bnb
    except ImportError as exc:
        raise ModelError(f"{kind} on a CUDA card needs {needs(kind, 'cuda')} ({exc})") from exc
    device, dtype = linear.weight.device, linear.weight.dtype
    weight = linear.weight.data.to("cpu")
    bias = linear.bias is not None
    if kind == "int8":
        q = bnb.nn.Linear8bitLt(linear.in_features, linear.out_features, bias=bias, has_fp16_weights=False,
                                threshold=6.0, device="meta")
        q.weight = bnb.nn.Int8Params(weight, requires_grad=False, has_fp16_weights=False)
    else:  # nf4, and int4-fast without torchao
        q = bnb.nn.Linear4bit(linear.in_features, linear.out_features, bias=bias, compute_dtype=dtype,
                              quant_type="nf4", device="meta")
        q.weight = bnb.nn.Params4bit(weight, requires_grad=False, quant_type="nf4", compress_statistics=True)
    if bias:
        q.bias = linear.bias
    return q.to(device)  # bitsandbytes quantizes when the weight moves to the card


def _torchao_int4(linear: Any) -> Any:
    from torchao.quantization import Int4WeightOnlyConfig, quantize_

    # tinygemm's kernel takes bfloat16 activations and weights, in groups of 128 (torchao's default); a stage that
    # computes in float16 hands it bfloat16 and takes its own dtype back.
    dtype = linear.weight.dtype
    quantized = copy.deepcopy(linear).to(torch.bfloat16)
    quantize_(quantized, Int4WeightOnlyConfig(group_size=128))
    return quantized if dtype == torch.bfloat16 else CastAround(quantized, torch.bfloat16)


class CastAround(nn.Module):
    """``inner`` computed in ``dtype``, its output back in the input's."""

    def __init__(self, inner: nn.Module, dtype: torch.dtype):
        super().__init__()
        self.inner, self.compute_dtype = inner, dtype

    def forward(self, x):
        return self.inner(x.to(self.compute_dtype)).to(x.dtype)


# --- the CPU modules ------------------------------------------------------------------------------------------------

# Both kernels take their activations in bfloat16 on CPU: measured here with float32 ones they ran 5-40x slower
# than with bfloat16 (a generic loop instead of the AVX-512 one), slower than float32 itself.
ACTIVATIONS = torch.bfloat16
# The kernels through torch's own bindings: the same kernels as torch.ops.aten's, ~1.5 us less per call (121 calls
# per token for the built-in model).
int8_mm = getattr(torch, "_weight_int8pack_mm", torch.ops.aten._weight_int8pack_mm)
int4_mm = getattr(torch, "_weight_int4pack_mm_for_cpu", torch.ops.aten._weight_int4pack_mm_for_cpu)


class Int8Linear(nn.Module):
    """y = x @ (q * scale).T + b: int8 weights, one float scale per output row (symmetric, absmax / 127)."""

    qweight: torch.Tensor  # buffers (register_buffer), declared for type checkers
    scales: torch.Tensor

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.in_features, self.out_features = qweight.shape[1], qweight.shape[0]
        self.register_buffer("qweight", qweight)
        self.register_buffer("scales", scales)
        self.bias = nn.Parameter(bias, requires_grad=False) if bias is not None else None

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> nn.Module:
        w = linear.weight.detach().float()
        # the scale as the kernel will hold it (bfloat16), so the weights round to the grid it computes with
        scales = (w.abs().amax(dim=1) / 127).clamp(min=1e-30).to(ACTIVATIONS)
        q = torch.round(w / scales.float()[:, None]).clamp(-127, 127).to(torch.int8)
        bias = linear.bias.detach() if linear.bias is not None else None
        return cls(q.contiguous(), scales, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.rows(x.reshape(-1, x.shape[-1])).reshape(*x.shape[:-1], self.out_features)

    def rows(self, flat: torch.Tensor) -> torch.Tensor:
        """The layer over a 2-D input (rows, in_features), in the input's dtype."""
        y = int8_mm(flat.to(ACTIVATIONS), self.qweight, self.scales).to(flat.dtype)
        return y + self.bias if self.bias is not None else y

    def dequantized(self) -> torch.Tensor:
        return self.qweight.float() * self.scales.float()[:, None]

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8"

class Int4Linear(nn.Module):
    """4-bit weights in groups of ``group`` inputs, each with a scale and an offset: w = (q - 8) * scale + zero,
    q in 0..15 (the int4 layout of torch's CPU kernel, torchao's Int4CPULayout)."""

    packed: torch.Tensor  # buffers (register_buffer), declared for type checkers
    scale_zeros: torch.Tensor

    def __init__(self, packed: torch.Tensor, scale_zeros: torch.Tensor, group: int, in_features: int,
                 out_features: int, bias: torch.Tensor | None, kernel: Any = None):
        super().__init__()
        self.in_features, self.out_features, self.group = in_features, out_features, group
        self.kernel = kernel  # swarm's int4 kernel (its layout), or None: torch's
        self.register_buffer("packed", packed)
        # torch's layout: (in / group, out, 2); swarm's kernel's: (out, 2, in / group) -- see int4_kernel.pack
        self.register_buffer("scale_zeros", scale_zeros)
        self.bias = nn.Parameter(bias, requires_grad=False) if bias is not None else None

    @classmethod
    def from_linear(cls, linear: nn.Linear, group: int = INT4_GROUP, fast: bool = False) -> nn.Module:
        """``fast``: computed by swarm's int4 kernel where it runs here (int4-fast), else by torch's."""
        w = linear.weight.detach().float()
        n, k = w.shape
        groups = w.reshape(n, k // group, group)
        low, high = groups.amin(-1), groups.amax(-1)
        # scale and offset as the kernel will hold them (bfloat16), so the weights round to its grid
        scale = ((high - low) / 15).clamp(min=1e-30).to(ACTIVATIONS)
        zero = (low + 8 * scale.float()).to(ACTIVATIONS)
        q = torch.round((groups - zero.float()[..., None]) / scale.float()[..., None] + 8).clamp(0, 15)
        bias = linear.bias.detach() if linear.bias is not None else None
        kernel = int4_kernel.kernel() if fast and group == int4_kernel.GROUP and int4_kernel.takes(k) else None
        if kernel is not None:
            packed, scale_zeros = kernel.pack(q.reshape(n, k), scale, zero)
            return cls(packed, scale_zeros, group, k, n, bias, kernel)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).reshape(n, k).contiguous(), 1)
        scale_zeros = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous()
        return cls(packed, scale_zeros, group, k, n, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.rows(x.reshape(-1, x.shape[-1])).reshape(*x.shape[:-1], self.out_features)

    def rows(self, flat: torch.Tensor) -> torch.Tensor:
        """The layer over a 2-D input (rows, in_features), in the input's dtype."""
        if self.kernel is not None:
            y = self.kernel.matmul(flat, self.packed, self.scale_zeros, self.out_features, self.bias)
            return y if flat.dtype == torch.float32 else y.to(flat.dtype)
        y = int4_mm(flat.to(ACTIVATIONS), self.packed, self.group, self.scale_zeros).to(flat.dtype)
        return y + self.bias if self.bias is not None else y

    def extra_repr(self) -> str:
        kernel = f", swarm's {self.kernel.simd} kernel" if self.kernel is not None else ""
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"int4 groups of {self.group}{kernel}")


def module_bytes(module: Any) -> int:
    """Bytes of a module's parameters and buffers (quantized weights are buffers), each storage counted once."""
    seen: set[int] = set()
    total = 0
    for t in [*module.parameters(), *module.buffers()]:
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total


def int4_path(stage: Any) -> str | None:
    """Which kernel the stage's 4-bit layers compute with -- "swarm" (8-bit activations) or "torch" (bfloat16 ones) --
    None without 4-bit layers. Two honest fellows on different paths differ by up to 1.9e-1 of a stage's output
    (bench/verify_bounds.py), as much as a broken one: the spot checks pair only fellows on the same path."""
    for layer in stage.layers:
        for module in layer.modules():
            if isinstance(module, Int4Linear):
                return "swarm" if module.kernel is not None else "torch"
    return None
