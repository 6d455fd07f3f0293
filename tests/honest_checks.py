"""Honest spot checks in one process: a ring of stages serves made-up requests through the fellow's own batch path
(swarm.stage.execute.run_batch: prompt chunks, single and batched ragged decode steps, lean or compiled decode steps,
drafting's verifying passes of several rows), and a second copy of each stage, loaded on its own as a checker's is,
recomputes every pass the way a checker does (swarm.stage.recompute). Each recomputed pass is compared with the
leader's own function (swarm.leader.serving.verify.difference). tests/test_verify.py asserts that none is flagged;
bench/verify_bounds.py prints the figures the tolerances in swarm.leader.serving.verify come from."""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path

import torch

from swarm import messages, wire
from swarm.leader.serving.verify import difference
from swarm.stage import int4_kernel
from swarm.stage.execute import run_batch
from swarm.stage.protocol_records import Rows, RowSource, StageRequest, Work
from swarm.stage.recompute import recompute
from swarm.stage.slice import StageModel
from swarm.stage.slice_load import stage_specs

# kind -> (dtype, quantization): how a fellow may compute a stage on CPU (bfloat16 stands in for a GPU's 16 bits)
KINDS = {"float32": (torch.float32, "none"), "bfloat16": (torch.bfloat16, "none"), "int8": (torch.float32, "int8"),
         "nf4": (torch.float32, "nf4"), "int4-fast": (torch.float32, "int4-fast")}
CHUNK = 16  # prompt chunk rows: small, so that prompts take several chunks
GREEDY = messages.Sampling()


@dataclasses.dataclass
class Trace:
    """What one stage computed for one request, as the checked stage samples it (swarm.fellow.verify)."""

    prompt_len: int = 0
    passes: list[list[int]] = dataclasses.field(default_factory=list)
    inputs: list = dataclasses.field(default_factory=list)  # token id lists, or (1, n, hidden) tensors
    outputs: list = dataclasses.field(default_factory=list)  # {"hidden"} or {"token"}, or None (a chunk drawing none)
    paths: list[str] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class Check:
    kind: str
    stage: int
    path: str
    difference: float


def load_ring(model_dir: Path, kind: str, stages: int = 3) -> list[StageModel]:
    """The model's stages as fellows load them for ``kind``: quantized at load, lean decode checked by warm-up."""
    dtype, quantization = KINDS[kind]
    layers = json.loads((Path(model_dir) / "config.json").read_text())["num_hidden_layers"]
    ring = []
    for spec in stage_specs(layers, stages):
        stage = StageModel.load_dir(model_dir, spec, dtype=dtype, quantization=quantization)
        stage.warm_up()
        ring.append(stage)
    return ring


def _path(work: Work, batch: int) -> str:
    if work.prefill:
        return "prompt chunk"
    if work.n > 1:
        return "verifying pass"
    return "batched decode" if batch > 1 else "decode"


def serve(ring: list[StageModel], requests: int, rng: random.Random, vocab: int) -> list[list[Trace]]:
    """``requests`` made-up greedy requests through ``ring``, a few at a time in batches of changing make-up, as the
    driver runs them; each stage's trace per request."""
    traces = [[Trace() for _ in ring] for _ in range(requests)]
    state = []
    for i in range(requests):
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(3, 3 * CHUNK))]
        start = messages.RequestStart(len(prompt), 64, [], GREEDY)
        stage_requests = [StageRequest(f"r{i}", prompt if s.spec.is_first else None, start) for s in ring]
        state.append({"prompt": prompt, "pos": 0, "left": rng.randint(3, 20), "next": None, "reqs": stage_requests})
    active = list(range(requests))
    while active:
        batch = rng.sample(active, min(len(active), rng.choice((1, 1, 2, 3, 4))))
        pieces = []
        for i in batch:
            st = state[i]
            if st["pos"] < len(st["prompt"]):
                ids = st["prompt"][st["pos"] : st["pos"] + CHUNK]
            else:
                guesses = rng.randint(1, 3) if rng.random() < 0.2 else 0  # drafting: a pass verifying guesses
                ids = [st["next"]] + [rng.randrange(3, vocab) for _ in range(guesses)]
            pieces.append((i, st["pos"], ids))
        source = None
        for s, stage in enumerate(ring):
            works = []
            row = 0
            for i, pos, ids in pieces:
                request = state[i]["reqs"][s]
                last = pos + len(ids) >= len(state[i]["prompt"])
                if stage.spec.is_first:
                    works.append(Work(request, pos, len(ids), last, ids=list(ids)))
                else:
                    assert source is not None
                    works.append(Work(request, pos, len(ids), last, rows=Rows(source, row, len(ids))))
                row += len(ids)
            output = run_batch(stage, works)
            hidden = wire.tensor_from_wire(output.hidden) if output.hidden is not None else None
            row = 0
            for k, (i, pos, ids), work in zip(range(len(works)), pieces, works):
                trace = traces[i][s]
                trace.prompt_len = len(state[i]["prompt"])
                trace.passes.append([pos, len(ids)])
                trace.inputs.append(list(ids) if work.ids is not None else
                                    work.rows.source.tensor()[:, work.rows.row : work.rows.row + work.n].clone())
                trace.paths.append(_path(work, len(works)))
                if hidden is not None:
                    trace.outputs.append({"hidden": wire.tensor_to_wire(hidden[:, row : row + len(ids)])})
                else:
                    token = output.tokens[k] if output.tokens is not None else None
                    trace.outputs.append({"token": token} if isinstance(token, int) else None)
                    if isinstance(token, int):
                        state[i]["next"] = token
                        work.request.generated += 1
                row += len(ids)
            source = RowSource(output.hidden) if output.hidden is not None else None
        for i, pos, ids in pieces:
            st = state[i]
            st["pos"] = pos + len(ids)
            if st["pos"] > len(st["prompt"]):
                st["left"] -= 1
                if st["left"] <= 0:
                    active.remove(i)
                    for stage in ring:
                        stage.drop(f"r{i}")
    return traces


def check(checkers: list[StageModel], traces: list[list[Trace]], kind: str) -> list[Check]:
    """Every pass with an output recomputed by ``checkers`` as a checker replays a request (each check carries the
    passes since the last), and compared with the leader's difference."""
    found = []
    for r, per_stage in enumerate(traces):
        for s, (trace, checker) in enumerate(zip(per_stage, checkers)):
            since = 0
            for p, output in enumerate(trace.outputs):
                if output is None:
                    continue
                inputs = trace.inputs[since : p + 1]
                sent = ([t for ids in inputs for t in ids] if isinstance(inputs[0], list)
                        else wire.tensor_to_wire(torch.cat(inputs, dim=1)))
                keep = any(o is not None for o in trace.outputs[p + 1 :])
                result = recompute(checker, f"verify-r{r}", trace.passes[since : p + 1], sent, trace.prompt_len,
                                   output.get("token"), keep)
                found.append(Check(kind, s, trace.paths[p], difference(output, result)))
                since = p + 1
    return found


def honest_checks(model_dir: Path, kind: str, requests: int, seed: int = 0,
                  checker_kernel: bool = True) -> list[Check]:
    """Serve ``requests`` made-up requests on a ring of ``kind`` and check every pass on a second copy of it;
    ``checker_kernel`` False: the checker's 4-bit layers compute with torch's kernel instead of swarm's (a fellow with
    SWARM_INT4_KERNEL=0, or where it cannot be built)."""
    rng = random.Random(seed)
    vocab = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
    torch.manual_seed(seed)
    ring = load_ring(model_dir, kind)
    traces = serve(ring, requests, rng, vocab)
    del ring
    int4_kernel.use(checker_kernel)
    try:
        checkers = load_ring(model_dir, kind)
    finally:
        int4_kernel.use(True)
    return check(checkers, traces, kind if checker_kernel else f"{kind}, checker without swarm's kernel")


CHECKS_PER_REQUEST = 39  # measured: a made-up request of serve() gives about this many checks over 3 stages


def requests_for(checks: int) -> int:
    """The made-up requests that give about ``checks`` checks."""
    return max(1, -(-checks // CHECKS_PER_REQUEST))
