"""The first request's path, run once before a stage says it is loaded: a short prompt and a few decode steps through
:func:`swarm.stage.execute.run_batch` -- the function the fellow's driver calls for every pass -- with the sampling a
chat from the page uses, on the thread count a lone request gets.

Why, beyond :meth:`StageModel.warm_up` (a prompt chunk of 8 and one decode step through ``forward``): the first real
pass also meets its own prompt length, the thread count the driver sets, the head and the sampling filters on the last
stage, the wire tensor the next stage reads, and a draft model's guesses. Measured in one process on a 2-core CPU (the
built-in model over 2 stages, process CPU time per run_batch call, one thread): once ``StageModel.warm_up`` ran, the
first chat's passes already cost what later ones do (int4-fast: 44/52 ms for the 36-token prompt on the two stages,
5/11 ms a decode step, against 43-46/49-52 and 5/12-13 later; float32 64/80 against 65-67/76), so this pass is
insurance for the parts that warm-up skips, at the price of 4 short passes per stage at load. (What the first chat
after `swarm demo` did pay -- seconds -- was the fellows' calibration holding the compute thread:
swarm.fellow.calibration_process.)
"""

from __future__ import annotations

import torch

from swarm import messages, wire
from swarm.stage.protocol_records import Rows, RowSource, StageRequest, Work

WARM_UP_RID = "__warm_up_batch__"
PROMPT_TOKENS = 32  # about a short chat's prompt with its template
DECODE_STEPS = 3
# what a chat from the page samples with unless it says otherwise (the leader's defaults for most models)
SAMPLING = messages.Sampling(temperature=0.7, top_p=0.95, top_k=20, seed=0)


def warm_up_batch_path(stage, threads: int | None = None) -> int:
    """Run a prompt of PROMPT_TOKENS and DECODE_STEPS decode steps through ``stage``'s batch path, as one request
    the stage would serve; nothing of it is kept. Returns the passes run (``stage.warm_passes`` counts them too)."""
    from swarm.stage.execute import run_batch  # torch-heavy, as the driver imports it

    spec = stage.spec
    vocab = int(getattr(stage.config, "vocab_size", 0) or 0) or 2
    prompt = [(7 * i + 3) % vocab for i in range(PROMPT_TOKENS)]
    start = messages.RequestStart(PROMPT_TOKENS, DECODE_STEPS + 1, [], SAMPLING)
    request = StageRequest(WARM_UP_RID, prompt if spec.is_first else None, start)
    generator = torch.Generator().manual_seed(0)
    passes = 0
    stage.drop(WARM_UP_RID)
    try:
        pos, n = 0, PROMPT_TOKENS
        for _ in range(1 + DECODE_STEPS):
            if spec.is_first:
                ids = prompt if pos == 0 else [prompt[pos % PROMPT_TOKENS]]
                work = Work(request, pos, n, True, ids=ids)
            else:
                hidden = torch.randn((1, n, stage.config.hidden_size), generator=generator).to(stage.dtype)
                work = Work(request, pos, n, True, rows=Rows(RowSource(wire.tensor_to_wire(hidden)), 0, n))
            output = run_batch(stage, [work], threads)
            if spec.is_last:
                request.generated += 1
            elif output.hidden is not None:
                wire.tensor_from_wire(output.hidden)  # as the next stage decodes it
            passes += 1
            pos, n = pos + n, 1
    finally:
        stage.drop(WARM_UP_RID)
    stage.warm_passes = getattr(stage, "warm_passes", 0) + passes
    return passes
