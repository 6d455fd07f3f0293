"""Several requests in one forward pass: their rows side by side in one sequence, each row attending only to its
own request's KV cache.

The decoder layers are transformers' own. Everything in a layer but attention works row by row (norms, projections,
rotary embeddings at each row's position, the MLP), so the rows of several requests go through it as one sequence
and every weight matrix is read once for all of them -- which is what makes a batch cheaper than its requests one
by one. Attention is where requests must not mix: the layer hands the new keys and values to its cache, and the
cache given here (:class:`RaggedCache`) splits them by request, appends each part to that request's own
DynamicCache, and hands back every request's full keys and values; the attention function registered here
(:func:`ragged_attention`) then attends each request's rows to its own keys only -- causally, and within the
sliding window on the layers that have one -- through transformers' own SDPA attention, or, for a family whose
stages attend eagerly (gpt-oss's attention sinks: swarm.stage.architectures), through the family's own eager
attention function (:data:`EAGER_ATTENTION`), the mask then added as transformers' eager masks are.
"""

from __future__ import annotations

import inspect

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
from transformers.modeling_utils import AttentionInterface

ATTENTION = "swarm_ragged"
EAGER_ATTENTION = "swarm_ragged_eager"


class RaggedKV:
    """The full keys (or values) of each request in a batch, in the batch's order, and how many of the batch's rows
    are each request's."""

    def __init__(self, parts: list[torch.Tensor], sizes: list[int]):
        self.parts = parts
        self.sizes = sizes


class RaggedCache:
    """The cache a batched pass gives the decoder layers: one DynamicCache per request, rows split by ``sizes``."""

    def __init__(self, caches: list, sizes: list[int], alone: list[bool] | None = None):
        self.caches = caches
        self.sizes = sizes
        # which requests' rows are decode steps to compute row by row where the layers can (swarm.stage.compiled_decode)
        self.alone = alone

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        keys = key_states.split(self.sizes, dim=-2)
        values = value_states.split(self.sizes, dim=-2)
        full = [cache.update(k, v, layer_idx) for cache, k, v in zip(self.caches, keys, values)]
        return RaggedKV([k for k, _ in full], self.sizes), RaggedKV([v for _, v in full], self.sizes)


def ragged_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                     sliding_window: int | None = None, **kwargs):
    """Attention for a batched pass: each request's rows of ``query`` against that request's keys and values."""
    if not isinstance(key, RaggedKV):  # an ordinary pass
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      sliding_window=sliding_window, **kwargs)
    outputs = []
    row = 0
    for k, v, n in zip(key.parts, value.parts, key.sizes):
        q = query[:, :, row : row + n]
        mask = _mask(n, k.shape[-2], sliding_window, q.device)
        out, _ = sdpa_attention_forward(module, q, k, v, mask, dropout=dropout, scaling=scaling, is_causal=False)
        outputs.append(out)
        row += n
    return torch.cat(outputs, dim=1), None


def _mask(n: int, keys: int, window: int | None, device) -> torch.Tensor | None:
    """Which of a request's ``keys`` (the last of them are its ``n`` new rows) each new row may attend to."""
    if n == 1 and (window is None or keys <= window):
        return None  # one new row sees everything cached: no mask needed
    query_pos = torch.arange(keys - n, keys, device=device).unsqueeze(1)
    key_pos = torch.arange(keys, device=device).unsqueeze(0)
    allowed = key_pos <= query_pos
    if window is not None:
        allowed &= key_pos > query_pos - window
    return allowed[None, None]


def ragged_eager_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                           sliding_window: int | None = None, **kwargs):
    """As :func:`ragged_attention`, through the eager attention function of the module's own family (gpt-oss's adds
    its sinks); a mask is additive there, as the library's eager masks are (0 where allowed, the dtype's minimum
    where not)."""
    eager = inspect.getmodule(type(module)).eager_attention_forward  # type: ignore[union-attr]
    if not isinstance(key, RaggedKV):  # an ordinary pass: the mask is the library's own
        return eager(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                     sliding_window=sliding_window, **kwargs)
    outputs = []
    row = 0
    for k, v, n in zip(key.parts, value.parts, key.sizes):
        q = query[:, :, row : row + n]
        allowed = _mask(n, k.shape[-2], sliding_window, q.device)
        mask = None
        if allowed is not None:
            mask = torch.zeros(allowed.shape, dtype=q.dtype, device=q.device)
            mask.masked_fill_(~allowed, torch.finfo(q.dtype).min)
        out, _ = eager(module, q, k, v, mask, dropout=dropout, scaling=scaling, **kwargs)
        outputs.append(out)
        row += n
    return torch.cat(outputs, dim=1), None


AttentionInterface.register(ATTENTION, ragged_attention)
AttentionMaskInterface.register(ATTENTION, sdpa_mask)
AttentionInterface.register(EAGER_ATTENTION, ragged_eager_attention)


def forward_batch(stage, items: list[tuple[str, int, torch.Tensor, bool]], alone: list[bool] | None = None):
    """Run several requests' chunks through ``stage`` (a StageModel) in one pass.

    ``items``: (request id, start position, input -- token ids (1, n) on the first stage, hidden states (1, n, h)
    after it --, want_logits); ``alone``: which of them are decode passes, whose rows compute as decode steps of their
    own where the layers can (swarm.stage.compiled_decode.alone). Returns the hidden states of every row, in order
    (1, sum of n, h); on the last stage a list with each item's float32 logits (vocab,) of its last row, or None where
    it wants none.
    """
    from swarm.errors import ModelError

    caches = []
    for rid, position, _, _ in items:
        cache = stage.request_cache(rid)
        if cache.get_seq_length() != position:
            raise ModelError(f"request {rid!r}: chunk starts at {position} but this stage holds "
                             f"{cache.get_seq_length()} tokens")
        caches.append(cache)
    sizes = [x.shape[1] for _, _, x, _ in items]
    device = stage.device
    with torch.inference_mode():
        if stage.spec.is_first:
            states = stage.embed(torch.cat([x for _, _, x, _ in items], dim=1).to(device))
        else:
            states = torch.cat([x.to(device=device, dtype=stage.dtype) for _, _, x, _ in items], dim=1)
        position_ids = torch.cat([torch.arange(p, p + n, device=device) for (_, p, _, _), n in zip(items, sizes)])
        position_ids = position_ids.unsqueeze(0)
        lean = stage.lean
        if lean is not None and lean.takes(sizes, caches, alone):  # swarm.stage.lean_decode
            states = lean.forward(states, position_ids, caches, sizes, alone)
        else:
            states = ragged_layers(stage, states, position_ids, caches, sizes, alone)
        if not stage.spec.is_last:
            return states
        ends = torch.tensor(sizes, device=states.device).cumsum(0) - 1
        wanted = [i for i, (_, _, _, want) in enumerate(items) if want]
        out: list[torch.Tensor | None] = [None] * len(items)
        if wanted:
            logits = stage.logits(states[:, ends[wanted], :])[0].float()
            for row, i in enumerate(wanted):
                out[i] = logits[row]
        return out


def ragged_layers(stage, states: torch.Tensor, position_ids: torch.Tensor, caches: list, sizes: list[int],
                  alone: list[bool] | None = None):
    """The library's layers of ``stage`` over the rows of several requests (``sizes`` rows each, in order, at
    ``position_ids``), each request's rows attending to its own cache in ``caches`` (``alone``: see forward_batch)."""
    position_embeddings = stage.position_embeddings(states, position_ids)  # by layer type
    cache = RaggedCache(caches, sizes, alone)
    before = stage.config._attn_implementation
    stage.config._attn_implementation = ATTENTION if before == "sdpa" else EAGER_ATTENTION
    copies = {states.device: position_embeddings}
    try:
        for layer, kind, layer_device in zip(stage.layers, stage.mask_types, stage.layer_devices):
            states = states.to(layer_device)  # a no-op unless the layers spread over several cards
            pe = copies.setdefault(layer_device, {k: tuple(t.to(layer_device) for t in v)
                                                  for k, v in position_embeddings.items()})
            states = layer(states, attention_mask=None, position_ids=position_ids, cache=cache, use_cache=True,
                           position_embeddings=pe[kind])
    finally:
        stage.config._attn_implementation = before
    return states


def forward_one(stage, work, **options):
    """One request's work through ``stage`` alone (``stage.forward``): its token ids on the first stage, else its rows
    of the hidden state received; ``options`` as ``StageModel.forward`` takes them (``all_logits``,
    ``final_states``)."""
    if work.ids is not None:
        return stage.forward(work.rid, work.pos, input_ids=torch.tensor([work.ids], dtype=torch.long), **options)
    rows = work.rows
    return stage.forward(work.rid, work.pos, hidden=rows.source.tensor()[:, rows.row : rows.row + rows.n], **options)
