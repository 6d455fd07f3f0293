"""Early checks: what a fellow's PC can hold of each model in the catalogue, before anything large is downloaded.

A pure function over what the fellow reported (free memory of its roomiest GPU, or free RAM; free disk where its
cache lives) and the catalogue's manifests, budgeted as placement budgets a stage (swarm.leader.planning.placement:
weights, KV cache at SWARM_SERVE_CONTEXT_TOKENS, working memory), so "fits" here means a load would place it. The fellow
prints the sentence when it joins; the admin page shows it per fellow:

    This PC can hold up to 18 of 40 layers of Qwen3-14B at 16 bits (6.1 GB free on the RTX 3060);
    smollm2-135m-instruct fits whole.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from swarm.leader.api.limits import FALLBACK_CONTEXT
from swarm.leader.planning.placement import GB, ONE_FELLOW_HEADROOM, OVERHEAD_BYTES
from swarm.leader.serving.models import model_size
from swarm.messages import Hardware


@dataclasses.dataclass(frozen=True)
class ModelFit:
    model: str
    layers: int  # decoder layers one stage on this PC can hold (0: not even one)
    of: int  # the model's decoder layers
    whole: bool  # the whole model on this PC alone
    limited_by: str  # "memory" or "disk"

    def sentence(self, where: str, bits: int) -> str:
        if self.whole:
            return f"{self.model} fits whole"
        if self.layers == 0:
            return f"{self.model} does not fit: not one of its layers ({where})"
        disk = ", limited by free disk" if self.limited_by == "disk" else ""
        return (f"This PC can hold up to {self.layers} of {self.of} layers of {self.model} at {bits} bits "
                f"({where}{disk})")


def memory_of(hardware: Hardware, device: str = "auto") -> tuple[int, str, bool]:
    """(free bytes a stage may use, where they are in words, on a GPU)."""
    if hardware.gpus and device != "cpu":
        gpu = max(hardware.gpus, key=lambda g: g.free_bytes)
        return gpu.free_bytes, f"{gpu.free_bytes / GB:.1f} GB free on the {gpu.name}", True
    return hardware.ram_free_bytes, f"{hardware.ram_free_bytes / GB:.1f} GB of RAM free", False


def fit(name: str, manifest: dict, free: int, disk_free: int | None, on_gpu: bool, context_tokens: int,
        kv_cache: str = "auto") -> ModelFit:
    size = model_size(manifest, cpu=not on_gpu, kv_cache=kv_cache)
    # what the files take on disk: their own sizes (a GGUF's blocks are budgeted in memory by their values)
    stored = model_size({**manifest, "files": [{k: v for k, v in f.items() if k != "params"}
                                               for f in manifest["files"]]}, cpu=False)
    layers = len(size.layer_bytes)
    whole_bytes = sum(size.layer_bytes) + size.embed_bytes + size.final_bytes
    stored_whole = sum(stored.layer_bytes) + stored.embed_bytes + stored.final_bytes
    disk_ok = disk_free is None or stored_whole <= disk_free
    if whole_bytes + ONE_FELLOW_HEADROOM <= free and disk_ok:
        return ModelFit(name, layers, layers, True, "")
    # A middle stage: layers only, each with its KV cache; the first and last stages add the embedding and head.
    per_layer = max(size.layer_bytes, default=0) + size.kv_bytes_per_token_per_layer * context_tokens
    by_memory = max(0, (free - OVERHEAD_BYTES) // per_layer) if per_layer else layers
    by_disk = layers if disk_free is None else disk_free // max(max(stored.layer_bytes, default=1), 1)
    held = int(min(layers, by_memory, by_disk))
    return ModelFit(name, held, layers, False, "disk" if by_disk < min(layers, by_memory) else "memory")


def fit_report(hardware: Hardware, disk_free: int | None, catalogue: list[tuple[str, dict]], *,
               device: str = "auto", context_tokens: int | Mapping[str, int] = 4096,
               kv_cache: str = "auto") -> dict:
    """{"text": one sentence for people, "models": each model's fit} for a PC against the catalogue. ``context_tokens``:
    the context a stage keeps room for, one for all or each model's (its served context, by name)."""
    free, where, on_gpu = memory_of(hardware, device)
    fits = [fit(name, manifest, free, disk_free, on_gpu,
                context_tokens if isinstance(context_tokens, int) else context_tokens.get(name, FALLBACK_CONTEXT),
                kv_cache) for name, manifest in catalogue]
    if not fits:
        text = f"The leader's catalogue is empty: import a model to see what this PC can hold ({where})."
    else:
        bits = {name: 8 * (2 if on_gpu and manifest.get("dtype") in ("float16", "bfloat16") else 4)
                for name, manifest in catalogue}
        text = "; ".join(f.sentence(where, bits[f.model]) for f in sorted(fits, key=lambda f: (f.whole, f.model))) + "."
    return {"text": text, "models": [dataclasses.asdict(f) for f in fits],
            "disk_free_bytes": disk_free, "memory_free_bytes": free}
