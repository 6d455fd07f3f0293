"""Spot checks of the fellows' work: a fraction of the passes, picked at random, are recomputed by another fellow
that holds the same layers, and a fellow whose output differs is taken out of service.

SWARM_SERVE_VERIFY=F (or the admin switch) is the chance that any one pass of a stage is checked. When a request goes
to the ring, the leader draws, for each stage that has a checker -- a hot cover of it on a standby, kept on every
stage while checks are on -- which of the request's passes it checks, and tells only that stage's fellow
(``verify_pick``). The stage sends what went into it for the request up to the picked pass and what came out
(swarm.fellow.verify) once it has passed its output on; the leader hands that to the checker (``verify_run``), which
recomputes it (swarm.stage.recompute); the request never waits for any of it. A request checks at most MAX_PICKS
passes per stage, since a sample carries every input before its pass.

Outside the tolerance (``tolerance``): the fellow is suspect and the first pass of its stage in the next request is
checked again; a second failure in a row takes it out of service the way a lost stage is (swarm.leader.serving.recovery:
its hot cover takes the stage over), with an alert naming the fellow, the stage and the difference, on the admin page
and in the log, listing the requests served through that stage since its last good check.

A fellow that knows it is being checked could behave only then: the pick reaches the checked fellow before the
pass. These checks catch broken hardware, drivers and builds, not a fellow built to cheat.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import random
import secrets
import time
from typing import Any

import numpy as np
import trio

from swarm import control_messages as cm
from swarm import messages
from swarm.errors import ProtocolError
from swarm.leader.serving.models import ModelServing, ModelStatus

log = logging.getLogger(__name__)

VERIFY = "verify_fraction"  # the store setting the admin page writes (SWARM_SERVE_VERIFY sets it for the process)
MAX_PICKS = 8  # checked passes per stage and request at most (each sample carries every input before its pass)
PENDING_S = 900.0  # a pick whose sample or result never came is forgotten after this long (the request ended early)
SERVED_KEPT = 10_000  # requests remembered per stage since its last good check
ALERTS_KEPT = 100

# How far an honest stage and its checker may be apart (difference(): relative to the output's largest value), per
# kind on CPUs, where the checker runs the same kernels on the same quantized weights. Measured by
# bench/verify_bounds.py (bench/RESULTS.md, "Spot checks"): every pass of a 3-stage ring -- prompt chunks, single and
# batched ragged decode, lean/compiled steps, drafting's verifying passes -- recomputed as a checker does. Largest
# honest differences over 10,440 checks (tiny model, 2,088 a kind): float32 1.6e-6 (1.8e-6 in an earlier run; the
# built-in model 7.8e-7 over 146); int8, nf4 and int4-fast 0 (their kernels compute each row alone).
# 1e-4 keeps a 50x margin over float32 and is still 500x below the test double's 5 % error.
TOLERANCES = {"none": 1e-4, "int8": 1e-4, "nf4": 1e-4, "int4-fast": 1e-4}
TOLERANCE_FLOAT32 = TOLERANCES["none"]
# A stage or a checker on a GPU computes in 16 bits with other kernels than a CPU's. bfloat16 on a CPU, as a stand-in,
# measured 8.8e-3 at most (2,088 checks: batched rows round once differently); 5e-2 leaves ~6x for a GPU's own
# kernels -- an estimate: no GPU was at hand.
TOLERANCE_GPU = 5e-2


def tolerance(quantization: str, gpu_checked: bool, gpu_checker: bool) -> float | None:
    """How far apart an honest stage and its checker may be, by how the stage computes; None where no bound holds:
    a quantized stage on a CPU and its checker on a GPU (or the other way) hold different weights (swarm.stage.quantize:
    the CPU's int grids against bitsandbytes'), so one cannot check the other."""
    if quantization != "none" and gpu_checked != gpu_checker:
        return None
    if gpu_checked or gpu_checker:
        return TOLERANCE_GPU
    return TOLERANCES.get(quantization, TOLERANCE_GPU)


def pass_starts(prompt_len: int, max_tokens: int, chunk: int, last_stage: bool) -> list[int]:
    """The positions the request's passes start at: its prompt chunks (on the last stage only the one that draws),
    then one decode step per reply token after the first."""
    chunks = list(range(0, prompt_len, chunk))
    if last_stage:
        chunks = chunks[-1:]
    return chunks + list(range(prompt_len, prompt_len + max_tokens - 1))


def draw(starts: list[int], fraction: float, rng: random.Random) -> list[int]:
    """Each pass checked with chance ``fraction``, MAX_PICKS at most."""
    picked = [p for p in starts if rng.random() < fraction]
    return sorted(rng.sample(picked, MAX_PICKS)) if len(picked) > MAX_PICKS else picked


def _array(d: dict) -> np.ndarray:
    """A wire tensor (swarm.wire.tensor_to_wire) as float32, read with numpy: the leader does not load torch."""
    data, shape = d["data"], [int(n) for n in d["shape"]]
    if d["dtype"] == "float32":
        a = np.frombuffer(data, dtype="<f4")
    elif d["dtype"] == "float16":
        a = np.frombuffer(data, dtype="<f2").astype(np.float32)
    elif d["dtype"] == "bfloat16":  # the high half of a float32
        a = (np.frombuffer(data, dtype="<u2").astype(np.uint32) << 16).view(np.float32)
    else:
        raise ProtocolError(f"a stage's output of dtype {d['dtype']!r}")
    return a.reshape(shape)


def difference(claimed: dict, recomputed: dict) -> float:
    """How far the checked stage's output is from the checker's, relative to the output's size: the largest
    difference of a hidden value over the largest value; on the last stage, the claimed token's logit below the
    greedy one over the largest logit (0 when the tokens agree)."""
    if "hidden" in recomputed:
        a, b = _array(claimed["hidden"]), _array(recomputed["hidden"])
        if a.shape != b.shape or not np.isfinite(a).all():
            return float("inf")
        return float(np.abs(a - b).max()) / max(float(np.abs(b).max()), 1e-6)
    if claimed.get("token") == recomputed["token"]:
        return 0.0
    return float(recomputed["gap"]) / max(float(recomputed["scale"]), 1e-6)


@dataclasses.dataclass
class Check:
    model: str
    load_id: str
    index: int
    fellow_id: int
    checker_id: int
    rid: str
    request_id: str
    started_at: float
    tolerance: float
    claimed: dict | None = None
    path: str | None = None  # the checked stage's 4-bit kernel (swarm.stage.quantize.int4_path)


class Verifier:
    def __init__(self, serving, rng: random.Random | None = None):
        self.serving = serving
        self.metrics: Any = None  # set by the app: swarm.leader.api.metrics.Metrics
        self.stored_fraction = 0.0  # the admin switch (load())
        self.rng = rng or random.Random()
        self.pending: dict[str, Check] = {}
        self.strikes: dict[tuple[str, int, int], int] = {}  # (model, stage, fellow) -> failures in a row
        self.recheck: set[tuple[str, int, int]] = set()  # suspects: their next pass is checked
        # (model, stage, fellow) -> (when, request id, user id) of the requests served since its last good check
        self.served: dict[tuple[str, int, int], collections.deque] = {}
        self.alerts: collections.deque = collections.deque(maxlen=ALERTS_KEPT)
        # (model, stage) -> (fellow, checker) whose 4-bit kernels differ: no bound holds, that checker is not used
        self.mismatched: dict[tuple[str, int], tuple[int, int, str]] = {}
        self.checks = self.failures = 0
        self.largest_honest = 0.0  # the largest difference a passed check showed: the tolerance's margin

    @property
    def outstanding(self) -> int:
        """Checks whose sample came and whose recomputation has not (a pick past a reply's end never samples)."""
        return sum(1 for check in self.pending.values() if check.claimed is not None)

    @property
    def fraction(self) -> float:
        return self.serving.settings.serve_verify or self.stored_fraction

    def load(self) -> None:
        """Read the admin switch (in a worker thread, at start)."""
        value = self.serving.store.get_setting(VERIFY, 0.0)
        self.stored_fraction = float(value) if isinstance(value, (int, float)) else 0.0

    # --- picking ------------------------------------------------------------------------------------------------

    def on_generate(self, model: ModelServing, message: messages.Generate) -> bool:
        """A request goes to stage 0 (called before its Generate is posted): note where it goes, pick its checks.
        True when some pass of it is checked."""
        fraction = self.fraction
        checked = False
        if fraction <= 0 and not self.recheck or message.siblings or message.draft:
            return False
        request = self.serving.book.by_rid.get(message.rid)
        now = time.time()
        request_id = request.id if request is not None else message.rid
        owner = request.owner if request is not None else None
        sampling = message.sampling
        greedy = not sampling.temperature and not sampling.bias_ids and not sampling.penalised
        online = self.serving.hub.online
        for slot in model.stages:
            key = (model.name, slot.plan.index, slot.plan.fellow_id)
            self.served.setdefault(key, collections.deque(maxlen=SERVED_KEPT)).append((now, request_id, owner))
            conn, checker = online.get(slot.plan.fellow_id), online.get(slot.cover) if slot.cover_ready else None
            last = slot.plan.index == len(model.stages) - 1
            if conn is None or checker is None or checker.id == conn.id or (last and not greedy):
                continue
            if self.mismatched.get((model.name, slot.plan.index), (0, 0, ""))[:2] == (conn.id, checker.id):
                continue
            starts = pass_starts(len(message.prompt), message.max_tokens, self.serving.settings.serve_prefill_chunk,
                                 last)
            picked = draw(starts, fraction, self.rng)
            if key in self.recheck and starts and starts[0] not in picked:
                picked = [starts[0], *picked][:MAX_PICKS]
            if not picked:
                continue
            tol = tolerance(model.quantization, _on_gpu(conn), _on_gpu(checker))
            if tol is None:
                continue
            picks = []
            for pos in picked:
                check_id = "c" + secrets.token_hex(6)
                self.pending[check_id] = Check(model.name, model.load_id, slot.plan.index, conn.id, checker.id,
                                               message.rid, request_id, now, tol)
                picks.append([pos, check_id])
            conn.post(cm.VerifyPick(model.name, message.rid, picks))
            checked = True
        self._prune(now)
        return checked

    def _prune(self, now: float) -> None:
        for check_id in [c for c, check in self.pending.items() if now - check.started_at > PENDING_S]:
            del self.pending[check_id]

    # --- samples and results ------------------------------------------------------------------------------------

    def on_message(self, conn, message: cm.VerifySample | cm.VerifyResult) -> None:
        check = self.pending.get(message.check)
        if check is None:
            return
        if isinstance(message, cm.VerifySample) and conn.id == check.fellow_id and check.claimed is None:
            self._run(check, message)
        elif isinstance(message, cm.VerifyResult) and conn.id == check.checker_id and check.claimed is not None:
            del self.pending[message.check]
            self._judge(check, message)

    def _run(self, check: Check, sample: cm.VerifySample) -> None:
        model = self.serving.models.get(check.model)
        checker = self.serving.hub.online.get(check.checker_id)
        if model is None or model.load_id != check.load_id or checker is None:
            self.pending.pop(sample.check, None)
            return
        check.claimed = sample.output
        check.path = sample.path
        plan = model.stages[check.index].plan
        checker.post(cm.VerifyRun(check.model, sample.check, plan.first_layer, plan.end_layer, check.rid,
                                  sample.passes, sample.inputs, sample.prompt_len, check.claimed, sample.final))

    def _judge(self, check: Check, result: cm.VerifyResult) -> None:
        if result.error or result.output is None:
            log.info("a check of stage %d of %s could not run: %s", check.index, check.model, result.error)
            return
        if result.path != check.path:  # honest fellows on other 4-bit kernels differ like a broken one
            checker = self.serving.hub.online.get(check.checker_id)
            self.mismatched[(check.model, check.index)] = (check.fellow_id, check.checker_id, (
                f"its checker {checker.name if checker else 'standby'} computes 4 bits with {result.path}'s "
                f"kernel, the stage with {check.path}'s (honest fellows on the two differ as much as a broken one); "
                "give both the same SWARM_INT4_KERNEL"))
            log.warning("stage %d of %s is not checked: %s", check.index, check.model,
                        self.mismatched[(check.model, check.index)][2])
            return
        try:
            diff = difference(check.claimed or {}, result.output)
        except (ProtocolError, KeyError, TypeError, ValueError) as exc:  # the checked fellow's sample did not decode
            log.info("a checked pass of stage %d of %s did not decode: %s", check.index, check.model, exc)
            diff = float("inf")
        self.checks += 1
        key = (check.model, check.index, check.fellow_id)
        if self.metrics is not None:
            self.metrics.verify_checks.labels(check.model, str(check.index)).inc()
        if diff <= check.tolerance:
            self.largest_honest = max(self.largest_honest, diff)
            self.strikes.pop(key, None)
            self.recheck.discard(key)
            served = self.served.get(key)
            while served and served[0][0] < check.started_at:  # served before the good check's request
                served.popleft()
            return
        self.failures += 1
        conn = self.serving.hub.online.get(check.fellow_id)
        name = conn.name if conn is not None else f"fellow {check.fellow_id}"
        if self.metrics is not None:
            self.metrics.verify_failures.labels(check.model, str(check.index), name).inc()
        strikes = self.strikes[key] = self.strikes.get(key, 0) + 1
        if strikes < 2:
            self.recheck.add(key)
            log.warning("%s is suspect: stage %d of %s differs from its check by %.3g (tolerance %.3g); checking "
                        "it again", name, check.index, check.model, diff, check.tolerance)
            return
        self._remove(check, name, diff)

    def _remove(self, check: Check, name: str, diff: float) -> None:
        key = (check.model, check.index, check.fellow_id)
        self.strikes.pop(key, None)
        self.recheck.discard(key)
        served = list(self.served.pop(key, ()))
        text = (f"{name} computed stage {check.index} of {check.model} wrongly twice (its output differs from "
                f"another fellow's by {diff:.3g}, tolerance {check.tolerance:.3g}): it is taken out of service. "
                f"{len(served)} request(s) went through it since its last good check; check the fellow's hardware "
                "and build before it serves again.")
        log.warning("%s", text)
        self.alerts.append({"at": time.time(), "fellow": name, "fellow_id": check.fellow_id, "model": check.model,
                            "stage": check.index, "difference": diff, "tolerance": check.tolerance, "message": text,
                            "requests": [{"id": rid, "user_id": user} for _, rid, user in served]})
        for c in [c for c, p in self.pending.items() if p.fellow_id == check.fellow_id]:
            del self.pending[c]
        model = self.serving.models.get(check.model)
        if model is None or model.load_id != check.load_id:
            return
        slot = model.slot_of(check.fellow_id)
        for s in model.stages:
            s.failed_on.add(check.fellow_id)  # none of this model's stages goes back to it
        conn = self.serving.hub.online.get(check.fellow_id)
        if conn is not None:
            conn.post(cm.Unload(model.name))
        if slot is not None:
            self.serving.recovery.take_out(model, slot, f"stage {slot.plan.index} of {model.name} on {name} "
                                                          "failed its checks")

    # --- checkers -----------------------------------------------------------------------------------------------

    async def cover(self, model: ModelServing) -> None:
        """While checks are on, keep a hot cover of every stage that a standby has room for: they are the checkers."""
        if self.fraction <= 0 or model.status != ModelStatus.READY:
            return
        covered = {s.plan.index for s in model.stages if s.cover is not None}
        while await self.serving.recovery.place_cover(model, covered, "a copy to check it"):
            covered = {s.plan.index for s in model.stages if s.cover is not None}
            await trio.lowlevel.checkpoint()

    async def cover_all(self) -> None:
        for model in list(self.serving.models.values()):
            await self.cover(model)

    def view(self) -> dict:
        """The admin's view: the fraction, the counts, suspects and alerts."""
        online = self.serving.hub.online if self.serving.hub is not None else {}
        return {"fraction": self.fraction, "forced_by_env": bool(self.serving.settings.serve_verify),
                "checks": self.checks, "failures": self.failures, "pending": len(self.pending),
                "largest_honest_difference": self.largest_honest,
                "suspects": [{"model": m, "stage": i, "fellow_id": f,
                              "fellow": online[f].name if f in online else f"fellow {f}"}
                             for m, i, f in sorted(self.recheck)],
                "alerts": list(self.alerts), "unchecked": self.unchecked()}

    def unchecked(self) -> list[dict]:
        """The stages of the serving models that nothing checks while checks are on, each with why and what to do."""
        if self.fraction <= 0 or self.serving.hub is None:
            return []
        online = self.serving.hub.online
        out = []
        for model in list(self.serving.models.values()):
            if model.status != "ready":
                continue
            for slot in model.stages:
                why = _no_checker(model, slot, online)
                mismatch = self.mismatched.get((model.name, slot.plan.index))
                if not why and mismatch is not None and mismatch[:2] == (slot.plan.fellow_id, slot.cover):
                    why = mismatch[2]
                if why:
                    out.append({"model": model.name, "stage": slot.plan.index,
                                "message": f"no checker for stage {slot.plan.index} of {model.name}: {why}"})
        return out


def _on_gpu(conn) -> bool:
    """Whether the fellow computes its stages on a GPU (it has one: fellows take the GPU by default)."""
    return bool(conn.hardware.gpus)


def _no_checker(model: ModelServing, slot, online: dict) -> str:
    """Why nothing checks ``slot`` (empty when its checker is there and fits it)."""
    if slot.cover is None:
        return (f"no standby has room for a copy of it (it needs {slot.plan.need_bytes / 1e9:.1f} GB; each standby "
                "holds one copy); add a standby (swarm join --standby) with that much free memory")
    checker, conn = online.get(slot.cover), online.get(slot.plan.fellow_id)
    if checker is None or conn is None:
        return "its checker is offline; checks resume when a standby holds a copy again"
    if not slot.cover_ready:
        return f"its checker {checker.name} is still loading the copy"
    if tolerance(model.quantization, _on_gpu(conn), _on_gpu(checker)) is None:
        return (f"its checker {checker.name} and {conn.name} compute {model.quantization} on different devices (a CPU "
                "and a GPU hold different quantized weights); add a standby of the same kind of device")
    return ""
