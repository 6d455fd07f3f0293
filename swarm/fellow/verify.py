"""A fellow's side of the leader's spot checks (swarm.leader.serving.verify): as the checked stage, and as the checker.

Checked: the leader names a request and the positions of the passes it will check (``verify_pick``, before the
request reaches this stage). The stage keeps a copy of what goes into its layers for that request only, and once a
picked pass is computed it sends the leader the inputs from position 0 up to that pass, cut as it ran them, with that
pass's output (``verify_sample``). The copy is taken from the pass's own input and output, after the pass: the reply
does not wait for it.

Checker: ``verify_run`` carries such a sample; the fellow runs it through its own copy of the same layers (a hot
cover, or the same stage of another ring) on a throwaway cache, in the compute thread between the ring's passes
(swarm.stage.recompute), and answers ``verify_result``.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math

import trio

from swarm import wire
from swarm.control_messages import VerifyResult, VerifyRun, VerifySample
from swarm.errors import SwarmError
from swarm.fellow import compute

log = logging.getLogger(__name__)

MAX_REPLAYS = 16  # checked requests a checker keeps a replayed cache of at once; an older one's next check fails
MAX_PICKED = 1024  # requests one stage keeps inputs for at once; older picks are dropped (a leader's bug or flood)


@dataclasses.dataclass
class _Record:
    checks: dict[int, str]  # picked position -> the leader's check id
    passes: list[list[int]] = dataclasses.field(default_factory=list)
    inputs: list = dataclasses.field(default_factory=list)  # token id lists (stage 0) or (1, n, hidden) tensors
    sent: int = 0  # passes whose inputs went with an earlier sample (the checker replays the request as it goes)


class StageAudits:
    """The requests a stage was asked to keep inputs for, and their samples once the picked passes ran."""

    def __init__(self, model: str, stage_model=None):
        self.model = model
        self.stage_model = stage_model
        self.records: dict[str, _Record] = {}

    def pick(self, rid: str, picks: list) -> None:
        checks = {int(pos): str(check) for pos, check in picks}
        if len(self.records) >= MAX_PICKED:
            self.records.pop(next(iter(self.records)))
        self.records[rid] = _Record(checks)

    def forget(self, rid: str) -> None:
        self.records.pop(rid, None)

    def clear(self) -> None:
        self.records.clear()

    def before(self, batch: list) -> None:
        """Copy the inputs of the picked requests' work in ``batch`` (called before the pass runs)."""
        if not self.records:
            return
        try:
            self._before(batch)
        except Exception:  # a check gone wrong must never cost the ring its pass
            log.exception("could not keep the inputs of a checked pass")
            self.clear()

    def _before(self, batch: list) -> None:
        for work in batch:
            record = self.records.get(work.rid)
            if record is None:
                continue
            if (record.passes[-1][0] + record.passes[-1][1] if record.passes else 0) != work.pos:
                self.forget(work.rid)  # it did not run from position 0 here (picked late): nothing to check
                continue
            record.passes.append([work.pos, work.n])
            if work.ids is not None:
                record.inputs.append(list(work.ids))
            else:
                rows = work.rows
                record.inputs.append(rows.source.tensor()[:, rows.row : rows.row + rows.n].clone())

    def after(self, batch: list, output, is_last: bool) -> list[VerifySample]:
        """The samples of the picked passes in ``batch``, computed into ``output``
        (swarm.stage.protocol_records.Output)."""
        if not self.records or not any(w.rid in self.records for w in batch):
            return []
        try:
            return self._after(batch, output, is_last)
        except Exception:  # a check gone wrong must never cost the ring its pass: logged, the check dropped
            log.exception("could not sample a checked pass")
            self.clear()
            return []

    def _after(self, batch: list, output, is_last: bool) -> list[VerifySample]:
        from swarm.stage.quantize import int4_path  # a stage is loaded here: torch is in already

        # the stage's 4-bit kernel: the leader judges it only against a checker on the same one
        path = int4_path(self.stage_model) if self.stage_model is not None else None
        samples = []
        hidden = wire.tensor_from_wire(output.hidden) if output.hidden is not None else None
        row = 0
        for i, work in enumerate(batch):
            record = self.records.get(work.rid)
            start, row = row, row + work.n
            if record is None or not record.passes or record.passes[-1][0] != work.pos:
                continue
            due = [pos for pos in record.checks if work.pos <= pos < work.pos + work.n]
            if not due:
                continue
            if is_last:
                token = output.tokens[i] if output.tokens is not None else None
                if not isinstance(token, int):
                    continue  # a prompt chunk that draws nothing: no output to check
                claimed: dict = {"token": token}
            else:
                assert hidden is not None  # a stage before the last passes its hidden states on
                claimed = {"hidden": wire.tensor_to_wire(hidden[:, start : start + work.n])}
            inputs = _inputs(record)
            ids = [record.checks.pop(pos) for pos in due]  # several only where passes are not where the leader
            # thought (the others are forgotten there)
            samples.append(VerifySample(self.model, ids[0], work.rid, [list(p) for p in record.passes[record.sent:]],
                                        inputs, work.request.start.prompt_len, claimed, final=not record.checks,
                                        path=path))
            record.sent, record.inputs = len(record.passes), []
            if not record.checks:
                self.forget(work.rid)
        return samples


def _inputs(record: _Record):
    if isinstance(record.inputs[0], list):
        return [token for ids in record.inputs for token in ids]
    import torch  # a stage is loaded here: torch is in already

    return wire.tensor_to_wire(torch.cat(record.inputs, dim=1))


class Checker:
    """This fellow as a checker: the leader's ``verify_run`` messages, recomputed one at a time in the order they
    came (a request's samples build on each other: each carries only the inputs since the last), keeping a replayed
    copy of each checked request's cache until its last sample (at most MAX_REPLAYS at once)."""

    def __init__(self, fellow):
        self.fellow = fellow
        self._send: trio.MemorySendChannel[VerifyRun] | None = None
        self.replays: collections.OrderedDict[tuple[str, str], None] = collections.OrderedDict()

    def submit(self, message: VerifyRun) -> None:
        if self._send is None:
            self._send, receive = trio.open_memory_channel[VerifyRun](math.inf)
            self.fellow.nursery.start_soon(self._work, receive)
        self._send.send_nowait(message)

    async def _work(self, receive: trio.MemoryReceiveChannel[VerifyRun]) -> None:
        async for message in receive:
            answer = await self._check(message)
            try:
                await self.fellow.send_to_leader(answer)
            except SwarmError as exc:
                log.warning("could not send a check's result to the leader: %s", exc)

    async def _check(self, message: VerifyRun) -> VerifyResult:
        from swarm.stage.recompute import recompute  # torch: imported once a check comes

        stage = self.fellow.stages.get(message.model)
        if stage is None or (stage.first_layer, stage.end_layer) != (message.first_layer, message.end_layer):
            return VerifyResult(message.check, error=f"{self.fellow.name} does not hold layers "
                                                     f"{message.first_layer}-{message.end_layer}")
        stage_model = stage.driver.stage_model
        key = (message.model, message.rid)
        keep = not message.final
        self.replays.pop(key, None)
        if keep:
            self.replays[key] = None
            while len(self.replays) > MAX_REPLAYS:
                model, rid = self.replays.popitem(last=False)[0]
                if model in self.fellow.stages:
                    self.fellow.stages[model].driver.stage_model.drop("verify-" + rid)
        from swarm.stage.quantize import int4_path

        path = int4_path(stage_model)
        claimed = message.output.get("token")
        try:
            output = await compute.run(recompute, stage_model, "verify-" + key[1], message.passes, message.inputs,
                                       message.prompt_len, claimed, keep)
        except Exception as exc:  # noqa: BLE001 - a check that cannot run says why; the fellow goes on serving
            self.replays.pop(key, None)
            return VerifyResult(message.check, path=path, error=f"{type(exc).__name__}: {exc}")
        return VerifyResult(message.check, output, path)
