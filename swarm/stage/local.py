"""A whole ring in one process: stages chained by function calls.

The reference for what the networked ring must do (prefill in chunks, hidden states forward, the sampled token back
to stage 0), used by tests and benchmarks.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

import torch

from swarm.errors import ModelError
from swarm.stage.sampling import GREEDY, SamplingParams, make_generator, sample
from swarm.stage.slice import StageModel


class LocalChain:
    def __init__(self, stages: Sequence[StageModel]) -> None:
        if not stages or not stages[0].spec.is_first or not stages[-1].spec.is_last:
            raise ModelError("a chain needs stages from the first to the last")
        self.stages = list(stages)

    def step(self, rid: str, position: int, ids: Sequence[int], want_logits: bool = True) -> torch.Tensor | None:
        """Pass one chunk of token ids through every stage; the last stage's logits (or None)."""
        out: torch.Tensor | None = torch.tensor([list(ids)], dtype=torch.long)
        out = self.stages[0].forward(rid, position, input_ids=out, want_logits=want_logits)
        for stage in self.stages[1:]:
            out = stage.forward(rid, position, hidden=out, want_logits=want_logits)
        return out

    def stream(
        self,
        prompt: Sequence[int],
        max_new_tokens: int,
        params: SamplingParams = GREEDY,
        prefill_chunk: int = 256,
        eos_token_ids: Iterable[int] = (),
        rid: str = "local",
    ) -> Iterator[int]:
        """Yield new tokens one by one; stops after an end-of-sequence token (which is yielded) or max_new_tokens."""
        eos = set(eos_token_ids)
        generator = make_generator(params)
        for stage in self.stages:
            stage.new_request(rid)
        try:
            logits = None
            for start in range(0, len(prompt), prefill_chunk):
                chunk = prompt[start : start + prefill_chunk]
                logits = self.step(rid, start, chunk, want_logits=start + len(chunk) == len(prompt))
            position = len(prompt)
            for produced in range(max_new_tokens):
                token = sample(logits, params, generator)
                yield token
                if token in eos or produced + 1 == max_new_tokens:
                    return
                logits = self.step(rid, position, [token])
                position += 1
        finally:
            for stage in self.stages:
                stage.drop(rid)

    def generate(self, prompt: Sequence[int], max_new_tokens: int, **kwargs) -> list[int]:
        return list(self.stream(prompt, max_new_tokens, **kwargs))
