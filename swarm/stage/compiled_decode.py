"""The decode step of int4-fast decoder layers in C: for rows that are each one request's next token, a layer is two
calls into swarm's int4 kernel library (int4_kernel.c) writing the cache in place, instead of some thirty torch
operations.

Why: at int4-fast on CPU, once the matrices run on swarm's kernel, most of a decode step is the fixed cost of the
small torch operations between them -- norms, views, the rotation, the attention call, the activation, the residuals
-- each a few microseconds for a row of a few hundred numbers (bench/HISTORY.md). The first call normalises the row,
computes q, k and v with the stacked matrix and rotates q and k (Qwen3: each head's norm first), writing the new keys
and values straight into room at the end of the cache's buffers (:func:`_room`: the library's update copies the whole
cache at every step, ~6 ms a token at 1000 tokens of context on the built-in model); the second call attends each row
to its own request's keys and values, then runs the output projection, the MLP and both residuals.

Where it computes: :func:`install` gives each eligible layer a forward that takes this path for one new row of a
request, or one new row of each of several (a batched decode pass: each row attends to its own cache), and the
library's layer for everything else (prompts). Drafting ahead's verifying pass -- a request's sampled token and the
guesses after it -- is a decode pass too: the stage flags it (``alone``) and each of its rows attends to the keys up
to its own, so it computes, to the bit, what the same tokens would as decode steps one by one; the guesses kept are
the reply without drafting, with no near-tie exception. Every caller of the layers -- the stage's
passes, the lean step (swarm.stage.lean_decode), transformers' ``generate`` on a model quantized whole
(swarm.stage.quantize.quantize_model) -- goes through that forward, so a ring and one process compute the same bits.
Each row is computed alone (its own norm, its own activations' 8 bits, its own attention), so a chat's tokens do not
depend on the chats batched with it.

What it is checked against: at install, each layer's step on random rows against the library's step on the same
rows and cache (it sums in another order, so not to the bit: see _TOLERANCE); a layer that differs keeps the
library's forward and the log says so.
"""

from __future__ import annotations

import ctypes
import logging
from typing import Any, ClassVar

import torch
from transformers.cache_utils import DynamicCache

from swarm.errors import KernelMismatch
from swarm.model_format import LEAN_DECODE_FAMILIES
from swarm.stage.int4_kernel import GROUP, SCALE_FORMATS, expect
from swarm.stage.kv_cache import is_packed

log = logging.getLogger(__name__)

# of the largest output. Summing in another order moves a value by ~1e-7 -- but the kernel rounds each row's activations
# to 8 bits, and a value on a rounding boundary then moves a whole level: up to ~2 % of a layer's output here. A wrong
# step (rotation, attention, a norm) is off by the output's own size.
_TOLERANCE = 0.05
# The most rows of one request a pass computes row by row (:func:`alone`): a verifying pass of SWARM_SERVE_SPECULATIVE's
# 16 guesses and the sampled token.
MAX_ALONE = 17


class _Layer(ctypes.Structure):
    _fields_: ClassVar[list[tuple[str, Any]]] = [
        ("hidden", ctypes.c_int), ("heads", ctypes.c_int), ("kv_heads", ctypes.c_int),
        ("head_dim", ctypes.c_int), ("inter", ctypes.c_int), ("eps", ctypes.c_float),
        ("scaling", ctypes.c_float)] + [(name, ctypes.c_void_p) for name in (
            "in_norm", "post_norm", "q_norm", "k_norm", "w_qkv", "s_qkv", "b_qkv", "w_o", "s_o", "b_o",
            "w_gate_up", "s_gate_up", "w_down", "s_down")] + [("scale_format", ctypes.c_int)]


class CompiledStep:
    """One decoder layer's C step (the pointers into its tensors, which it keeps alive)."""

    def __init__(self, layer: Any, config: Any, kernel: Any):
        attn, mlp = layer.self_attn, layer.mlp
        qkv, gate_up = attn.q_proj.fused, mlp.gate_proj.fused
        self.index = attn.layer_idx
        self.hidden = config.hidden_size
        self.heads, self.kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, attn.head_dim
        q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)

        def kept(t: torch.Tensor | None) -> torch.Tensor | None:  # float32 copies the step reads (kept alive here)
            return None if t is None else t.detach().float().contiguous()

        def pointer(t: torch.Tensor | None) -> int | None:
            return None if t is None else t.data_ptr()

        self._in_norm, self._post_norm = kept(layer.input_layernorm.weight), kept(layer.post_attention_layernorm.weight)
        self._q_norm = kept(q_norm.weight if q_norm is not None else None)  # Qwen3's per-head norms, else None
        self._k_norm = kept(k_norm.weight if k_norm is not None else None)
        self._qkv_bias, self._o_bias = kept(qkv.bias), kept(attn.o_proj.bias)
        self.struct = _Layer(
            hidden=self.hidden, heads=self.heads, kv_heads=self.kv_heads, head_dim=self.head_dim,
            inter=mlp.gate_proj.out_features, eps=float(layer.input_layernorm.variance_epsilon),
            scaling=float(attn.scaling), in_norm=pointer(self._in_norm), post_norm=pointer(self._post_norm),
            q_norm=pointer(self._q_norm), k_norm=pointer(self._k_norm), w_qkv=qkv.packed.data_ptr(),
            s_qkv=qkv.scale_zeros.data_ptr(), b_qkv=pointer(self._qkv_bias), w_o=attn.o_proj.packed.data_ptr(),
            s_o=attn.o_proj.scale_zeros.data_ptr(), b_o=pointer(self._o_bias), w_gate_up=gate_up.packed.data_ptr(),
            s_gate_up=gate_up.scale_zeros.data_ptr(), w_down=mlp.down_proj.packed.data_ptr(),
            s_down=mlp.down_proj.scale_zeros.data_ptr(),
            scale_format=SCALE_FORMATS[qkv.scale_zeros.dtype])  # bfloat16, or a GGUF's exact scales (gguf_linear)
        self._tensors = (qkv, attn.o_proj, gate_up, mlp.down_proj)  # the buffers the pointers point into
        self._check_weights()
        self._qkv_call, self._rest_call = kernel.layer_calls(_Layer)
        self._queries: dict[int, torch.Tensor] = {}

    def _check_weights(self) -> None:
        """Every tensor the struct points into has the shape, dtype and layout the C step reads (KernelMismatch)."""
        hidden, hd, inter = self.hidden, self.head_dim, self.struct.inter
        width = (self.heads + 2 * self.kv_heads) * hd
        for name, part, n, k in (("q, k, v", self._tensors[0], width, hidden), ("o", self._tensors[1], hidden,
                                 self.heads * hd), ("gate, up", self._tensors[2], 2 * inter, hidden),
                                 ("down", self._tensors[3], hidden, inter)):
            expect(part.packed, f"layer {self.index}'s {name} weights", torch.uint8, (n, k // 2))
            # every matrix's scales in one dtype, as the struct says (scale_format: its scale format)
            expect(part.scale_zeros, f"layer {self.index}'s {name} scales", self._tensors[0].scale_zeros.dtype,
                   (n, 2, k // GROUP))
        for name, t, size in (("input norm", self._in_norm, hidden), ("post-attention norm", self._post_norm, hidden),
                              ("q norm", self._q_norm, hd), ("k norm", self._k_norm, hd),
                              ("q, k, v bias", self._qkv_bias, width), ("o bias", self._o_bias, hidden)):
            if t is not None:
                expect(t, f"layer {self.index}'s {name}", torch.float32, (size,))

    def check(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, caches: list,
              sizes: list[int] | None) -> None:
        """KernelMismatch unless the inputs are what :meth:`step` hands to C. Every layer of a stage takes the same
        (one config), so a pass checks them once for all its layers (:func:`run_steps`)."""
        rows, hd = x.shape[0], self.head_dim
        expect(x, "the decode step's rows", torch.float32, (rows, self.hidden))
        expect(cos, "the rotary cosines", torch.float32, (rows, hd))
        expect(sin, "the rotary sines", torch.float32, (rows, hd))
        counts = sizes or [1] * len(caches)
        if len(counts) != len(caches) or sum(counts) != rows:
            raise KernelMismatch(f"the compiled decode step got {rows} rows for {len(caches)} caches of "
                                 f"{len(counts)} sizes summing to {sum(counts)}: this is a bug in swarm; report it, "
                                 "and run with SWARM_INT4_KERNEL=0 meanwhile")

    def step(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, caches: list,
             sizes: list[int] | None = None, checked: bool = False) -> torch.Tensor:
        """``x`` (rows, hidden) float32, contiguous, at the positions of ``cos`` and ``sin`` (rows, head_dim): the
        layer's output, written over ``x``. The rows are ``sizes[i]`` new rows of the request whose cache is
        ``caches[i]``, in order (one each without ``sizes``); each cache that many rows longer. A request's rows each
        attend to its keys up to their own, so every row computes what it would as a decode step of its own.
        ``checked``: the caller has checked the inputs (:meth:`check`)."""
        if not checked:
            self.check(x, cos, sin, caches, sizes)
        rows = x.shape[0]
        hd = self.head_dim
        q = self._queries.get(rows)  # scratch the first call fills and the second reads, kept per row count
        if q is None:
            q = self._queries[rows] = torch.empty((rows, self.heads * hd))
        k_rows, v_rows = (ctypes.c_void_p * rows)(), (ctypes.c_void_p * rows)()
        keys, values = (ctypes.c_void_p * rows)(), (ctypes.c_void_p * rows)()
        lengths, spans = (ctypes.c_int * rows)(), (ctypes.c_int * rows)()
        grown = []
        row = 0
        for cache, n in zip(caches, sizes or [1] * len(caches)):
            layer = cache.layers[self.index]
            (k_room, v_room), length = _room(layer, n, self.kv_heads, hd)
            span, k_at, v_at = k_room.shape[2], k_room.data_ptr(), v_room.data_ptr()
            # _room made the buffers (1, kv_heads, span, head_dim) and contiguous; its dtype and device are its
            # caller's, which another path (append) may have chosen
            if k_room.dtype != torch.float32 or v_room.dtype != torch.float32 or not k_room.is_cpu:
                expect(k_room, "a cache's keys", torch.float32, (1, self.kv_heads, span, hd))
                expect(v_room, "a cache's values", torch.float32, (1, self.kv_heads, span, hd))
            for j in range(n):  # the new keys and values go into the cache's buffer at their positions
                keys[row], values[row] = k_at, v_at
                k_rows[row], v_rows[row] = k_at + 4 * hd * (length + j), v_at + 4 * hd * (length + j)
                lengths[row], spans[row] = length + j + 1, span
                row += 1
            grown.append((layer, k_room, v_room, length + n))
        threads = torch.get_num_threads()
        if self._qkv_call(ctypes.byref(self.struct), x.data_ptr(), rows, cos.data_ptr(), sin.data_ptr(), q.data_ptr(),
                          k_rows, v_rows, spans, threads):
            raise MemoryError("the compiled decode step could not allocate its scratch")
        for layer, k_room, v_room, length in grown:  # the cache's layer: the first ``length`` positions of its buffer
            layer.keys, layer.values = k_room.narrow(2, 0, length), v_room.narrow(2, 0, length)
        if self._rest_call(ctypes.byref(self.struct), x.data_ptr(), rows, q.data_ptr(), keys, values, lengths, spans,
                           threads):
            raise MemoryError("the compiled decode step could not allocate its scratch")
        return x


def append(layer: Any, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``DynamicLayer.update`` without copying the cache: the new ``keys`` and ``values`` (1, kv_heads, n, head_dim)
    written into the layer's room (:func:`_room`); the layer's keys and values, now n positions longer, returned."""
    n = keys.shape[2]
    (k_room, v_room), length = _room(layer, n, keys.shape[1], keys.shape[3], keys.dtype, keys.device)
    k_room.narrow(2, length, n).copy_(keys)
    v_room.narrow(2, length, n).copy_(values)
    layer.keys, layer.values = k_room.narrow(2, 0, length + n), v_room.narrow(2, 0, length + n)
    return layer.keys, layer.values


def _room(layer: Any, n: int, kv_heads: int, head_dim: int, dtype: torch.dtype = torch.float32,
          device: Any = "cpu") -> tuple[tuple[torch.Tensor, torch.Tensor], int]:
    """A cache layer's buffers with room for ``n`` more positions, and how many it holds: the step writes its keys and
    values there in place, instead of the library's concatenation (which copies the whole cache at every step).

    The layer's keys and values stay what the library expects -- (1, kv_heads, length, head_dim), now views of the
    first ``length`` positions of the buffers -- so the library's own passes, cropping a rejected guess and copying a
    cache work on it unchanged. Where they replaced the tensors (the library's update concatenates), or the buffer is
    full, the cache moves to new buffers with an eighth more room (at least 64 positions): a copy every so often
    instead of at every step, for at most an eighth more memory."""
    keys = layer.keys if layer.is_initialized else None
    length = 0 if keys is None or keys.dim() < 4 else keys.shape[2]
    room = layer.__dict__.get("_room")
    if room is not None and length + n <= room[0].shape[2] and (length == 0 or (
            keys is not None and keys.data_ptr() == room[0].data_ptr() and keys.stride() == room[0].stride()
            and layer.values.data_ptr() == room[1].data_ptr())):
        return room, length
    span = length + n + max(64, (length + n) // 8)
    room = tuple(torch.empty((1, kv_heads, span, head_dim), dtype=dtype, device=device) for _ in range(2))
    if length:
        room[0][:, :, :length] = keys
        room[1][:, :, :length] = layer.values
    if not layer.is_initialized:
        layer.lazy_initialization(room[0], room[1])
    layer._room = room
    return room, length


def _eligible(hidden: torch.Tensor) -> bool:
    return hidden.dim() == 3 and hidden.shape[0] == 1 and hidden.dtype == torch.float32 and hidden.device.type == "cpu"


def alone(sizes: list[int], flags: list[bool] | None) -> list[bool]:
    """Which requests of a pass (``sizes`` rows each) the C step computes row by row: one new row, or up to
    MAX_ALONE rows of a request flagged in ``flags`` (decode passes: drafting's verifying pass, whose rows must compute
    what they would as decode steps of their own -- so the guesses kept are the reply without drafting, to the bit)."""
    return [n == 1 or (flags is not None and flags[i] and n <= MAX_ALONE) for i, n in enumerate(sizes)]


def _layer_forward(library: Any, step: CompiledStep):
    """The forward :func:`install` gives a layer: single rows (and flagged decode passes) through ``step``, the rest
    through ``library``."""
    from swarm.stage.ragged import RaggedCache

    def forward(hidden_states, *args, **kwargs):
        cache, position_embeddings = kwargs.get("cache"), kwargs.get("position_embeddings")
        # a packed cache (swarm.stage.kv_cache): the library's layer, as the step writes a plain cache in place
        if args or position_embeddings is None or not _eligible(hidden_states) or is_packed(cache):
            return library(hidden_states, *args, **kwargs)
        cos, sin = position_embeddings
        if isinstance(cache, DynamicCache) and hidden_states.shape[1] == 1:
            return _rows(step, hidden_states[0], cos[0], sin[0], [cache]).unsqueeze(0)
        if not isinstance(cache, RaggedCache):
            return library(hidden_states, *args, **kwargs)
        takes = alone(cache.sizes, cache.alone)
        if all(takes):
            return _rows(step, hidden_states[0], cos[0], sin[0], cache.caches, cache.sizes).unsqueeze(0)
        if not any(takes):
            return library(hidden_states, *args, **kwargs)
        # a batch of rows the step takes and longer chunks: each request's rows as they would go alone -- those
        # through the step, the chunks through the library's layer as a batch of their own
        starts = [0]
        for n in cache.sizes:
            starts.append(starts[-1] + n)
        ours = [i for i, t in enumerate(takes) if t]
        longer = [i for i, t in enumerate(takes) if not t]
        at = torch.cat([torch.arange(starts[i], starts[i + 1]) for i in ours])
        rest = torch.cat([torch.arange(starts[i], starts[i + 1]) for i in longer])
        out = torch.empty_like(hidden_states)
        out[0, at] = _rows(step, hidden_states[0, at], cos[0, at], sin[0, at], [cache.caches[i] for i in ours],
                           [cache.sizes[i] for i in ours])
        position_ids = kwargs.get("position_ids")
        kwargs = dict(kwargs, cache=RaggedCache([cache.caches[i] for i in longer], [cache.sizes[i] for i in longer]),
                      position_embeddings=(cos[:, rest], sin[:, rest]))
        if position_ids is not None:
            kwargs["position_ids"] = position_ids[:, rest]
        out[:, rest] = library(hidden_states[:, rest], **kwargs)
        return out

    return forward


def run_steps(steps: list[CompiledStep], rows: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
              caches: list, sizes: list[int] | None = None) -> torch.Tensor:
    """(rows, hidden) through ``steps`` in turn, ``sizes[i]`` rows for ``caches[i]`` (one each without ``sizes``:
    see CompiledStep.step), at the rotary tables ``cos`` and ``sin`` (rows, head_dim); the input is left as it was."""
    x = rows.clone().contiguous()
    cos, sin = cos.float().contiguous(), sin.float().contiguous()
    if steps:
        steps[0].check(x, cos, sin, caches, sizes)  # once for all: the layers of a stage share their shapes
    for step in steps:
        x = step.step(x, cos, sin, caches, sizes, checked=True)
    return x


def _rows(step: CompiledStep, rows: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, caches: list,
          sizes: list[int] | None = None) -> torch.Tensor:
    return run_steps([step], rows, cos, sin, caches, sizes)


def _takes_layer(layer: Any, config: Any) -> bool:
    """Whether ``layer`` has the shape the C step computes: the family's layer, on CPU, its matrices on the kernel."""
    if config.model_type not in LEAN_DECODE_FAMILIES or getattr(config, "hidden_act", "silu") != "silu":
        return False
    layer_types = getattr(config, "layer_types", None)
    if isinstance(layer_types, list):  # a sliding window needs a mask even for one row
        if "sliding_attention" in layer_types:
            return False
    elif getattr(config, "sliding_window", None) is not None and getattr(config, "use_sliding_window", True):
        return False
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    qkv, gate_up = getattr(getattr(attn, "q_proj", None), "fused", None), getattr(getattr(mlp, "gate_proj", None),
                                                                                   "fused", None)
    parts = (qkv, getattr(attn, "o_proj", None), gate_up, getattr(mlp, "down_proj", None))
    if any(getattr(p, "kernel", None) is None for p in parts):
        return False
    if len({p.scale_zeros.dtype for p in parts if p is not None}) != 1:  # one format per struct (a GGUF of mixed types)
        return False
    assert attn is not None and mlp is not None and gate_up is not None  # their projections have kernels
    if gate_up.bias is not None or mlp.down_proj.bias is not None:
        return False
    if attn.head_dim % 2 or config.num_attention_heads % config.num_key_value_heads:
        return False
    return mlp.gate_proj.sizes == [mlp.gate_proj.out_features, mlp.up_proj.out_features] and \
        attn.q_proj.sizes == [config.num_attention_heads * attn.head_dim] + [config.num_key_value_heads *
                                                                               attn.head_dim] * 2


def install(layers: Any, config: Any) -> int:
    """Give each eligible layer of ``layers`` the compiled step for single-row passes, once it computes the library's
    step to float32 rounding; the number of layers that took it."""
    from swarm.stage import int4_kernel

    kernel = int4_kernel.kernel()
    if kernel is None:
        return 0
    kernel.layer_calls(_Layer)  # refused (KernelMismatch) where the C struct's layout is not the mirror's
    taken = 0
    for layer in layers:
        if getattr(layer, "compiled_step", None) is not None or not _takes_layer(layer, config):
            continue
        step = CompiledStep(layer, config, kernel)
        if not _agrees(layer, step, config):
            continue
        layer.compiled_step = step
        layer.forward = _layer_forward(layer.forward, step)
        taken += 1
    return taken


def _agrees(layer: Any, step: CompiledStep, config: Any) -> bool:
    """The step against the library's on random rows: a prompt of 5 through the library, then two decode steps each
    way on copies of its cache."""
    import copy

    generator = torch.Generator().manual_seed(0)
    hidden = config.hidden_size
    dim = step.head_dim
    with torch.inference_mode():
        cache = DynamicCache(config=config)
        prompt = torch.randn((1, 5, hidden), generator=generator)
        layer(prompt, cache=cache, position_embeddings=_rotary(5, 0, dim), use_cache=True)
        ours = copy.deepcopy(cache)
        worst = 0.0
        for position in (5, 6):
            x = torch.randn((1, 1, hidden), generator=generator)
            cos, sin = _rotary(1, position, dim)
            want = layer(x, cache=cache, position_embeddings=(cos, sin), use_cache=True)
            got = step.step(x.reshape(1, -1).clone(), cos.reshape(1, -1).contiguous(), sin.reshape(1, -1).contiguous(),
                            [ours]).view(1, 1, -1)
            scale = want.abs().max().item() or 1.0
            worst = max(worst, (want - got).abs().max().item() / scale,
                        (cache.layers[step.index].keys - ours.layers[step.index].keys).abs().max().item() /
                        (cache.layers[step.index].keys.abs().max().item() or 1.0))
    if worst > _TOLERANCE or worst != worst:
        log.warning("layer %d keeps the library's decode step: the compiled one differs from it by %.3g of its "
                    "largest output", step.index, worst)
        return False
    return True


def _rotary(n: int, first: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A rotary table of the default kind for positions first..first + n - 1 (1, n, dim)."""
    inv = 1.0 / (10000 ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    angles = torch.arange(first, first + n, dtype=torch.float32)[:, None] * inv[None]
    emb = torch.cat((angles, angles), dim=-1)[None]
    return emb.cos(), emb.sin()


def compiled(layers: Any) -> bool:
    """Whether every one of ``layers`` computes its single-row passes with the C step."""
    return len(layers) > 0 and all(getattr(layer, "compiled_step", None) is not None for layer in layers)

