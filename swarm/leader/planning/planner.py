"""Know before you load: the decode speed and the time to first token a model would have on the pool now.

Plain functions over made-up or real inputs. The placement is the one a load would make (the caller gets it from
swarm.leader.serving.serving.ServingHub.placement); each fellow's speed is its calibration (swarm.fellow.calibration:
transformers' decoder layer timed at two widths, a decode step and a prefill chunk; a pass's own costs; the
embedding; the head), fitted with a line -- a fixed cost per layer plus a cost per weight byte, the head's per head
byte -- and scaled by the model's sizes at the dtype its stages compute in; a family whose stages decode through the
lean step (swarm.stage.lean_decode) counts the lean step's calibrated speed. Each stage pays its pass, the first its
embedding, the last its head and pick. Each hop between stages costs half its round trip plus its bytes over the
link, per pass.

One token passes every stage in turn and every hop once (the ring), so the time per token is the sum of the stages'
compute and the hops' transit. A prompt's chunks go through the ring as a pipeline (each stage computes the next
chunk while the one after it computes this one), so its time to first token is one chunk's way through the ring plus
the slowest part once per further chunk. In a ring of several stages each stage waits for the others between its passes,
and a core that waited computes slower (the calibration's decode step after idle: 15-40 % on a 2-core VM), so their
layers count at that speed; a single stage decodes back to back; the bottleneck is the largest of those parts. A prompt
goes through the ring in chunks of SWARM_SERVE_PREFILL_CHUNK tokens, each chunk paying the hops once.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

import trio

from swarm.errors import PlacementError, ProtocolError
from swarm.leader.planning.moe_speed import (  # noqa: F401 -- the planner's MoE functions are told from here too
    active_layer_bytes,
    expert_line,
    expert_weight_bytes,
    line,
    moe_shape,
    with_active_experts,
)
from swarm.leader.planning.placement import ModelSize, StagePlan
from swarm.leader.serving.drafting import sliding
from swarm.model_format import CONFIG_FILE, LEAN_DECODE_FAMILIES

PROMPT_TOKENS = 1000  # the time to first token is told for a prompt of this many tokens
# A hop's round trip before any stage has used it: two fellows on one LAN through the leader's relay (measured
# here on loopback: 0.5-2 ms); told as assumed.
ASSUMED_RTT_MS = 2.0
# What a link carries per second, for the bytes of a hidden state: a home LAN's 100 Mbit/s, the slow end.
LINK_BYTES_PER_S = 12_500_000
TOKEN_BACK_BYTES = 64  # the last stage's token going back to the first (with its framing)


@dataclasses.dataclass(frozen=True)
class LayerSpeed:
    """A fellow's speed: one decoder layer takes ``fixed_ms + per_byte_ms * weight_bytes`` (decode and prefill); a
    decode pass costs ``pass_ms`` besides its layers (rotary table, causal mask, the copy for the wire), a first
    stage's embedding ``embed_ms``, a last stage's norm, head and pick ``head_fixed_ms + head_per_byte_ms * head
    bytes``. A fellow on an older calibration (no head measured) has the head at its layers' cost per byte."""
    decode_fixed_ms: float
    decode_per_byte_ms: float
    prefill_fixed_ms: float  # for PROMPT_TOKENS tokens
    prefill_per_byte_ms: float
    pass_ms: float = 0.0
    embed_ms: float = 0.0
    head_fixed_ms: float | None = None
    head_per_byte_ms: float | None = None
    # The decode step after the core waited (a stage of a ring of several); None on an older calibration.
    idle_fixed_ms: float | None = None
    idle_per_byte_ms: float | None = None
    # a mixture-of-experts layer's routing per pass: once, and per expert computed (swarm.fellow.moe_calibration);
    # None on an older calibration
    moe_router_ms: float | None = None
    moe_expert_ms: float | None = None
    # one routed expert (its dispatch and matrices) at the load's kind: fixed + per byte of its matrices; None where
    # the calibration did not time that kind (swarm.fellow.moe_calibration ``kinds``)
    expert_fixed_ms: float | None = None
    expert_per_byte_ms: float | None = None
    # a byte of a layer at the load's kind counts this many of the dense line's (float) bytes: the float bytes of a
    # weight over the kind's, times a routed expert's time at the kind over its time unquantized (the larger timed
    # shape); 1.0 unquantized or untimed
    kind_byte_factor: float = 1.0

    def routed_ms(self, experts: int, expert_bytes: int) -> float | None:
        """A MoE layer's routing and ``experts`` routed experts of ``expert_bytes`` each, timed at the load's kind;
        None without that figure (the experts are then counted in the layer's bytes, :meth:`moe_ms` beside)."""
        if self.expert_per_byte_ms is None or not expert_bytes:
            return None
        return (self.moe_router_ms or 0.0) + experts * ((self.expert_fixed_ms or 0.0)
                                                         + self.expert_per_byte_ms * expert_bytes)

    def moe_ms(self, experts: int) -> float:
        """A MoE layer's routing in a pass that computes ``experts`` experts (their weights apart). Without the
        calibration's figures: shares of the dense layer's fixed cost, as measured on a 2-core VM, 1 thread (the
        routing 0.25 of it, each expert 0.33: swarm.fellow.moe_calibration)."""
        if self.moe_router_ms is None or self.moe_expert_ms is None:
            return self.decode_fixed_ms * (0.25 + 0.33 * experts)
        return self.moe_router_ms + self.moe_expert_ms * experts

    def decode_ms(self, weight_bytes: int, after_idle: bool = False) -> float:
        if after_idle and self.idle_per_byte_ms is not None:
            return (self.idle_fixed_ms or 0.0) + self.idle_per_byte_ms * weight_bytes
        return self.decode_fixed_ms + self.decode_per_byte_ms * weight_bytes

    def prefill_ms(self, weight_bytes: int, tokens: int = PROMPT_TOKENS) -> float:
        return (self.prefill_fixed_ms + self.prefill_per_byte_ms * weight_bytes) * tokens / PROMPT_TOKENS

    def head_ms(self, head_bytes: int) -> float:
        if self.head_per_byte_ms is None:
            return self.decode_per_byte_ms * head_bytes
        return (self.head_fixed_ms or 0.0) + self.head_per_byte_ms * head_bytes


def layer_speed(calibration: dict, lean: bool = False, kind: str = "none") -> LayerSpeed:
    """A fellow's LayerSpeed from its calibration report; ProtocolError when it is malformed (a fellow's report).
    ``lean``: the model's stages decode through the lean step (:func:`takes_lean_step`), so its figures count where
    the calibration has them (swarm.fellow.calibration VERSION 6). ``kind``: the load's quantization, whose routed
    expert's figures count where the calibration timed it (VERSION 8)."""
    points = calibration.get("points") if isinstance(calibration, dict) else None
    if not isinstance(points, list) or not points:
        raise ProtocolError("no calibration points")
    if lean and all(isinstance(p, dict) and "lean_decode_ms" in p and "lean_decode_idle_ms" in p for p in points):
        points = [{**p, "decode_ms": p["lean_decode_ms"], "decode_idle_ms": p["lean_decode_idle_ms"]} for p in points]
    tokens = float(calibration.get("prefill_tokens") or PROMPT_TOKENS)
    decode = [(float(p["weight_bytes"]), float(p["decode_ms"])) for p in points]
    prefill = [(float(p["weight_bytes"]), float(p["prefill_ms"]) * PROMPT_TOKENS / tokens) for p in points]
    heads = [(float(p["head_bytes"]), float(p["head_ms"])) for p in points if "head_ms" in p and "head_bytes" in p]
    if any(x <= 0 or y < 0 or not math.isfinite(y) for x, y in decode + prefill + heads):
        raise ProtocolError("calibration points out of range")

    def mean(key: str) -> float:
        values = [float(p[key]) for p in points if key in p]
        if any(v < 0 or not math.isfinite(v) for v in values):
            raise ProtocolError(f"calibration {key} out of range")
        return sum(values) / len(values) if values else 0.0

    idle = [(float(p["weight_bytes"]), float(p["decode_idle_ms"])) for p in points if "decode_idle_ms" in p]
    if any(y < 0 or not math.isfinite(y) for _, y in idle):
        raise ProtocolError("calibration decode_idle_ms out of range")
    head = line(heads) if len(heads) == len(points) else (None, None)
    after_idle = line(idle) if len(idle) == len(points) else (None, None)
    moe = calibration.get("moe")
    routing: tuple[float | None, float | None] = (None, None)
    if isinstance(moe, dict) and all(isinstance(moe.get(k), (int, float)) for k in ("router_ms", "expert_ms")):
        routing = (max(float(moe["router_ms"]), 0.0), max(float(moe["expert_ms"]), 0.0))
    speed = LayerSpeed(*line(decode), *line(prefill), mean("pass_ms"), mean("embed_ms"), *head, *after_idle)
    return dataclasses.replace(speed, moe_router_ms=routing[0], moe_expert_ms=routing[1],
                               **expert_line(moe, kind))


def takes_lean_step(architecture: str, config: dict) -> bool:
    """Whether a model's stages decode through the lean step (swarm.stage.lean_decode): a family it computes, without
    sliding windows (``config``: the model's config.json). Each stage still checks the step at warm-up and keeps the
    library's layers where it differs; the planner counts the lean speed all the same."""
    return architecture in LEAN_DECODE_FAMILIES and not sliding(config)


@dataclasses.dataclass(frozen=True)
class Hop:
    rtt_ms: float
    measured: bool  # False: ASSUMED_RTT_MS, no stage has used a link between these fellows yet
    transport: str | None = None
    bytes_per_s: float | None = None  # measured throughput (the link matrix); None: LINK_BYTES_PER_S

    @property
    def rate(self) -> float:
        return self.bytes_per_s if self.bytes_per_s and self.bytes_per_s > 0 else LINK_BYTES_PER_S


def head_bytes(size: ModelSize) -> int:
    """The last stage's output head: the embedding when tied (its final_bytes is then only the norm)."""
    return size.embed_bytes if size.tied_embeddings else size.final_bytes


def predict(plans: list[StagePlan], size: ModelSize, speeds: dict[int, LayerSpeed], hops: list[Hop],
            hidden_bytes_per_token: int, prefill_chunk: int = 256, prompt_tokens: int = PROMPT_TOKENS) -> dict:
    """The prediction for ``plans``: per stage its compute ms per token and for the prompt, per hop its ms per pass,
    the decode tokens/s, the time to first token of ``prompt_tokens``, and the bottleneck. ``hops[i]`` is the link
    from stage i to stage i+1 (the last one back to stage 0); none with one stage. ``speeds``: fellow id -> speed."""
    n = len(plans)
    stages: list[dict[str, Any]] = []
    chunk_ms: list[float] = []  # per stage, one prompt chunk's compute (the head apart: it runs once, at the end)
    head = 0.0
    chunks = math.ceil(prompt_tokens / max(prefill_chunk, 1))
    for plan in plans:
        speed = speeds[plan.fellow_id]
        layers = (size.compute_bytes or size.layer_bytes)[plan.first_layer:plan.end_layer]
        prefill = chunks * speed.pass_ms + sum(speed.prefill_ms(b, prompt_tokens) for b in layers)
        routed = sum(a < b for a, b in zip(layers, size.layer_bytes[plan.first_layer:plan.end_layer]))
        decode = speed.pass_ms + _layers_decode_ms(speed, size, plan, after_idle=n > 1)
        if routed:  # MoE layers in a prompt chunk: their routing and the chunk's (nearly) every expert
            prefill += routed * chunks * speed.moe_ms(min(size.experts, prefill_chunk * size.experts_per_token))
        if plan.index == 0:
            decode += speed.embed_ms
            prefill += chunks * speed.embed_ms
        chunk_ms.append(prefill / chunks)
        if plan.index == n - 1:  # the head: one token's logits, in decode and at the prompt's end alike
            head = speed.head_ms(head_bytes(size))
            decode += head
            prefill += head
        stages.append({"index": plan.index, "fellow_id": plan.fellow_id, "fellow": plan.fellow_name,
                       "layers": [plan.first_layer, plan.end_layer], "decode_ms": decode, "prefill_ms": prefill})
    links: list[dict[str, Any]] = []
    for i, hop in enumerate(hops[:n] if n > 1 else []):
        forward = i < n - 1  # hidden states forward; the last hop carries the token back
        per_token_bytes = hidden_bytes_per_token if forward else TOKEN_BACK_BYTES
        per_pass = hop.rtt_ms / 2 + per_token_bytes / hop.rate * 1e3
        chunk_bytes = hidden_bytes_per_token * prompt_tokens if forward else TOKEN_BACK_BYTES
        links.append({"from_stage": i, "to_stage": (i + 1) % n, "rtt_ms": hop.rtt_ms, "rtt_measured": hop.measured,
                      "transport": hop.transport, "bytes_per_token": per_token_bytes, "ms_per_token": per_pass,
                      "bytes_per_s": hop.rate, "prompt_ms": chunks * hop.rtt_ms / 2 + chunk_bytes / hop.rate * 1e3})
    per_token = sum(s["decode_ms"] for s in stages) + sum(link["ms_per_token"] for link in links)
    ttft = _pipelined_prompt_ms(chunk_ms, head, links[: n - 1], chunks, hidden_bytes_per_token * prefill_chunk)
    slowest = max(stages, key=lambda s: s["decode_ms"])
    link_ms = sum(link["ms_per_token"] for link in links)
    if links and link_ms > slowest["decode_ms"]:
        bottleneck = {"kind": "link", "ms_per_token": link_ms, "text": "the links between stages"}
    else:
        bottleneck = {"kind": "compute", "stage": slowest["index"], "fellow": slowest["fellow"],
                      "ms_per_token": slowest["decode_ms"],
                      "text": f"stage {slowest['index']} on {slowest['fellow']} (compute)"}
    return {"num_stages": n, "tokens_per_s": 1000 / per_token if per_token > 0 else None,
            "ms_per_token": per_token, "prompt_tokens": prompt_tokens, "time_to_first_token_s": ttft / 1000,
            "stages": stages, "links": links, "bottleneck": bottleneck}


def _layers_decode_ms(speed: LayerSpeed, size: ModelSize, plan: StagePlan, after_idle: bool) -> float:
    """A decode step through ``plan``'s layers. A MoE layer (fewer active bytes than it holds) adds its routing;
    where the fellow timed a routed expert at the load's kind, its routed experts count at that figure and the rest
    of it (attention, router, shared experts) at the layer's line, else every active byte at the layer's line."""
    whole = size.layer_bytes[plan.first_layer:plan.end_layer]
    active = (size.compute_bytes or size.layer_bytes)[plan.first_layer:plan.end_layer]
    experts_ms = speed.routed_ms(size.experts_per_token, size.expert_bytes)
    routed = size.experts_per_token * size.expert_bytes
    if experts_ms is None:
        factor = 1.0
    else:  # a quantized layer's attention (and a dense layer's MLP) at the kind's time per byte
        factor = speed.kind_byte_factor
    total = 0.0
    for a, b in zip(active, whole):
        if a >= b:  # a dense layer
            total += speed.decode_ms(int(a * factor), after_idle)
        elif experts_ms is not None and a > routed:
            total += speed.decode_ms(int((a - routed) * factor), after_idle) + experts_ms
        else:
            total += speed.decode_ms(a, after_idle) + speed.moe_ms(size.experts_per_token)
    return total


def _pipelined_prompt_ms(chunk_ms: list[float], head_ms: float, forward_links: list[dict], chunks: int,
                         chunk_bytes: int) -> float:
    """The prompt's time to its first token: its chunks go through the ring as a pipeline -- stage 0 computes the
    next chunk while stage 1 computes this one -- so it takes one chunk's way through every stage and forward link
    (each link's latency once), then the slowest of them once per further chunk, then the head. (The token goes to
    the leader from the last stage; the link back to stage 0 is not on this path.)"""
    services = chunk_ms + [chunk_bytes / link["bytes_per_s"] * 1e3 for link in forward_links]
    latency = sum(link["rtt_ms"] / 2 for link in forward_links)
    return sum(services) + latency + (chunks - 1) * max(services, default=0.0) + head_ms


def sentence(prediction: dict) -> str:
    """The prediction in the seed's words: 'about 21 tokens/s, first token of a 1,000-token prompt in 1.4 s over 2
    stages; the slowest part is stage 1 on pc-2 (compute)'."""
    n = prediction["num_stages"]
    rate = prediction["tokens_per_s"]
    # whole tokens from 10 up; a rate that rounds to 10.0 is "about 10", never "about 10.0"
    rate_text = f"about {rate:.0f} tokens/s" if round(rate, 1) >= 10 else f"about {rate:.1f} tokens/s"
    over = f"over {n} stages" if n > 1 else f"on {prediction['stages'][0]['fellow']}"
    text = (f"{rate_text}, first token of a {prediction['prompt_tokens']:,}-token prompt in "
            f"{prediction['time_to_first_token_s']:.1f} s {over}; the slowest part is "
            f"{prediction['bottleneck']['text']}")
    assumed = [link for link in prediction["links"] if not link["rtt_measured"]]
    if assumed:
        text += f" (links not measured yet: assumed {ASSUMED_RTT_MS:g} ms round trip)"
    return text


def hop_round_trips(plans: list[StagePlan], known: dict[tuple[int, int], Hop]) -> list[Hop]:
    """Each hop of ``plans``' ring: the round trip measured between its two fellows (``known``: (from fellow id,
    to fellow id) -> Hop, either way round), else ASSUMED_RTT_MS."""
    n = len(plans)
    if n < 2:
        return []
    out = []
    for i in range(n):
        a, b = plans[i].fellow_id, plans[(i + 1) % n].fellow_id
        out.append(known.get((a, b)) or known.get((b, a)) or Hop(ASSUMED_RTT_MS, False))
    return out


def missing_speeds(plans: list[StagePlan], speeds: dict[int, LayerSpeed]) -> None:
    """PlacementError naming the fellows of ``plans`` that have not reported their speed yet."""
    missing = sorted({p.fellow_name for p in plans if p.fellow_id not in speeds})
    if missing:
        raise PlacementError(
            f"{', '.join(missing)} {'has' if len(missing) == 1 else 'have'} not reported "
            f"{'its' if len(missing) == 1 else 'their'} "
            "speed yet: a fellow times a decoder layer a few seconds after it joins (and not at all with "
            "SWARM_CALIBRATE=0). Try again in a few seconds."
        )


async def plan_model(serving, name: str, num_stages: int | None = None) -> dict:
    """The prediction for loading ``name`` on the pool now over ``num_stages`` (None: as a load would choose):
    ModelNotFound for a model not in the catalogue, PlacementError when nothing fits or a fellow of the placement
    has not reported its speed. ``serving``: the leader's swarm.leader.serving.serving.ServingHub."""
    row = await serving.model_row(name)
    manifest = row.manifest
    kind = serving.kind_of(name, manifest)
    await serving.context_of(name)  # its own context, read from its config: placement keeps room for it
    plans, size, kind, fellows, _ = serving.placement(name, manifest, num_stages, None, kind, row.pool_id)
    try:
        config_file = serving.models_root / name / CONFIG_FILE
        config = await trio.to_thread.run_sync(lambda: json.loads(config_file.read_text()))
    except (OSError, ValueError):
        config = {}  # a load says what is wrong with the model's files; the plan counts the library's layers
    lean = isinstance(config, dict) and takes_lean_step(manifest.get("architecture", ""), config)
    speeds = {}
    for fellow in fellows:
        try:
            speeds[fellow.id] = layer_speed(fellow.calibration, lean=lean, kind=kind)
        except (ProtocolError, ValueError, KeyError, TypeError):  # a field missing or not a number: no speed
            continue
    missing_speeds(plans, speeds)
    known = serving.link_matrix.hops()
    cpu = not all(f.hardware.gpus for f in fellows if f.id in {p.fellow_id for p in plans})
    hidden_bytes = int(manifest.get("hidden_size") or 0) * (4 if cpu else 2)
    if isinstance(config, dict):  # a mixture of experts: the speed follows the active weights
        size = with_active_experts(size, config, expert_weight_bytes(manifest, cpu, kind))
    prediction = predict(plans, size, speeds, hop_round_trips(plans, known), hidden_bytes,
                         serving.settings.serve_prefill_chunk)
    left_out = serving.left_out.get(name, [])
    prediction.update(model=name, quantization=kind, left_out=left_out,
                      text="; ".join([sentence(prediction), *left_out]))
    return prediction
