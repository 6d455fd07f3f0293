"""One pipeline stage: a contiguous slice of a model's decoder layers, its KV caches, and one forward pass.

The slice is built from transformers' own decoder-layer classes (swarm.stage.slice_load), so every layer computes
what the library's model computes.
"""

from __future__ import annotations

import copy
import inspect
import json
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from transformers.cache_utils import DynamicCache
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

from swarm.errors import ModelError
from swarm.model_format import CONFIG_FILE
from swarm.stage.kv_cache import new_cache
from swarm.stage.slice_load import StageSpec, load_stage

if TYPE_CHECKING:
    from swarm.stage.draft_model import DraftModel
    from swarm.stage.lean_decode import LeanDecode

_MASK_FUNCTIONS = {
    "full_attention": create_causal_mask,
    "sliding_attention": create_sliding_window_causal_mask,
}


def layer_mask_types(config: Any) -> list[str]:
    """Which mask each (stage-local) layer takes, following the families' own forward()."""
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return list(layer_types)
    # Mistral: one kind for every layer, sliding when the config has a window.
    kind = "sliding_attention" if getattr(config, "sliding_window", None) is not None else "full_attention"
    return [kind] * config.num_hidden_layers


class StageModel:
    """The modules of one stage and the KV caches of the requests passing through it."""

    def __init__(
        self,
        config: Any,
        spec: StageSpec,
        embed: nn.Embedding | None,
        layers: nn.ModuleList,
        norm: nn.Module | None,
        lm_head: nn.Linear | None,
        rotary: nn.Module,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.config = config  # the stage's slice of the config (num_hidden_layers == spec.num_layers)
        self.spec = spec
        self.embed = embed
        self.layers = layers
        self.norm = norm
        self.lm_head = lm_head
        self.rotary = rotary
        self.dtype = dtype
        self.device = device
        self.mask_types = layer_mask_types(config)
        # Gemma 3: local and global layers rotate with different bases, one rotary table per layer type.
        self.rotary_per_type = "layer_type" in inspect.signature(type(rotary).forward).parameters
        self._softcap = getattr(config, "final_logit_softcapping", None)
        self._caches: dict[str, DynamicCache] = {}
        self.quantization = "none"  # set by load (swarm.stage.quantize.KINDS)
        self.kv_cache = "auto"  # how requests' caches hold keys and values (swarm.kv_kinds), set by the fellow's loader
        self.layer_devices = [device] * len(layers)  # set by load when the layers spread over several cards
        # The lean decode step (swarm.stage.lean_decode): set by warm_up once it computes exactly the library's step.
        self.lean: LeanDecode | None = None
        self.drafter: DraftModel | None = None  # the last stage's draft model, when it has one
        # the model's tokenizer files, set by the fellow's loader (swarm.stage.grammar reads them); None: not sent
        self.tokenizer_dir: Path | None = None

    # --- building ----------------------------------------------------------------------------------------------------

    @classmethod
    def load(
        cls,
        config: Mapping[str, Any],
        files: Mapping[str, Path],
        spec: StageSpec,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        layer_devices: list[str] | None = None,
        quantization: str = "none",
    ) -> StageModel:
        """Build the stage from config.json's contents and its weight files (swarm.stage.slice_load.load_stage)."""
        return load_stage(cls, config, files, spec, dtype, device, layer_devices, quantization)

    @classmethod
    def load_dir(
        cls,
        model_dir: Path,
        spec: StageSpec,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        quantization: str = "none",
    ) -> StageModel:
        """Build the stage from an imported model's folder (files named as the import writes them)."""
        model_dir = Path(model_dir)
        try:
            config = json.loads((model_dir / CONFIG_FILE).read_text())
        except FileNotFoundError:
            raise ModelError(f"{model_dir} has no {CONFIG_FILE}; is it an imported model folder?") from None
        tied = bool(config.get("tie_word_embeddings", False))
        files = {rel: model_dir / rel for rel in spec.files(tied)}
        return cls.load(config, files, spec, dtype=dtype, device=device, quantization=quantization)

    def narrow(self, first_layer: int, end_layer: int, is_first: bool, is_last: bool) -> int:
        """Keep only layers ``first_layer``..``end_layer - 1`` of those held, freeing the rest (a re-layout's switch,
        swarm.stage.narrow); the bytes freed. ModelError when that needs anything this stage does not hold."""
        from swarm.stage.narrow import narrow

        return narrow(self, first_layer, end_layer, is_first, is_last)

    def modules(self) -> list[nn.Module]:
        return [m for m in (self.embed, self.layers, self.norm, self.lm_head, self.rotary) if m is not None]

    def named_parameters(self) -> list[tuple[str, torch.Tensor]]:
        """Parameters by stage-relative name: "embed.weight", "layers.0.self_attn.q_proj.weight", "norm.weight", ..."""
        out: list[tuple[str, torch.Tensor]] = []
        parts = (("embed", self.embed), ("layers", self.layers), ("norm", self.norm), ("lm_head", self.lm_head))
        for prefix, module in parts:
            if module is not None:
                out += [(f"{prefix}.{n}", p) for n, p in module.named_parameters(remove_duplicate=False)]
        return out

    def parameter_bytes(self) -> int:
        """Bytes of the stage's weights as held: parameters, and the buffers quantized layers keep their weights in."""
        seen: set[int] = set()
        total = 0
        held = [p for _, p in self.named_parameters()]
        # at gguf the embedding may look its rows up in the tied head's bytes (gguf_linear.GGUFEmbedding.share)
        shared = getattr(self.embed, "head", None)
        held += [b for m in (self.embed, self.layers, self.norm, self.lm_head, shared) if m is not None
                 for b in m.buffers()]
        for p in held:
            if p.data_ptr() not in seen:
                seen.add(p.data_ptr())
                total += p.numel() * p.element_size()
        return total

    # --- requests ----------------------------------------------------------------------------------------------------

    def new_request(self, rid: str) -> None:
        """Start an empty KV cache for request ``rid`` (a replayed request starts over: any old cache is replaced)."""
        self._caches[rid] = new_cache(self.config, self.kv_cache, self.dtype)

    def drop(self, rid: str) -> None:
        self._caches.pop(rid, None)
        if self.drafter is not None:
            self.drafter.drop(rid)

    def fan_out(self, rid: str, to: list[str]) -> None:
        """Hand request ``rid``'s cache to the requests ``to`` (a group's prompt, prefilled once): a copy each, the
        last one takes the cache itself; ``rid`` has none afterwards. The copy is transformers' own way to reuse a
        prompt's cache (deepcopy of the cache object: every layer's keys and values, on their device)."""
        cache = self._caches.pop(rid, None)
        if cache is None:
            raise ModelError(f"request {rid!r} has no cache on this stage to share (it was dropped or never started)")
        for other in to[:-1]:
            self._caches[other] = copy.deepcopy(cache)
        if to:
            self._caches[to[-1]] = cache

    def has_request(self, rid: str) -> bool:
        return rid in self._caches

    def requests(self) -> list[str]:
        return list(self._caches)

    def cached_length(self, rid: str) -> int:
        return self.request_cache(rid).get_seq_length()

    def rollback(self, rid: str, length: int) -> None:
        """Forget every cached token from position ``length`` on (rejected speculative tokens, a retried chunk)."""
        cache = self.request_cache(rid)
        current = cache.get_seq_length()
        if not 0 <= length <= current:
            raise ModelError(f"cannot roll request {rid!r} back to {length} tokens: it has {current}")
        if length == current:
            return
        if length == 0:
            self._caches[rid] = new_cache(self.config, self.kv_cache, self.dtype)
            return
        # A sliding-window layer keeps only its last window-1 tokens: once full, it cannot give back older ones.
        # Checked before cropping so a refused rollback leaves the cache as it was.
        for layer in cache.layers:
            window = getattr(layer, "sliding_window", None)
            if getattr(layer, "is_sliding", False) and window is not None and current >= window:
                raise ModelError(
                    f"cannot roll request {rid!r} back to {length} tokens: its sliding-window layers keep only the "
                    f"last {window - 1} of {current} tokens; restart the request instead"
                )
        cache.crop(length - current)  # v5: a negative count of tokens to remove

    def request_cache(self, rid: str) -> DynamicCache:
        """The KV cache of request ``rid``; ModelError if this stage holds none for it."""
        try:
            return self._caches[rid]
        except KeyError:
            raise ModelError(f"request {rid!r} has no cache on this stage (it was dropped or never started)") from None

    # --- compute -----------------------------------------------------------------------------------------------------

    def forward(
        self,
        rid: str,
        position: int,
        input_ids: torch.Tensor | None = None,
        hidden: torch.Tensor | None = None,
        want_logits: bool = True,
        all_logits: bool = False,
        final_states: bool = False,
        alone: bool = False,
    ) -> torch.Tensor | None:
        """Run one chunk of a request through this stage's layers, starting at token ``position``.

        First stage: ``input_ids`` (1, n). Other stages: ``hidden`` (1, n, hidden_size) from the stage before.
        Returns hidden states (1, n, hidden_size), or on the last stage the float32 logits (vocab,) of the chunk's
        last position -- None when ``want_logits`` is False (a prefill chunk that is not the prompt's last); with
        ``all_logits``, those of every position (n, vocab) (a request that asked for its prompt's logprobs); with
        ``final_states``, the hidden states before the head (drafting ahead applies :meth:`logits` a few rows at a
        time). ``alone``: a decode pass (drafting's verifying pass), whose rows compute what each would as a decode step
        of its own where the layers can (swarm.stage.compiled_decode.alone).
        """
        cache = self.request_cache(rid)
        cached = cache.get_seq_length()
        if position != cached:
            raise ModelError(f"request {rid!r}: chunk starts at {position} but this stage holds {cached} tokens")
        with torch.inference_mode():
            if self.spec.is_first:
                if input_ids is None:
                    raise ModelError("the first stage takes token ids")
                assert self.embed is not None  # a first stage's
                states = self.embed(input_ids.to(self.device))
            else:
                if hidden is None:
                    raise ModelError("a stage after the first takes hidden states")
                states = hidden.to(device=self.device, dtype=self.dtype)
            sizes, flags = [states.shape[1]], [alone]
            if self.lean is not None and self.lean.takes(sizes, [cache], flags):  # swarm.stage.lean_decode
                at = torch.arange(position, position + states.shape[1], device=self.device).unsqueeze(0)
                states = self.lean.forward(states, at, [cache], sizes, flags)
            else:
                states = self.run_layers(states, position, cache)
            if not self.spec.is_last or final_states:
                return states
            if not want_logits:
                return None
            if all_logits:
                return self.logits(states)[0].float()
            # The norm is per position, so normalising the last one alone equals the library's full-sequence norm.
            return self.logits(states[:, -1:, :])[0, -1].float()

    def run_layers(self, states: torch.Tensor, position: int, cache: DynamicCache) -> torch.Tensor:
        """The library's layers over ``states`` (1, n, hidden) at positions ``position``..: hidden states out, the
        cache n rows longer."""
        n = states.shape[1]
        position_ids = torch.arange(position, position + n, device=self.device).unsqueeze(0)
        mask_args = dict(
            config=self.config, inputs_embeds=states, attention_mask=None, cache=cache, position_ids=position_ids
        )
        masks = {kind: _MASK_FUNCTIONS[kind](**mask_args) for kind in set(self.mask_types)}
        on = _OnDevices(self.position_embeddings(states, position_ids), masks)
        for layer, kind, device in zip(self.layers, self.mask_types, self.layer_devices):
            states = states.to(device)  # a no-op unless the layers spread over several cards
            pe, layer_masks = on.device(device)
            states = layer(
                states,
                attention_mask=layer_masks[kind],
                position_ids=position_ids,
                cache=cache,
                use_cache=True,
                position_embeddings=pe[kind],
            )
        return states

    def position_embeddings(self, states: torch.Tensor, position_ids: torch.Tensor) -> dict[str, tuple]:
        """Each layer type's rotary (cos, sin) at ``position_ids``: one table for all but Gemma 3's."""
        if self.rotary_per_type:
            return {kind: self.rotary(states, position_ids, kind) for kind in set(self.mask_types)}
        shared = self.rotary(states, position_ids)
        return dict.fromkeys(set(self.mask_types), shared)

    def logits(self, states: torch.Tensor) -> torch.Tensor:
        """The head over final hidden states: norm, lm_head, and the family's logit soft-capping (Gemma) as its
        ForCausalLM applies it."""
        assert self.lm_head is not None and self.norm is not None  # a last stage's
        logits = self.lm_head(self.norm(states))
        if self._softcap is not None:
            logits = torch.tanh(logits / self._softcap) * self._softcap
        return logits

    def warm_up(self) -> None:
        """Dummy passes of the shapes serving uses -- a prompt chunk, then a decode step -- so the first real request
        does not pay for kernel selection and the allocator's set-up; first, the lean decode step is checked against
        the library's layers and taken where it computes exactly what they compute (swarm.stage.lean_decode)."""
        from swarm.stage.lean_decode import verified

        self.lean = verified(self)
        rid = "__warm_up__"
        self.drop(rid)
        self.new_request(rid)
        try:
            for position, n in ((0, 8), (8, 1)):
                if self.spec.is_first:
                    self.forward(rid, position, input_ids=torch.zeros((1, n), dtype=torch.long))
                else:
                    hidden = torch.zeros((1, n, self.config.hidden_size), dtype=self.dtype, device=self.device)
                    self.forward(rid, position, hidden=hidden)
        finally:
            self.drop(rid)


class _OnDevices:
    """Position embeddings (by layer type) and masks, copied once to each card the layers are on."""

    def __init__(self, position_embeddings: dict, masks: dict):
        device = next(iter(position_embeddings.values()))[0].device
        self._copies = {device: (position_embeddings, masks)}

    def device(self, device: torch.device):
        if device not in self._copies:
            pe, masks = next(iter(self._copies.values()))
            self._copies[device] = ({k: tuple(t.to(device) for t in v) for k, v in pe.items()},
                                    {k: (m.to(device) if isinstance(m, torch.Tensor) else m) for k, m in masks.items()})
        return self._copies[device]
