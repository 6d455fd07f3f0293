"""A lean decode step: one new row of each request (alone or batched), or one request's new rows (drafting ahead's
verifying pass, a prompt's chunk), through a stage's Llama-shaped layers, computed with the same torch operations as
transformers' own layers and nothing around them.

Why: at 4 bits half of a decode step of a small model is not arithmetic but the per-operation cost of the library's
layers -- module calls, keyword plumbing, the attention dispatch, the mask and cache bookkeeping (bench/HISTORY.md,
"a lean decode path"). For one new row none of that is needed: the row attends to everything cached (no mask), the
rotary tables are the stage's, the keys and values append to the request's own DynamicCache layer. One request's
several rows take the library's causal mask, made once per pass, and the attention call the library makes with it.

What it does differently from transformers' LlamaDecoderLayer, none of which changes a bit of the result:

- the norms are ``F.rms_norm`` (the same float32 computation as the families' RMSNorm);
- where the quantized layers hold q/k/v (and gate/up) as one stacked matrix (swarm.stage.quantize), it calls that
  matrix once and takes views, and it rotates the queries and keys as one tensor (rotary is per element), as a roll
  by half a head against a sine table with its first half negated (the same products);
- it hands the quantized layers their rows as a matrix (no reshapes around the kernel);
- it calls torch's SDPA directly with what transformers' SDPA path passes it (for one query row: no mask; for several:
  the library's causal mask with the keys and values repeated per query group, or, for a prompt's first chunk, a causal
  call);
- it appends to the cache's layer directly.

Every stage checks this at warm-up (:func:`verified`): passes of random rows through both paths -- prompts, decode
steps, a verifying pass, a batch -- must agree bit for bit, outputs and cached keys and values, or the stage keeps
the library's path. Only the families whose
layers have exactly this shape take it (Llama, Mistral, Qwen2 and Qwen3 -- with its per-head query and key norms --
without sliding windows); everything else, several requests with several rows each (batched drafting, batched prompt
chunks) and layers spread over several cards keep the library's path.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.nn.functional as F
from transformers.cache_utils import DynamicCache
from transformers.masking_utils import create_causal_mask
from transformers.models.llama.modeling_llama import repeat_kv

from swarm.model_format import LEAN_DECODE_FAMILIES
from swarm.stage.compiled_decode import alone, append, compiled, run_steps
from swarm.stage.kv_cache import is_packed

log = logging.getLogger(__name__)


class LeanDecode:
    def __init__(self, stage: Any):
        config = self.config = stage.config
        self.layers = list(stage.layers)
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        attn = self.layers[0].self_attn
        self.head_dim = attn.head_dim
        self.half = self.head_dim // 2
        # transformers' SDPA path asks the kernel for grouped-query attention when there are groups (and no mask)
        self.gqa = self.heads != self.kv_heads
        self.groups = self.heads // self.kv_heads
        self.hidden = config.hidden_size
        self.qk_norms = hasattr(attn, "q_norm")  # Qwen3
        # per layer: its attention, its MLP, and their stacked quantized matrices where there are (swarm.stage.quantize)
        self._parts = [(layer, layer.self_attn, layer.mlp, getattr(layer.self_attn.q_proj, "fused", None),
                        getattr(layer.mlp.gate_proj, "fused", None)) for layer in self.layers]
        self._tables = stage.position_embeddings  # the stage's rotary (cos, sin) by layer type
        # int4-fast on CPU: the layers' C step for one new row of each request and for drafting's verifying passes
        # (swarm.stage.compiled_decode)
        self._steps = [layer.compiled_step for layer in self.layers] if compiled(self.layers) else None

    def takes(self, sizes: list[int], caches: list[DynamicCache], flags: list[bool] | None = None) -> bool:
        """Whether a pass of ``sizes`` rows per request, on these requests' caches, is one this step computes: one
        new row of each request, or one request's rows -- or, on the layers' C step, decode passes of several
        requests (``flags``: which requests' rows compute alone, swarm.stage.compiled_decode.alone)."""
        shaped = len(sizes) == 1 or all(n == 1 for n in sizes) or self._alone(sizes, flags)
        # a packed cache (swarm.stage.kv_cache) goes through the library's layers: this step writes tensors in place
        return shaped and all(len(cache.layers) == len(self.layers) and not is_packed(cache) for cache in caches)

    def _alone(self, sizes: list[int], flags: list[bool] | None) -> bool:
        return self._steps is not None and all(alone(sizes, flags))

    def forward(self, states: torch.Tensor, position_ids: torch.Tensor, caches: list[DynamicCache],
                sizes: list[int] | None = None, flags: list[bool] | None = None) -> torch.Tensor:
        """``states`` (1, n, hidden) at ``position_ids`` (1, n) after the stage's layers: one new row of each of n
        requests, ``caches`` theirs in the rows' order, each one row longer afterwards; or one request's n rows,
        ``caches`` its one cache, n rows longer afterwards; or ``sizes[i]`` rows of request i (``flags``: which
        requests' rows compute as decode steps of their own -- see :meth:`takes`)."""
        n = states.shape[1]
        sizes = sizes or ([1] * n if len(caches) == n else [n])
        if self._alone(sizes, flags):  # the layers' C step: single rows, or decode passes flagged to compute alone
            cos, sin = self._tables(states, position_ids)["full_attention"]
            assert self._steps is not None  # _alone() said so
            return run_steps(self._steps, states.reshape(n, -1), cos.reshape(n, -1), sin.reshape(n, -1),
                             caches, sizes).view(1, n, -1)
        mask = None
        if n > 1 and len(caches) == 1:  # one request's rows: causal among themselves, masked as the library masks them
            mask = create_causal_mask(config=self.config, inputs_embeds=states, attention_mask=None, cache=caches[0],
                                      position_ids=position_ids)
        cos, sin = self._tables(states, position_ids)["full_attention"]
        half = self.half
        cos = cos.unsqueeze(1)
        # rotate_half(x) * sin is x rolled by half a head times sin with its first half negated: (-a) * b == a * (-b)
        # exactly, so the rotation is transformers' to the bit, in four operations instead of seven.
        sin = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1).unsqueeze(1)
        heads, kv_heads, head_dim, hidden = self.heads, self.kv_heads, self.head_dim, self.hidden
        rms_norm, cat, roll = F.rms_norm, torch.cat, torch.roll
        x = states
        for index, (layer, attn, mlp, qkv_fused, mlp_fused) in enumerate(self._parts):
            norm = layer.input_layernorm
            h = rms_norm(x, (hidden,), norm.weight, norm.variance_epsilon)
            if qkv_fused is not None:  # q, k and v stacked in one matrix: one call, then views
                qkv = _rows(qkv_fused, h, n).view(1, n, heads + 2 * kv_heads, head_dim)
                if self.qk_norms:  # Qwen3: each head's query and key normalised before the rotation
                    qk = cat((_head_norm(attn.q_norm, qkv[:, :, :heads]),
                              _head_norm(attn.k_norm, qkv[:, :, heads : heads + kv_heads])), dim=2).transpose(1, 2)
                else:
                    qk = qkv[:, :, : heads + kv_heads].transpose(1, 2)
                v = qkv[:, :, heads + kv_heads :].transpose(1, 2)
                qk = qk * cos + roll(qk, half, -1) * sin
                q, k = qk[:, :heads], qk[:, heads:]
            else:
                q = _rows(attn.q_proj, h, n).view(1, n, heads, head_dim)
                k = _rows(attn.k_proj, h, n).view(1, n, kv_heads, head_dim)
                if self.qk_norms:
                    q, k = _head_norm(attn.q_norm, q), _head_norm(attn.k_norm, k)
                q, k = q.transpose(1, 2), k.transpose(1, 2)
                v = _rows(attn.v_proj, h, n).view(1, n, kv_heads, head_dim).transpose(1, 2)
                q = q * cos + roll(q, half, -1) * sin
                k = k * cos + roll(k, half, -1) * sin
            if len(caches) == 1:
                out = self._attend(attn, q, k, v, caches[0].layers[index], mask)
            else:  # each request's row attends to its own cache only
                out = cat([self._attend(attn, q[:, :, row : row + 1], k[:, :, row : row + 1], v[:, :, row : row + 1],
                                        cache.layers[index]) for row, cache in enumerate(caches)], dim=2)
            x = x + _rows(attn.o_proj, out.transpose(1, 2).reshape(1, n, -1), n)
            norm = layer.post_attention_layernorm
            h = rms_norm(x, (hidden,), norm.weight, norm.variance_epsilon)
            if mlp_fused is not None:
                gate, up = _rows(mlp_fused, h, n).split(mlp.gate_proj.sizes, dim=-1)
            else:
                gate, up = _rows(mlp.gate_proj, h, n), _rows(mlp.up_proj, h, n)
            x = x + _rows(mlp.down_proj, mlp.act_fn(gate) * up, n)
        return x

    def _attend(self, attn: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cached: Any,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        """One request's new rows (q, k, v) against its cached layer, appended to it first: SDPA called as
        transformers' SDPA path calls it for these shapes."""
        keys, values = append(cached, k, v)  # the cache's update, written in place (swarm.stage.compiled_decode)
        rows = q.shape[2]
        if rows > 1:
            if mask is not None:  # the library repeats keys and values per group where there is a mask
                if self.gqa:
                    keys, values = repeat_kv(keys, self.groups), repeat_kv(values, self.groups)
                return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, dropout_p=0.0,
                                                      scale=attn.scaling, is_causal=False)
            if keys.shape[2] > rows:  # as the library does (only a static cache gets here)
                keys, values = keys[:, :, :rows], values[:, :, :rows]
            if self.gqa:  # a prompt's first rows: causal by position, no mask
                return F.scaled_dot_product_attention(q, keys, values, attn_mask=None, dropout_p=0.0,
                                                      scale=attn.scaling, is_causal=True, enable_gqa=True)
            return F.scaled_dot_product_attention(q, keys, values, attn_mask=None, dropout_p=0.0, scale=attn.scaling,
                                                  is_causal=True)
        if self.gqa:
            return F.scaled_dot_product_attention(q, keys, values, attn_mask=None, dropout_p=0.0, scale=attn.scaling,
                                                  is_causal=False, enable_gqa=True)
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=None, dropout_p=0.0, scale=attn.scaling,
                                              is_causal=False)


def _head_norm(norm: Any, x: torch.Tensor) -> torch.Tensor:
    """Qwen3's RMSNorm over each head's features."""
    return F.rms_norm(x, (x.shape[-1],), norm.weight, norm.variance_epsilon)


def _rows(module: Any, x: torch.Tensor, n: int) -> torch.Tensor:
    """``module`` over ``x`` (1, n, features): a quantized CPU layer (swarm.stage.quantize) takes the rows as a
    matrix, without its forward's reshapes; any other module is called."""
    rows = getattr(module, "rows", None)
    return module(x) if rows is None else rows(x.view(n, -1)).view(1, n, -1)


def shaped_for(stage: Any) -> bool:
    """Whether ``stage``'s layers have the shape :class:`LeanDecode` computes (checked at warm-up to the bit)."""
    config = stage.config
    if config.model_type not in LEAN_DECODE_FAMILIES or stage.rotary_per_type:
        return False
    if set(stage.mask_types) != {"full_attention"}:  # a sliding window needs a mask even for one row
        return False
    if any(device != stage.device for device in stage.layer_devices) or not len(stage.layers):
        return False
    attn = stage.layers[0].self_attn
    return attn.head_dim <= 256 and attn.head_dim % 2 == 0


def verified(stage: Any) -> LeanDecode | None:
    """A LeanDecode for ``stage`` when its layers have the shape and its steps equal, bit for bit, the library's on the
    same random rows -- outputs and cached keys and values: three requests' prompts, one request's two decode steps
    and a pass of 4 rows (drafting's verifying pass), then one step of the three requests batched; else None."""
    from swarm.stage.ragged import ragged_layers

    if not shaped_for(stage):
        return None
    lean = LeanDecode(stage)
    generator = torch.Generator(device="cpu").manual_seed(0)
    device = stage.device

    def rows(n: int) -> torch.Tensor:
        return torch.randn((1, n, stage.config.hidden_size), generator=generator).to(device=device, dtype=stage.dtype)

    def positions(*at: int) -> torch.Tensor:
        return torch.tensor([at], device=device)

    with torch.inference_mode():
        library = [DynamicCache(config=stage.config) for _ in range(3)]
        ours = [DynamicCache(config=stage.config) for _ in range(3)]
        # (request, rows, first position): three prompts, then request 0's two decode steps and a verifying pass of 4
        for request, n, position in ((0, 8, 0), (1, 3, 0), (2, 5, 0), (0, 1, 8), (0, 1, 9), (0, 4, 10)):
            x = rows(n)
            expected = stage.run_layers(x, position, library[request])
            at = torch.arange(position, position + n, device=device).unsqueeze(0)
            got = lean.forward(x, at, [ours[request]])
            if not _same(stage, expected, got, library[request : request + 1], ours[request : request + 1]):
                return None
        x = rows(3)  # three requests batched, a row each
        at = positions(14, 3, 5)
        if not _same(stage, ragged_layers(stage, x, at, library, [1, 1, 1]), lean.forward(x, at, ours),
                     library, ours):
            return None
    return lean


def _same(stage: Any, expected: torch.Tensor, got: torch.Tensor, library: list, ours: list) -> bool:
    same = torch.equal(expected, got) and all(
        torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
        for cache, mine in zip(library, ours) for a, b in zip(cache.layers, mine.layers))
    if not same:
        log.info("stage %s keeps the library's decode step: the lean one differs from it (max %.3g)",
                 stage.spec, (expected.float() - got.float()).abs().max().item())
    return same
