"""What the leader knows of a model it serves: its stages (placement, load progress, hot covers), the current ring
generation and its hops, and the messages that load and link each stage."""

from __future__ import annotations

import dataclasses
import enum
import math

import trio

from swarm import control_messages as cm
from swarm.kv_kinds import kv_element_bytes
from swarm.leader.api.limits import FALLBACK_CONTEXT
from swarm.leader.planning.placement import ModelSize, StagePlan
from swarm.leader.serving import admission
from swarm.leader.serving.admission import Budget
from swarm.model_format import DTYPE_BYTES
from swarm.wire import from_map, to_map

LOAD_PHASES = ["queued", "download", "extract", "load", "ready"]


@dataclasses.dataclass
class StageState:
    plan: StagePlan
    phase: str = "queued"  # queued -> download -> extract -> load -> ready
    fraction: float = 0.0
    ready: bool = False  # loaded on plan.fellow_id
    linked: bool = False  # linked into the current ring generation
    error: str | None = None
    cover: int | None = None  # a standby fellow holding a hot cover of this stage
    cover_ready: bool = False
    # the fellow the leader asked to hold that cover: kept while it is away, so that it alone may rejoin holding one
    # (a fellow's word that it holds a cover is not enough: the cover's files would be its to download)
    cover_given: int | None = None
    failed_on: set[int] = dataclasses.field(default_factory=set)  # fellows whose load of this stage failed
    free_bytes: int = 0  # what its fellow had free when the stage was placed there: its KV budget comes from it


class ModelStatus(enum.StrEnum):
    """A loaded model's state: LOADING its stages, READY to serve, RECOVERING a lost stage, FAILED to load."""
    LOADING = "loading"
    READY = "ready"
    RECOVERING = "recovering"
    FAILED = "failed"


@dataclasses.dataclass
class ModelServing:
    name: str
    load_id: str
    stages: list[StageState]
    status: ModelStatus = ModelStatus.LOADING
    error: str | None = None
    ring_id: str | None = None  # the current ring generation, once every stage is loaded
    hop_ids: list[str] = dataclasses.field(default_factory=list)  # hop i carries stage i -> i+1 (the last: -> 0)
    manifest: dict = dataclasses.field(default_factory=dict)
    config: dict = dataclasses.field(default_factory=dict)
    recovering_since: float | None = None
    size: ModelSize | None = None  # what its stages hold, at the dtype they compute in
    quantization: str = "none"  # swarm.quantization.KINDS: how its stages hold their linear layers
    full_weight_bytes: int = 0  # what its weights would hold unquantized (the Settings panel's compression)
    speculative: int = 0  # drafting ahead: tokens guessed per pass (SWARM_SERVE_SPECULATIVE when it was loaded)
    pool_id: int | None = None  # its pool: only that pool's fellows take its stages, covers and failovers
    # the draft model its last stage holds whole (SWARM_SERVE_DRAFT_MODEL): what load messages send, None without one
    draft: dict | None = None
    context_tokens: int | None = None  # its served context at this load (swarm.leader.api.limits.served_context)
    kv_cache: str = "auto"  # how its stages hold keys and values (swarm.kv_kinds)
    # a re-layout under way (swarm.leader.serving.relayout): the next ring's stages, loading beside these
    relayout: list[StageState] = dataclasses.field(default_factory=list)
    changed: trio.Event = dataclasses.field(default_factory=trio.Event)

    def budget(self, settings) -> Budget:
        """What the ring holds at once, from the memory its stages' fellows had for them
        (swarm.leader.serving.admission)."""
        kv = self.size.kv_bytes_per_token_per_layer if self.size is not None else 0
        context = self.context_tokens or settings.serve_context_tokens or FALLBACK_CONTEXT
        return admission.budget([s.plan for s in self.stages], {s.plan.fellow_id: s.free_bytes for s in self.stages},
                                kv, settings.serve_typical_tokens, context)

    def takes(self, conn) -> bool:
        """Whether the online fellow ``conn`` may hold a stage of this model: it is in the model's pool."""
        return self.pool_id is None or conn.pool_id == self.pool_id

    def slot_of(self, fellow_id: int) -> StageState | None:
        return next((s for s in self.stages if s.plan.fellow_id == fellow_id), None)

    @property
    def fellow_ids(self) -> set[int]:
        return {s.plan.fellow_id for s in self.stages}

    def files_for(self, fellow_id: int) -> set[str]:
        """The model files ``fellow_id`` may download: those of the stages (and hot covers, and a re-layout's next
        stages) placed on it."""
        files = {f.path for i, s in enumerate(self.stages) if fellow_id in (s.plan.fellow_id, s.cover)
                 for f in load_message(self, i).files}
        if self.relayout:
            files |= dataclasses.replace(self, stages=self.relayout, relayout=[]).files_for(fellow_id)
        return files

    def draft_files_for(self, fellow_id: int) -> set[str]:
        """The draft model's files ``fellow_id`` may download: all of them, where it holds the last stage (or its
        hot cover, or the last stage of a re-layout's next ring that holds the draft model)."""
        last = self.stages[-1] if self.stages else None
        holders = {last.plan.fellow_id, last.cover} if last is not None else set()
        if self.relayout and self.relayout[-1].plan.draft_bytes:
            holders.add(self.relayout[-1].plan.fellow_id)
        if self.draft is None or fellow_id not in holders:
            return set()
        return {f["path"] for f in self.draft["files"]}

    def notify(self) -> None:
        self.changed.set()
        self.changed = trio.Event()

    def progress(self) -> dict:
        overall = 0.0
        for s in self.stages:
            step = LOAD_PHASES.index(s.phase) if s.phase in LOAD_PHASES else 0
            overall += (step - 1 + s.fraction) / 3 if step >= 1 else 0.0
        overall = max(0.0, min(1.0, overall / max(len(self.stages), 1)))
        return {"fraction": round(overall, 3), "stages": [
            {"index": s.plan.index, "fellow": s.plan.fellow_name, "phase": s.phase, "fraction": s.fraction}
            for s in self.stages]}

    def hops(self, hop_stats: dict[str, dict]) -> list[dict]:
        """Each link of the ring in order, stage i -> i+1 (the last one carries the token back to stage 0)."""
        n = len(self.stages)
        out = []
        for i, hop_id in enumerate(self.hop_ids):
            stats = hop_stats.get(hop_id, {})
            out.append({
                "from_stage": i, "to_stage": (i + 1) % n,
                "from": self.stages[i].plan.fellow_name, "to": self.stages[(i + 1) % n].plan.fellow_name,
                "transport": stats.get("transport"), "rtt_ms": stats.get("rtt_ms"),
                "bytes_per_token": stats.get("bytes_per_token"), "bytes_sent": stats.get("bytes_sent", 0),
            })
        return out

    def describe(self) -> dict:
        weight = sum(s.plan.weight_bytes for s in self.stages)
        return {
            "status": self.status,
            "error": self.error,
            "quantization": self.quantization,
            "kv_cache": self.kv_cache,
            "context_tokens": self.context_tokens,
            "draft_model": self.draft["model"] if self.draft else None,  # SWARM_SERVE_DRAFT_MODEL, where it runs
            "weight_bytes": weight,
            # unquantized weight bytes over quantized ones: 1.0 at none, ~3.6 at int8 from float32
            "compression": round(self.full_weight_bytes / weight, 2) if weight and self.full_weight_bytes else 1.0,
            "num_stages": len(self.stages),
            "stages": [
                {"index": s.plan.index, "fellow_id": s.plan.fellow_id, "fellow": s.plan.fellow_name,
                 "layers": [s.plan.first_layer, s.plan.end_layer], "memory_bytes": s.plan.weight_bytes,
                 "phase": s.phase, "ready": s.ready, "cover_fellow_id": s.cover if s.cover_ready else None}
                for s in self.stages
            ],
            "progress": self.progress(),
        }


def load_message(serving: ModelServing, i: int, cover: bool = False, extend: bool = False) -> cm.Load:
    """What a fellow needs to load stage ``i`` (or a hot cover of it; or, ``extend``, what its stage of the model
    lacks for it: control_messages.Load.extend): its layers and their files."""
    from swarm.store.manifest import Manifest, stage_files

    plan, n = serving.stages[i].plan, len(serving.stages)
    slot = cm.StageSlot(i, n, plan.first_layer, plan.end_layer, is_first=i == 0, is_last=i == n - 1)
    files = stage_files(Manifest.from_dict(serving.manifest), plan.first_layer, plan.end_layer, slot.is_first,
                        slot.is_last)
    dtype = serving.manifest.get("dtype")
    # serving.draft is kept as a map (it goes into the stored plans, swarm.leader.serving.adoption)
    draft = from_map(cm.DraftPart, serving.draft, "draft") if serving.draft is not None and slot.is_last else None
    return cm.Load(serving.name, serving.load_id, slot, serving.config, [_file_message(f) for f in files],
                   gpu_dtype=dtype if dtype in ("float16", "bfloat16") else "float16", cover=cover,
                   stored_dtype=dtype or "float32", quantization=serving.quantization, kv_cache=serving.kv_cache,
                   draft=draft, extend=extend)


def _file_message(f) -> cm.FileEntry:
    """A file of a load message: what to fetch, and (a GGUF's blocks) how many weight values it holds, which a fellow
    spreading a stage over its cards sizes the layers by."""
    return cm.FileEntry(f.path, f.sha256, f.size, f.params or None)


def draft_message(chosen) -> dict:
    """The ``draft`` part of the last stage's load message: the draft model (a swarm.leader.planning.draft_model.Chosen)
    as a fellow fetches and builds it -- every weight file (it is held whole), no tokenizer (the target's ids are
    its)."""
    from swarm.model_format import stage_file_paths
    from swarm.store.manifest import Manifest

    manifest = Manifest.from_dict(chosen.manifest)
    files = [manifest.file(p) for p in stage_file_paths(0, manifest.num_layers, True, True,
                                                        manifest.tie_word_embeddings)]
    return {"model": chosen.name, "config": chosen.config, "num_layers": manifest.num_layers,
            "files": [to_map(_file_message(f)) for f in files],
            "stored_dtype": chosen.manifest.get("dtype") or "float32"}


def draft_size(manifest: dict, cpu: bool, quantization: str = "none"):
    """What the draft model of ``manifest`` takes held whole beside the last stage (swarm.leader.planning.placement), at
    the target's ``quantization`` (a fellow quantizes it as it quantizes its stage)."""
    from swarm.leader.planning.placement import DraftSize, stage_weight_bytes

    size = model_size(manifest, cpu, quantization)
    n = len(size.layer_bytes)
    return DraftSize(stage_weight_bytes(size, 0, n, True, True), size.kv_bytes_per_token_per_layer * n)


def link_message(serving: ModelServing, i: int, online: dict, transport: str) -> cm.Link:
    """Stage ``i``'s hops in the current ring generation: where it sends, and who may send to it."""
    plans = [s.plan for s in serving.stages]
    n = len(plans)
    assert serving.ring_id is not None, "a ring generation is started before its stages are linked"
    message = cm.Link(serving.name, serving.load_id, serving.ring_id, i, n)
    conn = online.get(plans[i].fellow_id)
    if conn is not None and (conn.narrowing or conn.extending):  # its layers: a narrowed or extended stage's
        message = dataclasses.replace(message, first_layer=plans[i].first_layer, end_layer=plans[i].end_layer)
    if n == 1:
        return message
    nxt = online.get(plans[(i + 1) % n].fellow_id)
    direct = None
    if transport != "relay" and nxt and nxt.serve_port:
        direct = [nxt.serve_host, nxt.serve_port]
    prev = online.get(plans[(i - 1) % n].fellow_id)
    return dataclasses.replace(
        message,
        hop_out=cm.HopOut(serving.hop_ids[i], nxt.public_key if nxt else b"", plans[(i + 1) % n].fellow_name, direct,
                          transport),
        hop_in=cm.HopIn(serving.hop_ids[(i - 1) % n], prev.public_key if prev else b""))


def model_size(manifest: dict, cpu: bool, quantization: str = "none", kv_cache: str = "auto") -> ModelSize:
    """Bytes a stage will hold, from the manifest; CPU stages compute (and hold) weights in float32. A file that keeps
    a GGUF's blocks (its entry counts its weight values: ``params``) is counted as those values in the manifest's
    dtype -- what a stage dequantizes it to -- not as its stored bytes, which only the download takes. A quantized load
    holds what swarm.stage.quantize quantizes at the kind's bytes per weight (swarm.quantization): every linear layer
    of the decoder layers, and on CPU the head too (4 bits at int4-fast, int8 otherwise; a tied head is then a
    quantized copy, so the last stage holds no float embedding for it). The embedding, the norms and the KV cache stay
    in the compute dtype, and so does the head on CUDA. The KV cache holds ``kv_cache``'s bytes an element
    (swarm.kv_kinds: the compute dtype's at auto). A mixture-of-experts layer's experts are quantized too, a linear
    layer per expert matrix (swarm.stage.moe_experts); its router stays in the compute dtype but is counted at the
    kind's size like the rest (experts x hidden weights: under 0.1 % of a real model's layer), and its experts' rows
    are counted at the hidden size where some are shorter (an int8 row's scale: 2 bytes a row). At ``gguf`` a layer
    -- a MoE layer's expert tensors included -- counts at its stored blocks' bytes as the kernels repack them."""
    from swarm.quantization import GGUF_KIND, bytes_per_weight, gguf_head_bytes, gguf_layer_bytes

    stored = DTYPE_BYTES.get(manifest.get("dtype", "float32"), 4)
    scale = 4 / stored if cpu else 1.0
    device = "cpu" if cpu else "cuda"
    hidden = manifest.get("hidden_size") or 0  # the shortest row of a decoder layer's linears, and the head's row
    layer_q = bytes_per_weight(quantization, device, hidden)
    head_kind = ("int4-fast" if quantization == "int4-fast" else "int8") if quantization not in ("none", GGUF_KIND) \
        and cpu else "none"  # at gguf the head and embedding widen to float
    head_q = bytes_per_weight(head_kind, device, hidden)
    norm = hidden * stored  # one norm's weight, as stored

    def quantized(size: int, q: float | None, unquantized: int = 0) -> int:
        """A file of ``size`` stored bytes whose ``unquantized`` bytes (norms) stay in the compute dtype."""
        if q is None:
            return int(size * scale)
        kept = min(unquantized, size)
        return int((size - kept) * q / stored + kept * scale)

    tied = bool(manifest.get("tie_word_embeddings"))
    layers = [0] * manifest["num_layers"]
    embed = final = 0
    for f in manifest["files"]:
        size = int(f.get("params") or 0) * stored or f["size"]  # as if stored in `stored`
        if f["kind"] == "layer" and quantization == GGUF_KIND and cpu:
            # the file's blocks, repacked (swarm.stage.gguf_linear; a MoE layer's experts too, per expert:
            # swarm.stage.gguf_experts), and its two norms in float32
            layers[f["layer"]] = gguf_layer_bytes(manifest.get("file_type", ""), f["size"], int(f.get("params") or 0),
                                                  f.get("types"))
        elif f["kind"] == "layer":
            layers[f["layer"]] = quantized(size, layer_q, 2 * norm)  # its two norms
        elif f["kind"] == "embed" and quantization == GGUF_KIND and cpu:
            # stage 0 keeps its blocks (gguf_linear.GGUFEmbedding); a tied head is a gguf_linear on them, widened to
            # float32 where no kernel takes its type: counted as both, an upper bound for any stage
            embed = f["size"] + (gguf_head_bytes(manifest.get("file_type", ""), f["size"], int(f.get("params") or 0))
                                 if tied else 0)
        elif f["kind"] == "embed":
            embed = int(size * scale)
            if tied and head_q is not None:
                final += int(size * head_q / stored)  # the head: a quantized copy of the embedding
        elif f["kind"] == "final":
            final += quantized(size, None if tied else head_q, norm)  # the final norm (and an untied head)
    kv = manifest.get("kv_bytes_per_token") or 0  # per token, per layer, at the stored dtype
    kv_bytes = math.ceil(kv / stored * kv_element_bytes(kv_cache, int(stored * scale)))
    return ModelSize(tuple(layers), embed, final, tied and head_q is None, kv_bytes)


def quantized_fellows(kind: str, fellows: list, num_stages: int, device: str) -> tuple[list, str]:
    """(fellows to place on, kind) for a load asked at ``kind``. Only fellows that report the kinds they run (the
    current version) take a quantized load; with fewer of them than stages the model loads in full precision (the
    seed's rule), so the answer's kind is then "none"."""
    if kind == "none":
        return fellows, kind
    current = [f for f in fellows if f.hardware.quantization_kinds(device) is not None]
    if len(current) >= num_stages:
        return current, kind
    return fellows, "none"


def check_quantization(kind: str, plans: list[StagePlan], fellows: dict, device: str) -> None:
    """PlacementError naming the first fellow of ``plans`` that cannot run ``kind`` and what it needs, before any
    load starts."""
    from swarm.errors import PlacementError
    from swarm.quantization import needs

    if kind == "none":
        return
    for plan in plans:
        hardware = fellows[plan.fellow_id].hardware
        kinds = hardware.quantization_kinds(device)
        if kinds is not None and kind not in kinds:
            on = "cuda" if hardware.gpus and device != "cpu" else "cpu"
            runs = ", ".join(k for k in kinds if k != "none") or "no quantized kind"
            raise PlacementError(
                f"stage {plan.index} on {plan.fellow_name} cannot load {kind} on its {on.upper()}: it needs "
                f"{needs(kind, on)} (it runs {runs}). Install that and restart the fellow, or load with another "
                "quantization.")


def full_weight_bytes(manifest: dict, cpu: bool, plans: list[StagePlan]) -> int:
    """What the stages of ``plans`` would hold unquantized: the base of a quantized load's compression."""
    from swarm.leader.planning.placement import stage_weight_bytes

    size = model_size(manifest, cpu)
    n = len(plans)
    return sum(stage_weight_bytes(size, p.first_layer, p.end_layer, p.index == 0, p.index == n - 1) for p in plans)
