"""One loaded stage inside a fellow: the ring protocol around swarm.stage's compute.

Messages (CBOR maps, see swarm.wire); every one carries the model, the request id ``rid`` and positions:

  leader -> stage 0   gen     {rid, prompt, max_tokens, sampling, eos}
  leader -> stage 0   cancel  {rid}
  stage i -> i+1      hidden  {rid, pos, last, x, meta?}   x = hidden states of one prompt chunk or one decode step
  last -> stage 0     token   {rid, pos, token, done}
  stage 0 -> ...      free    {rid}                        drop the request's KV cache (end, cancel, failure)
  last -> leader      tokens  {batches: [{rid, tokens, done, finish_reason}]}
  any -> leader       failed  {rid, message, streamed}

Stage 0 cuts the prompt into chunks of SWARM_SERVE_PREFILL_CHUNK tokens; the last stage samples only after the last
chunk, sends each token straight back to stage 0 for the next step and, in batches, to the leader for streaming.
KV caches are kept per request, so several requests may be in the ring at once.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Awaitable, Callable

import torch
import trio

from swarm import wire
from swarm.errors import SwarmError
from swarm.mesh.hop import OutgoingHop
from swarm.stage.sampling import SamplingParams, make_generator, sample

log = logging.getLogger(__name__)


@dataclasses.dataclass
class RequestMeta:
    rid: str
    prompt_len: int
    max_tokens: int
    eos: frozenset[int]
    sampling: SamplingParams
    generated: int = 0
    generator: torch.Generator | None = None

    def to_wire(self) -> dict:
        s = self.sampling
        return {
            "prompt_len": self.prompt_len,
            "max_tokens": self.max_tokens,
            "eos": sorted(self.eos),
            "sampling": {"temperature": s.temperature, "top_k": s.top_k, "top_p": s.top_p, "min_p": s.min_p,
                         "seed": s.seed},
        }

    @classmethod
    def from_wire(cls, rid: str, data: dict) -> RequestMeta:
        s = data.get("sampling") or {}
        params = SamplingParams(
            temperature=float(s.get("temperature", 0.0)),
            top_k=int(s.get("top_k") or 0),
            top_p=float(s.get("top_p", 1.0) if s.get("top_p") is not None else 1.0),
            min_p=float(s.get("min_p") or 0.0),
            seed=int(s["seed"]) if s.get("seed") is not None else None,
        )
        meta = cls(rid, int(data["prompt_len"]), int(data["max_tokens"]), frozenset(int(t) for t in data["eos"]),
                   params)
        if not params.greedy:
            meta.generator = make_generator(params)  # on the CPU: logits are moved there to sample
        return meta


class StageRuntime:
    """Runs one stage of one model: an inbox of ring messages, worked through in order by one task."""

    def __init__(
        self,
        *,
        model: str,
        index: int,
        num_stages: int,
        stage_model,
        out_hop: OutgoingHop | None,
        send_to_leader: Callable[[dict], Awaitable[None]],
        prefill_chunk: int,
    ):
        self.model = model
        self.index = index
        self.num_stages = num_stages
        self.is_first = index == 0
        self.is_last = index == num_stages - 1
        self.stage_model = stage_model
        self.out_hop = out_hop
        self._send_to_leader = send_to_leader
        self.prefill_chunk = prefill_chunk
        self.inbox_send, self._inbox = trio.open_memory_channel[dict](10_000)
        self.requests: dict[str, RequestMeta] = {}
        self._streamed: dict[str, int] = {}  # stage 0: tokens seen per request (to tell "before first token")
        self._pending: dict[str, dict] = {}  # last stage: tokens waiting for the next batch to the leader
        self._pending_event = trio.Event()
        self.last_used = trio.current_time()

    # --- entry points ---------------------------------------------------------------------------------------------

    async def deliver(self, message: dict) -> None:
        self.last_used = trio.current_time()
        await self.inbox_send.send(message)

    async def run(self, task_status=trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            if self.is_last:
                nursery.start_soon(self._token_sender)
            task_status.started()
            async for message in self._inbox:
                try:
                    await self._handle(message)
                except SwarmError as exc:
                    await self._fail(message.get("rid"), str(exc))
                except Exception as exc:  # a bug in one request must not take the stage down
                    log.exception("stage %s of %s failed a request", self.index, self.model)
                    await self._fail(message.get("rid"), f"stage {self.index} failed: {type(exc).__name__}: {exc}")

    # --- message handling -----------------------------------------------------------------------------------------

    async def _handle(self, message: dict) -> None:
        kind = message["t"]
        rid = message.get("rid")
        if kind == "gen":
            await self._start(message)
        elif kind == "cancel":
            if rid in self.requests:
                await self._finish_everywhere(rid)
        elif kind == "hidden":
            await self._on_hidden(message)
        elif kind == "token":
            await self._on_token(message)
        elif kind == "free":
            self._drop(rid)
            if not self.is_last and self.out_hop is not None and not self.is_first:
                await self._send_next({"t": "free", "rid": rid})
        else:
            log.warning("stage %s ignored an unknown ring message %r", self.index, kind)

    async def _start(self, message: dict) -> None:
        rid = message["rid"]
        prompt = [int(t) for t in message["prompt"]]
        meta = RequestMeta.from_wire(rid, {**message, "prompt_len": len(prompt)})
        self.requests[rid] = meta
        self._streamed[rid] = 0
        await trio.to_thread.run_sync(self.stage_model.new_request, rid)
        chunks = math.ceil(len(prompt) / self.prefill_chunk)
        for c in range(chunks):
            if rid not in self.requests:
                return  # cancelled while prefilling
            pos = c * self.prefill_chunk
            ids = torch.tensor([prompt[pos : pos + self.prefill_chunk]], dtype=torch.long)
            last = c == chunks - 1
            await self._compute_and_pass(meta, pos, last, input_ids=ids, first_chunk=(c == 0))

    async def _on_hidden(self, message: dict) -> None:
        rid = message["rid"]
        meta = self.requests.get(rid)
        if meta is None:
            if message["pos"] != 0 or "meta" not in message:
                return  # a late message of a request that ended: nothing to do
            meta = RequestMeta.from_wire(rid, message["meta"])
            self.requests[rid] = meta
            await trio.to_thread.run_sync(self.stage_model.new_request, rid)
        hidden = wire.tensor_from_wire(message["x"])
        await self._compute_and_pass(meta, int(message["pos"]), bool(message["last"]), hidden=hidden,
                                     first_chunk=message["pos"] == 0 and "meta" in message)

    async def _compute_and_pass(self, meta, pos, last, *, input_ids=None, hidden=None, first_chunk=False):
        rid = meta.rid
        want_logits = self.is_last and last
        out = await trio.to_thread.run_sync(
            lambda: self.stage_model.forward(rid, pos, input_ids=input_ids, hidden=hidden, want_logits=want_logits)
        )
        n = (input_ids if input_ids is not None else hidden).shape[1]
        if not self.is_last:
            msg = {"t": "hidden", "rid": rid, "pos": pos, "last": last, "x": wire.tensor_to_wire(out)}
            if first_chunk:
                msg["meta"] = meta.to_wire()
            await self._send_next(msg)
            return
        if not last:
            return  # an intermediate prompt chunk: the cache is filled, nothing to sample yet
        token = await trio.to_thread.run_sync(sample, out.cpu(), meta.sampling, meta.generator)
        meta.generated += 1
        finish = None
        if token in meta.eos:
            finish = "stop"
        elif meta.generated >= meta.max_tokens:
            finish = "length"
        self._queue_for_leader(rid, token, finish)
        if finish is not None:
            self._drop(rid)
        token_msg = {"t": "token", "rid": rid, "pos": pos + n, "token": token, "done": finish is not None}
        if self.is_first:
            await self._on_token(token_msg)
        else:
            await self._send_next(token_msg)

    async def _on_token(self, message: dict) -> None:
        rid = message["rid"]
        meta = self.requests.get(rid)
        if meta is None:
            return  # cancelled: the token arrived after the request was dropped
        self._streamed[rid] = self._streamed.get(rid, 0) + 1
        if message["done"]:
            await self._finish_everywhere(rid, already_dropped_at_last=True)
            return
        ids = torch.tensor([[int(message["token"])]], dtype=torch.long)
        await self._compute_and_pass(meta, int(message["pos"]), True, input_ids=ids)

    # --- endings --------------------------------------------------------------------------------------------------

    def _drop(self, rid: str | None) -> None:
        if rid is None:
            return
        self.requests.pop(rid, None)
        self._streamed.pop(rid, None)
        self.stage_model.drop(rid)

    async def _finish_everywhere(self, rid: str, already_dropped_at_last: bool = False) -> None:
        """Stage 0 ends a request: drop its cache here and tell the stages after it to drop theirs."""
        self._drop(rid)
        if self.num_stages > 1 and not (already_dropped_at_last and self.num_stages == 2):
            try:
                await self._send_next({"t": "free", "rid": rid})
            except SwarmError:
                pass  # the link is gone; the stages after it drop their caches when they are unloaded

    async def _fail(self, rid: str | None, text: str) -> None:
        if rid is None:
            return
        streamed = self._streamed.get(rid, 0)
        self._drop(rid)
        try:
            await self._send_to_leader({"t": "failed", "model": self.model, "rid": rid, "message": text,
                                        "streamed": streamed, "stage": self.index})
        except SwarmError:
            pass

    async def _send_next(self, message: dict) -> None:
        message["model"] = self.model
        if self.out_hop is None:
            raise SwarmError(f"stage {self.index} of {self.model} has no link to the next stage")
        await self.out_hop.send(wire.encode(message))

    # --- streaming to the leader ----------------------------------------------------------------------------------

    def _queue_for_leader(self, rid: str, token: int, finish: str | None) -> None:
        batch = self._pending.setdefault(rid, {"rid": rid, "tokens": [], "done": False, "finish_reason": None})
        batch["tokens"].append(token)
        if finish is not None:
            batch["done"] = True
            batch["finish_reason"] = finish
        self._pending_event.set()

    async def _token_sender(self) -> None:
        """Posts whatever piled up while the previous post was on its way, so the leader's round trip never limits
        how fast a reply streams."""
        while True:
            await self._pending_event.wait()
            self._pending_event = trio.Event()
            batches, self._pending = list(self._pending.values()), {}
            if batches:
                try:
                    await self._send_to_leader({"t": "tokens", "model": self.model, "batches": batches})
                except SwarmError as exc:
                    log.warning("could not send tokens to the leader: %s", exc)
