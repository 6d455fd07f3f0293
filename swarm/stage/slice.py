"""One pipeline stage: a contiguous slice of a model's decoder layers, its KV caches, and one forward pass.

The slice is built from transformers' own decoder-layer classes, so every layer computes what the library's model
computes. Modules are created on the meta device and materialised with this stage's weights only; the other layers
are never allocated.

The slice's layers are numbered 0..n-1 inside the stage (the config given to them says n layers, with
``layer_types`` sliced to match), so a plain per-request DynamicCache built from that config indexes them, and
sliding-window layers (Qwen2/Mistral) get sliding cache layers.
"""

from __future__ import annotations

import copy
import functools
import inspect
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from transformers.cache_utils import DynamicCache
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

from swarm.errors import ModelError
from swarm.model_format import CONFIG_FILE, EMBED_FILE, FINAL_FILE, layer_file, split_layers, stage_file_paths
from swarm.stage.architectures import blocks_for, check_sliceable, config_from_dict
from swarm.stage.compiled_decode import install as install_compiled_step
from swarm.stage.devices import return_freed_memory
from swarm.stage.gguf_linear import GGUFBlocks, GGUFEmbedding, gguf_linear, is_linear_weight, place_linears
from swarm.stage.kv_cache import new_cache
from swarm.stage.moe_experts import ROUTED as ROUTED_EXPERTS
from swarm.stage.moe_experts import register as register_routed_experts
from swarm.stage.quantize import quantize_head, quantize_linears
from swarm.stage.weights import read_weights, read_weights_and_blocks

if TYPE_CHECKING:
    from swarm.stage.draft_model import DraftModel
    from swarm.stage.lean_decode import LeanDecode

_MASK_FUNCTIONS = {
    "full_attention": create_causal_mask,
    "sliding_attention": create_sliding_window_causal_mask,
}


@dataclass(frozen=True)
class StageSpec:
    first_layer: int
    end_layer: int  # exclusive
    is_first: bool
    is_last: bool

    @property
    def num_layers(self) -> int:
        return self.end_layer - self.first_layer

    def files(self, tie_word_embeddings: bool) -> list[str]:
        """The model files (relative paths) this stage reads."""
        return stage_file_paths(self.first_layer, self.end_layer, self.is_first, self.is_last, tie_word_embeddings)


def stage_specs(num_layers: int, stages: int) -> list[StageSpec]:
    """An even contiguous split of ``num_layers`` layers over ``stages`` stages."""
    slices = split_layers(num_layers, [1.0] * stages)
    return [StageSpec(first, end, i == 0, i == stages - 1) for i, (first, end) in enumerate(slices)]


def _slice_config(config: Any, spec: StageSpec) -> Any:
    """The model's config, saying this stage's layer count, with per-layer settings sliced to match."""
    sliced = copy.deepcopy(config)
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        sliced.layer_types = list(layer_types[spec.first_layer : spec.end_layer])
    dense = getattr(config, "first_k_dense_replace", None)
    if dense is not None:  # GLM-4.5: the model's first k layers have a dense MLP; counted from this stage's first
        sliced.first_k_dense_replace = max(int(dense) - spec.first_layer, 0)
    sliced.num_hidden_layers = spec.num_layers
    return sliced


def _layer_mask_types(config: Any) -> list[str]:
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
        self.mask_types = _layer_mask_types(config)
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
        """Build the stage from config.json's contents and its weight files.

        ``files`` maps each relative model path this stage needs (see StageSpec.files) to a local file -- which may be
        a cache entry named by its hash. ``layer_devices`` spreads the layers over several cards of one PC
        (swarm.stage.devices); by default every layer is on ``device``. ``quantization`` (swarm.stage.quantize.KINDS)
        quantizes each layer's linear layers right after its weights are read, and the head after it.
        """
        wanted: list[str | torch.device] = list(layer_devices) if layer_devices else [device] * spec.num_layers
        devices = [torch.device(d) for d in wanted]
        if len(devices) != spec.num_layers:
            raise ModelError(f"{len(devices)} devices given for a stage of {spec.num_layers} layers")
        device = devices[0]
        full_config = config_from_dict(dict(config))
        total = full_config.num_hidden_layers
        if not 0 <= spec.first_layer < spec.end_layer <= total:
            raise ModelError(
                f"a stage of layers {spec.first_layer}..{spec.end_layer - 1} does not fit a model of {total} layers"
            )
        tied = bool(getattr(full_config, "tie_word_embeddings", False))
        missing = [p for p in spec.files(tied) if p != CONFIG_FILE and p not in files]
        if missing:
            raise ModelError(f"the stage lacks model files: {', '.join(missing)}; fetch them before loading")

        blocks = blocks_for(full_config.model_type)
        check_sliceable(full_config)
        stage_config = _slice_config(full_config, spec)
        # sdpa is what from_pretrained picks on CPU and GPU (eager for a family that cannot take it: gpt-oss's sinks);
        # the masks below follow this setting.
        stage_config._attn_implementation = blocks.attention
        # MoE layers: only the experts the router hit, each once for its rows, as views (swarm.stage.moe_experts)
        register_routed_experts()
        stage_config._experts_implementation = ROUTED_EXPERTS

        keep_float32 = blocks.keep_float32(dtype)  # GLM's router in float32, as from_pretrained keeps it

        def read(rel: str, on: torch.device = device) -> dict[str, torch.Tensor]:
            # a GGUF's blocks are dequantized here, one tensor at a time (swarm.stage.weights)
            return read_weights(files[rel], config, dtype, on, what=f"{rel} from {files[rel]}",
                                keep_float32=keep_float32)

        with torch.device("meta"):
            layers = nn.ModuleList(blocks.decoder_layer(stage_config, i) for i in range(spec.num_layers))
        for local, index in enumerate(range(spec.first_layer, spec.end_layer)):
            if quantization == "gguf":  # the linear layers on the file's blocks (swarm.stage.gguf_linear)
                rel = layer_file(index)
                layer = layers[local]
                tensors, kept = read_weights_and_blocks(
                    files[rel], config, functools.partial(is_linear_weight, layer), dtype, devices[local],
                    what=f"{rel} from {files[rel]}", keep_float32=keep_float32)
                place_linears(layer, kept, tensors, devices[local], dtype or torch.float32)
                _assign(layer, tensors, f"layer {index}", partial=True)
                continue
            _assign(layers[local], read(layer_file(index), devices[local]), f"layer {index}")
            quantize_linears(layers[local], quantization)

        # int4-fast on CPU: single-row passes through the C step (swarm.stage.compiled_decode) where it takes them
        install_compiled_step(layers, stage_config)
        def read_blocks(rel: str, key: str, on: torch.device) -> tuple[dict[str, torch.Tensor], GGUFBlocks | None]:
            # at gguf on CPU: the embedding and an untied head as their blocks (swarm.stage.gguf_linear)
            tensors, kept = read_weights_and_blocks(files[rel], config, lambda k: k == key, dtype, on,
                                                    what=f"{rel} from {files[rel]}")
            return tensors, kept.get(key)

        embed, norm, lm_head = _ends(full_config, spec, blocks, tied, read, devices[0], devices[-1],
                                     read_blocks if quantization == "gguf" else None)
        if lm_head is not None:
            lm_head = quantize_head(lm_head, quantization)
        with device:
            rotary = blocks.rotary_embedding(config=stage_config)
        stage = cls(stage_config, spec, embed, layers, norm, lm_head, rotary, dtype, device)
        stage.layer_devices = devices
        stage.quantization = quantization
        for module in stage.modules():
            module.eval()
        return_freed_memory()
        return stage

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
        held += [b for m in (self.embed, self.layers, self.norm, self.lm_head) if m is not None for b in m.buffers()]
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


def _ends(config: Any, spec: StageSpec, blocks, tied: bool, read, first: torch.device, last: torch.device,
          read_blocks=None) -> tuple:
    """The embedding (first stage, with the first layer) and the final norm and head (last stage, with the last
    layer), or None where this stage has none. ``read_blocks`` (the gguf kind): the embedding and the head -- tied or
    not -- are kept as the file's blocks where they are quantized and on CPU (the head a gguf_linear on them)."""
    embed: nn.Module | None = None
    norm: nn.Module | None = None
    lm_head: nn.Module | None = None
    embed_weight: torch.Tensor | None = None
    tied_blocks: GGUFBlocks | None = None
    if read_blocks is not None and (spec.is_first or (spec.is_last and tied)) \
            and (first if spec.is_first else last).type == "cpu" and last.type == "cpu":
        tensors, tied_blocks = read_blocks(EMBED_FILE, "embed_tokens.weight", first if spec.is_first else last)
        if tied_blocks is None:
            embed_weight = tensors["embed_tokens.weight"]
        elif spec.is_first:
            embed = GGUFEmbedding(tied_blocks, config.pad_token_id, _embed_scale(blocks, config))
        if not tied:
            tied_blocks = None
    elif spec.is_first or (spec.is_last and tied):
        embed_weight = read(EMBED_FILE, first if spec.is_first else last)["embed_tokens.weight"]
    if spec.is_first and embed is None:
        with torch.device("meta"):
            if blocks.embedding is not None:
                embed = blocks.embedding(config)
            else:
                embed = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        assert embed_weight is not None  # read above for a first stage
        _assign(embed, {"weight": embed_weight}, "embedding")
        _materialise_buffers(embed, first)
    if spec.is_last:
        head_blocks = tied_blocks
        if read_blocks is not None and not tied and last.type == "cpu":
            final, head_blocks = read_blocks(FINAL_FILE, "lm_head.weight", last)
        else:
            final = read(FINAL_FILE, last)
        with torch.device("meta"):
            norm = blocks.norm(config.hidden_size, eps=config.rms_norm_eps)
            lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        _assign(norm, {"weight": final["norm.weight"]}, "final norm")
        if head_blocks is not None:  # the gguf kind: the head on the file's blocks
            head = gguf_linear(head_blocks.blocks, head_blocks.ggml_type, head_blocks.shape, None, last)
            if tied and isinstance(embed, GGUFEmbedding):
                embed.share(head)  # one copy of the tied matrix: the embedding looks rows up in the head's bytes
            return embed, norm, head
        if tied:  # the head is the embedding matrix: share the stage's one copy (on the last card when it differs)
            head_weight: Any = embed.weight if embed is not None else embed_weight
            assert head_weight is not None  # the embedding was read above for a tied last stage
            head_weight = head_weight if head_weight.device == last else head_weight.to(last)
        else:
            head_weight = final.get("lm_head.weight")
        if head_weight is None:
            raise ModelError("final.safetensors has no lm_head.weight and the model's embeddings are not tied")
        _assign(lm_head, {"weight": head_weight}, "lm_head")
    return embed, norm, lm_head


def _embed_scale(blocks, config: Any) -> float | None:
    """The factor the family's embedding multiplies rows by (Gemma's sqrt(hidden)), None where it has none."""
    if blocks.embedding is None:
        return None
    with torch.device("meta"):
        module = blocks.embedding(config)
    scale = getattr(module, "scalar_embed_scale", None)
    if scale is None and hasattr(module, "embed_scale"):
        raise ModelError(f"this transformers version's {type(module).__name__} keeps its scale only as a tensor, "
                         "which the gguf kind cannot read; load the model at another quantization, or install the "
                         "transformers version swarm pins")
    return None if scale is None else float(scale)


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


def _materialise_buffers(module: nn.Module, device: torch.device) -> None:
    """Non-persistent buffers built on the meta device (Gemma's embedding scale) are not in the files: make them
    real, from the plain value the module keeps beside them."""
    for name, buffer in list(module.named_buffers(recurse=False)):
        if buffer.is_meta:
            value = getattr(module, f"scalar_{name}", None)
            if value is None:
                raise ModelError(f"{type(module).__name__} has a buffer {name!r} that no file holds")
            setattr(module, name, torch.tensor(value, device=device))


def _assign(module: nn.Module, tensors: Mapping[str, torch.Tensor], what: str, partial: bool = False) -> None:
    """Give a meta-device module its real weights (no copy), refusing missing or unexpected tensors. ``partial``:
    some of its weights are in place already (the gguf kind's linear layers): those may be missing from ``tensors``,
    none may stay on the meta device."""
    try:
        result = module.load_state_dict(dict(tensors), strict=not partial, assign=True)
        if partial:
            left = [n for n, t in module.state_dict(keep_vars=True).items() if t.is_meta]
            if result.unexpected_keys or left:
                raise RuntimeError(f"unexpected {result.unexpected_keys}, missing {left}")
    except RuntimeError as exc:
        raise ModelError(f"the weights of the {what} do not fit this model's config: {exc}") from exc
