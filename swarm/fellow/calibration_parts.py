"""The stage parts a fellow's calibration (swarm.fellow.calibration) times, built as a stage builds them: a stack of
transformers' own Llama decoder layers called as swarm.stage.slice.StageModel.forward calls its layers, and a first
stage's embedding with a last stage's final norm, head and greedy pick."""

from __future__ import annotations

HEAD_VOCAB = 32768  # the timed head's vocabulary (the planner scales it by a model's head bytes)
LAYERS = 4  # layers chained per timed pass, as a stage runs them (sharing one rotary table, timed with the pass)
# Decode steps per timed run: 32 layers' worth, as long as a small model's stage takes, so that on a machine other
# work shares, a run meets the scheduler as a stage's pass does (runs much shorter than a time slice mostly do not).
DECODE_STEPS = 8


class LayerStack:
    """``LAYERS`` of transformers' own Llama decoder layers (grouped-query attention, a gated MLP of 8/3 the width,
    random weights), called as a stage calls its layers (swarm.stage.slice.StageModel.forward): one rotary table per
    pass (timed apart, with the pass's other costs), a DynamicCache per request. Timing the library's layer rather
    than bare matmuls counts what each layer costs beyond its weights (the cache's bookkeeping, module calls), which
    dominates at small widths."""

    def __init__(self, hidden: int, device: str, dtype):
        import torch
        from transformers import LlamaConfig
        from transformers.models.llama.modeling_llama import (
            LlamaDecoderLayer,
            LlamaRotaryEmbedding,
        )

        heads = max(1, hidden // 64)
        config = LlamaConfig(hidden_size=hidden, intermediate_size=hidden * 8 // 3, num_attention_heads=heads,
                             num_key_value_heads=max(1, heads // 3) if heads % 3 == 0 else heads,
                             num_hidden_layers=LAYERS, max_position_embeddings=4096)
        config._attn_implementation = "sdpa"
        torch.manual_seed(0)
        self.config = config
        self.layers = [LlamaDecoderLayer(config, i).to(device=device, dtype=dtype).eval() for i in range(LAYERS)]
        self.rotary = LlamaRotaryEmbedding(config).to(device)
        self.device, self.dtype = device, dtype

    def weight_bytes(self) -> int:
        """One layer's weights (norms included), as a stage's layer_bytes counts them."""
        return sum(p.numel() * p.element_size() for p in self.layers[0].parameters())

    def new_cache(self, tokens: int):
        """A cache already holding ``tokens`` positions (a conversation in progress)."""
        from transformers.cache_utils import DynamicCache

        cache = DynamicCache(config=self.config)
        if tokens:
            self.run(self.states(tokens), 0, cache)
        return cache

    def states(self, tokens: int):
        import torch

        g = torch.Generator().manual_seed(1)
        return torch.randn(1, tokens, self.config.hidden_size, generator=g).to(device=self.device, dtype=self.dtype)

    def run(self, states, position: int, cache, embeddings=None):
        """The layers over ``states`` from ``position`` on; ``embeddings``: the pass's rotary table (computed here
        when not given)."""
        import torch

        position_ids = torch.arange(position, position + states.shape[1], device=self.device).unsqueeze(0)
        if embeddings is None:
            embeddings = self.rotary(states, position_ids)
        for layer in self.layers:
            states = layer(states, attention_mask=None, position_ids=position_ids, cache=cache, use_cache=True,
                           position_embeddings=embeddings)
        return states

    def pass_ends(self, states, position: int, cache):
        """What a stage's decode pass does besides its layers, as swarm.stage.slice.StageModel.forward and
        swarm.stage.execute.run_batch do it: the position ids, the rotary table, the causal mask, and the hidden
        state's copy for the wire. Returns the rotary table."""
        import torch
        from transformers.masking_utils import create_causal_mask

        from swarm import wire

        position_ids = torch.arange(position, position + states.shape[1], device=self.device).unsqueeze(0)
        embeddings = self.rotary(states, position_ids)
        create_causal_mask(config=self.config, inputs_embeds=states, attention_mask=None, cache=cache,
                           position_ids=position_ids)
        wire.tensor_to_wire(states)
        return embeddings

    def lean(self):
        """The lean decode step (swarm.stage.lean_decode) over these layers, as a Llama stage takes it for one new
        row: its own rotary table, no mask."""
        from types import SimpleNamespace

        from swarm.stage.lean_decode import LeanDecode

        def tables(states, position_ids):
            return {"full_attention": self.rotary(states, position_ids)}

        return LeanDecode(SimpleNamespace(config=self.config, layers=self.layers, position_embeddings=tables))


class StageEnds:
    """A first stage's embedding and a last stage's final norm, head and greedy pick, at HEAD_VOCAB tokens, as
    swarm.stage.slice.StageModel.forward/logits and swarm.stage.execute._sample run them per decode step."""

    def __init__(self, hidden: int, device: str, dtype):
        import torch
        from torch import nn
        from transformers.models.llama.modeling_llama import LlamaRMSNorm

        torch.manual_seed(0)
        self.embed = nn.Embedding(HEAD_VOCAB, hidden).to(device=device, dtype=dtype)
        self.norm = LlamaRMSNorm(hidden).to(device=device, dtype=dtype)
        self.head = nn.Linear(hidden, HEAD_VOCAB, bias=False).to(device=device, dtype=dtype)
        self.ids = torch.tensor([[7]], dtype=torch.long)
        self.device = device

    def head_bytes(self) -> int:
        return self.head.weight.numel() * self.head.weight.element_size()

    def embed_step(self) -> None:
        self.embed(self.ids.to(self.device))

    def head_step(self, states) -> int:
        import torch

        logits = self.head(self.norm(states[:, -1:, :]))[0, -1].float().cpu()
        return int(torch.argmax(logits))
