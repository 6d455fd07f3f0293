"""The timing of one reply: ``swarm.timing`` in every chat completion (the last chunk of a stream) and legacy
completion, the speed line under each reply, and what the serving history keeps of a finished request.

The shape is stable (the serving history stores it as it is)::

    queue_ms          waiting for room on the ring (Request.queue_s)
    ttft_ms           from the request's arrival to its first token (queue included)
    prompt_ms         from going out on the ring to the first token: every prompt chunk through every stage and back
    cached_tokens     prompt tokens the stages took from the prefix cache rather than computing them
    tokens            tokens of the reply
    tokens_per_s      the steady rate, after the first token (None with fewer than two token batches)
    ms_per_token      1000 / tokens_per_s: the measured time per token the split below divides up
    stages            [{stage, fellow, compute_ms_per_token, prefill_ms}] as each stage measured its compute
    links             [{from_stage, to_stage, transport, ms_per_token, bytes_per_token}], one per hop of the ring
    link_ms_per_token the links together (None on one stage)
    bytes_per_token   {forward: a hidden state, back: the token}, as sent per decode step (None on one stage)
    split             "fellows" when every stage reported its times, else None (stages/links hold what came)
    spec_passes, spec_tokens, spec_drafted, spec_accepted   drafting ahead, as the last stage counted (0 without it):
                      passes that gave tokens, the tokens they gave, tokens guessed, guesses kept

With drafting ahead a pass gives several tokens: the stages measure per pass, and the split is told per token (each
pass's figures times the decode passes per decode token), so that it still adds up to ms_per_token.

Where the link's time comes from: the stages' clocks are not synchronised, so no stage can time a hop by itself.
Stage 0 times each decode step's round trip on its own clock -- from the step's hidden state leaving (before it is
encoded) to its token coming back -- and every stage times its own compute. The links' time is that round trip less
the other stages' compute: encoding, encryption, the wire (relay, tunnel or direct) and any wait in a stage's inbox.
It is divided among the hops in proportion to each hop's ping round trip (the fellows report it every heartbeat), or
evenly when a hop has none yet. So stage 0's compute plus the links plus the other stages' compute is the ring's time
per token; what the leader measures per token is that plus stage 0's short gap between a token's return and its next
step.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import trio

from swarm import messages

if TYPE_CHECKING:
    from swarm.leader.serving.request import Request
    from swarm.leader.serving.serving import Serving

# How long a reply's end waits for the stages' times. Stage 0 reports after the last token came back to it -- one hop
# and its control link after the leader saw the token -- so on a LAN this is milliseconds; the cap keeps a ring of
# fellows that never report (older versions) from holding every reply's end.
SETTLE_S = 1.0
# The first wire protocol (swarm.wire.PROTOCOL_VERSION, a fellow's hello says its own) whose fellows send StageTimes.
STAGE_TIMES_PROTOCOL = 1


def _ms(seconds: float | None, digits: int = 1) -> float | None:
    return None if seconds is None else round(seconds * 1000, digits)


def reply_timing(request: Request, fellows: Sequence[str] = (), hops: Sequence[dict] = ()) -> dict:
    """``swarm.timing`` of ``request``, given its ring: the fellow of each stage, and each hop (from
    swarm.leader.serving.models.ModelServing.hops: transport, rtt_ms)."""
    first, last = request.first_token_at, request.last_token_at
    tokens = len(request.tokens)
    steady = tokens - request.first_tokens
    tokens_per_s = steady / (last - first) if first is not None and last is not None and last > first and steady > 0 \
        else None
    started = request.started_at
    out: dict[str, Any] = {
        "queue_ms": _ms(request.queue_s),
        "ttft_ms": _ms(first - request.created_at) if first is not None else None,
        "prompt_ms": _ms(first - started) if first is not None and started is not None else None,
        "cached_tokens": request.cached_tokens,
        "tokens": tokens,
        "tokens_per_s": round(tokens_per_s, 2) if tokens_per_s else None,
        "ms_per_token": round(1000 / tokens_per_s, 2) if tokens_per_s else None,
        "stages": [],
        "links": [],
        "link_ms_per_token": None,
        "bytes_per_token": {"forward": None, "back": None},
        "split": None,
        "spec_passes": 0, "spec_tokens": 0, "spec_drafted": 0, "spec_accepted": 0,
    }
    reports: dict[int, messages.StageTimes] = request.stage_times
    n = len(fellows) or (max(reports) + 1 if reports else 0)
    last_stage = reports.get(n - 1) if n else None
    per_pass = 1.0  # decode passes per decode token (the first token comes from the prompt's pass)
    if last_stage is not None and last_stage.spec_passes:
        out.update(spec_passes=last_stage.spec_passes, spec_tokens=last_stage.spec_tokens,
                   spec_drafted=last_stage.spec_drafted, spec_accepted=last_stage.spec_accepted)
        if last_stage.spec_tokens > 1:
            per_pass = max(0, last_stage.spec_passes - 1) / (last_stage.spec_tokens - 1)
    for i in sorted(reports):
        r = reports[i]
        out["stages"].append({
            "stage": i, "fellow": fellows[i] if i < len(fellows) else None,
            "compute_ms_per_token": round(r.decode_s / r.decode_steps * per_pass * 1000, 2) if r.decode_steps
            else None,
            "prefill_ms": _ms(r.prefill_s),
        })
    if n > 1:
        out["bytes_per_token"] = {"forward": _per_token(reports.get(0), per_pass),
                                  "back": _per_token(reports.get(n - 1), per_pass)}
        out["links"] = [{"from_stage": i, "to_stage": (i + 1) % n,
                         "transport": hops[i].get("transport") if i < len(hops) else None,
                         "ms_per_token": None, "bytes_per_token": _per_token(reports.get(i), per_pass)}
                        for i in range(n)]
        ring = reports.get(0)
        others = [reports[i] for i in range(1, n) if i in reports]
        if ring is not None and ring.ring_steps and len(others) == n - 1 and all(o.decode_steps for o in others):
            link_s = max(0.0, ring.ring_s / ring.ring_steps - sum(o.decode_s / o.decode_steps for o in others))
            link_s *= per_pass
            out["link_ms_per_token"] = round(link_s * 1000, 2)
            rtts = [hops[i].get("rtt_ms") if i < len(hops) else None for i in range(n)]
            known = [r for r in rtts if isinstance(r, (int, float)) and r > 0]
            shares = [r / sum(known) for r in known] if len(known) == n else [1 / n] * n
            for link, share in zip(out["links"], shares):
                link["ms_per_token"] = round(link_s * share * 1000, 2)
    if n and len(reports) == n and all(r.decode_steps for r in reports.values()) and \
            (n == 1 or out["link_ms_per_token"] is not None):
        out["split"] = "fellows"
    return out


def _per_token(report: messages.StageTimes | None, per_pass: float = 1.0) -> int | None:
    """Bytes a stage sent per decode token: per decode step it sent (sent_tokens), times the passes per token."""
    if report is None or not report.sent_tokens:
        return None
    return round(report.sent_bytes / report.sent_tokens * per_pass)


def _ring(serving: Serving, model: str) -> tuple[list[str], list[dict]]:
    ring = serving.models.get(model)
    if ring is None:
        return [], []
    return [s.plan.fellow_name for s in ring.stages], ring.hops(serving.hop_stats)


def of_request(serving: Serving, request: Request) -> dict:
    """``swarm.timing`` of ``request`` on the ring that serves its model now."""
    return reply_timing(request, *_ring(serving, request.model))


def reports_times(serving: Serving, model: str) -> bool:
    """Whether every stage of ``model``'s ring will report its StageTimes: False when a stage's fellow speaks a
    protocol older than STAGE_TIMES_PROTOCOL (it never sends them) or is not online (it cannot)."""
    ring = serving.models.get(model)
    hub = serving.hub
    if ring is None or hub is None:
        return ring is not None
    for stage in ring.stages:
        conn = hub.online.get(stage.plan.fellow_id)
        if conn is None or conn.protocol < STAGE_TIMES_PROTOCOL:
            return False
    return True


async def settle(serving: Serving, request: Request, wait_s: float = SETTLE_S) -> None:
    """Until every stage of the request's ring has reported its times (or ``wait_s`` passed): call once the reply
    ended, before its timing goes out. No wait at all for a ring that holds a fellow that will not report."""
    ring = serving.models.get(request.model)
    n = len(ring.stages) if ring is not None else 0
    if not request.tokens or not n or not reports_times(serving, request.model):
        return
    with trio.move_on_after(wait_s):
        while len(request.stage_times) < n:
            await request.changed.wait()
