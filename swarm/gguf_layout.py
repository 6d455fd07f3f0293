"""How a GGUF's tensors become transformers' for the families swarm maps itself (swarm.store.gguf_names), where
transformers' GGUF loader has no fix-up for them: shared by an import (a float ``--dtype`` widens at import) and a
stage's load (kept blocks widened at load, swarm.stage.weights).

gpt-oss: llama.cpp's converter (convert_hf_to_gguf.py, GptOssModel) writes each layer's experts as the other MoE
families have them, [experts, rows, columns] for x @ W.T, with gate and up apart (ffn_gate_exps, ffn_up_exps, and
their biases); transformers' GptOssExperts holds them transposed, x @ W -- gate_up_proj [experts, hidden, 2 x
intermediate], down_proj [experts, intermediate, hidden] -- with gate and up INTERLEAVED along the last axis (gate at
even, up at odd columns: GptOssExperts._apply_gate takes ``[..., ::2]`` and ``[..., 1::2]``). So each expert matrix
is transposed here, and its two parts joined interleaved (:data:`INTERLEAVE`), not side by side.
"""

from __future__ import annotations

from typing import Any

# GGUF architectures swarm maps itself, and the transformers model type each becomes
OWN_ARCHITECTURES = {"glm4moe": "glm4_moe", "gpt-oss": "gpt_oss"}

# the ways the parts of one transformers tensor are joined: side by side along swarm.model_format.GGUF_JOIN_DIM (""),
# or interleaved along the last axis, part p at columns p, p + n, p + 2n, ...
INTERLEAVE = "interleave"
JOINS = {"gpt-oss": INTERLEAVE}

# the GGUF tensors (name endings) whose last two axes are swapped
TRANSPOSED = {"gpt-oss": ("ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight")}


class _Processed:
    def __init__(self, weights: Any):
        self.weights = weights


class OwnProcessor:
    """The fix-up of a family swarm maps itself, with the ``process(weights=, name=)`` of transformers' tensor
    processors (the import and the stage ask either kind alike)."""

    def __init__(self, architecture: str):
        self.transposed = TRANSPOSED.get(architecture, ())

    def process(self, weights: Any, name: str) -> _Processed:
        if name.endswith(self.transposed):
            weights = weights.swapaxes(-1, -2)
        return _Processed(weights)

    def shape(self, name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
        """A tensor's shape after :meth:`process`."""
        return (*shape[:-2], shape[-1], shape[-2]) if name.endswith(self.transposed) else shape


def rows_as_filed(architecture: str, name: str) -> bool:
    """Whether GGUF tensor ``name``'s fix-up is only the swap of its last two axes (gpt-oss's experts): its blocks'
    rows are then a linear layer's (out, in) rows as they are, so a stage computing on blocks takes them unchanged."""
    return name.endswith(TRANSPOSED.get(architecture, ()))


def own_processor(architecture: str) -> OwnProcessor | None:
    """The fix-up of ``architecture`` where swarm maps it itself, else None (transformers' processor applies)."""
    return OwnProcessor(architecture) if architecture in OWN_ARCHITECTURES else None


def joined_shape(part_shape: tuple[int, ...], parts: int, join: str, dim: int) -> tuple[int, ...]:
    """The shape of a tensor joined from ``parts`` parts of ``part_shape`` (their shape as read, after the fix-up)."""
    shape = list(part_shape)
    shape[-1 if join == INTERLEAVE else dim] *= parts
    return tuple(shape)


def place_part(joined: Any, value: Any, index: int, sizes: list[int], join: str, dim: int) -> None:
    """Copy part ``index`` (of parts ``sizes`` long along the join) into its place in ``joined``."""
    if join == INTERLEAVE:
        joined[..., index :: len(sizes)].copy_(value)
    else:
        joined.narrow(dim, sum(sizes[:index]), sizes[index]).copy_(value)
