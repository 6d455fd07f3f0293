"""The typed messages swarm processes send each other (encoded and checked by swarm.wire).

  leader -> stage 0        Generate, Cancel
  stage i -> stage i+1     Hidden (hidden states of prompt chunks and decode steps), Free (drop caches)
  last stage -> stage 0    Sampled (the next token of each request, for its next decode step)
  last stage -> leader     Tokens (batches of sampled tokens, for streaming)
  any stage -> leader      Failed; StageTimes (where a request's time went there, once the stage drops it)
  a fellow -> leader       HopLost (a path under requests in flight broke)
  fellow -> leader         Hardware, in its hello and heartbeats
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any

from swarm.wire import from_map, message, record, to_map


@record
class Sampling:
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    # OpenAI's penalties over the reply so far, and transformers' over prompt and reply (1.0: off); the last stage
    # applies them before the filters above.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None  # None: none; else the sampled token's log-probability and this many alternatives
    prompt_logprobs: int | None = None  # the same for every prompt token after the first (the model's own)
    grammar: str | None = None  # an llguidance grammar the reply must follow (response_format); None: free text
    think: list[int] | None = None  # a reasoning model's [<think>, </think>] ids: the grammar starts after thinking
    bias_ids: list[int] = dataclasses.field(default_factory=list)  # logit_bias: added to these tokens' logits
    bias_values: list[float] = dataclasses.field(default_factory=list)

    @property
    def penalised(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    @property
    def needs_context(self) -> bool:
        """Whether the last stage needs the prompt's ids (RequestStart.context)."""
        return self.penalised or self.prompt_logprobs is not None or self.grammar is not None


@record
class PrefixPlan:
    """The leader's word on the prefix cache for one request (swarm.leader.serving.prefix_index decides, every stage
    obeys, so all stages hold the same blocks). A block is ``block`` prompt tokens, named by a hash chained over every
    token before it: the KV of block i is the same wherever a prompt starts with the same i + 1 blocks."""

    epoch: int  # the leader's cache generation: a stage holding another one forgets its blocks first
    block: int  # tokens per block
    reuse: list[bytes] = dataclasses.field(default_factory=list)  # the prompt's first blocks, held: not computed
    keep: list[bytes] = dataclasses.field(default_factory=list)  # blocks to keep once the prompt is computed...
    keep_at: list[int] = dataclasses.field(default_factory=list)  # ...and where each is in the prompt (block index)
    evict: list[bytes] = dataclasses.field(default_factory=list)  # blocks to forget (least recently used)
    # The reply's blocks: once the request ends with its last token (not a cancel, not a failure), each stage keeps up
    # to ``reply_blocks`` blocks from block prompt_len // block on -- the prompt's tail and the reply, whose KV the
    # stages computed while decoding -- named ``reply_key(i)``: the leader learns their tokens only at the end.
    reply: bytes = b""
    reply_blocks: int = 0

    @property
    def cached(self) -> int:
        """Prompt tokens the stages take from the cache."""
        return len(self.reuse) * self.block

    def reply_key(self, index: int) -> bytes:
        """What the stages name block ``index`` of a request's prompt and reply by (its tokens are not known yet)."""
        return hashlib.blake2b(self.reply + index.to_bytes(8, "little"), digest_size=16).digest()


@record
class RequestStart:
    """What every stage after the first learns with a request's first prompt chunk."""

    prompt_len: int
    max_tokens: int
    eos: list[int]
    sampling: Sampling
    drawn: int = 0  # tokens the reply had before this attempt (a request sent again after a failover)
    # The prompt's token ids, only for a request with penalties (the last stage counts the tokens they apply to);
    # its last ``drawn`` ids are the reply's so far.
    context: list[int] | None = None
    group: list[str] = dataclasses.field(default_factory=list)  # a group's carrier: its siblings' rids, as started
    draft: int = 0  # drafting ahead: the last stage may propose up to this many tokens per pass (0: off)
    prefix: PrefixPlan | None = None  # the prefix cache's plan for this request (None: it neither reuses nor keeps)

    @property
    def cached(self) -> int:
        """Where the request's computed prompt starts: the tokens its first blocks take from the prefix cache."""
        return self.prefix.cached if self.prefix is not None else 0


@record
class Sibling:
    """One of a group's requests (sampled choices of one prompt): its ring id and its own sampling seed."""

    rid: str
    seed: int | None = None


@message("gen")
class Generate:
    model: str
    rid: str
    prompt: list[int]
    max_tokens: int
    eos: list[int]
    sampling: Sampling
    drawn: int = 0  # tokens the reply had before this attempt: the prompt ends with them
    # A group start: ``rid`` only carries the prompt's prefill, once on every stage; at its last chunk each stage
    # copies the prompt's KV cache to every sibling, which then samples and decodes on its own (its sampling is
    # ``sampling`` with the sibling's seed). Tokens, failures and cancels are the siblings', never ``rid``'s.
    siblings: list[Sibling] = dataclasses.field(default_factory=list)
    draft: int = 0  # drafting ahead (swarm.stage.drafting): tokens the last stage may propose per pass; 0: off
    prefix: PrefixPlan | None = None  # the prefix cache (swarm.leader.serving.prefix_index); never with siblings

    @property
    def rids(self) -> list[str]:
        """The ring ids whose replies this message starts."""
        return [s.rid for s in self.siblings] if self.siblings else [self.rid]


@message("cancel")
class Cancel:
    model: str
    rid: str


@record
class Part:
    """One request's rows in a Hidden message: ``n`` positions from ``pos``; ``last`` asks the last stage to sample
    after them (the prompt's last chunk, or a decode step)."""

    rid: str
    pos: int
    n: int
    last: bool
    start: RequestStart | None = None  # set on a request's first chunk
    siblings: list[Sibling] = dataclasses.field(default_factory=list)  # a group's last prompt chunk: who gets a copy


@message("hidden")
class Hidden:
    model: str
    parts: list[Part]
    x: dict  # a tensor (tensor_to_wire) of shape (1, sum of the parts' n, hidden size), rows in the parts' order


@record
class SampledToken:
    rid: str
    pos: int  # where the token goes: the position of the request's next decode step
    token: int
    done: bool
    # Drafting ahead: tokens the last stage guessed would follow ``token``; stage 0 runs them with it in one pass
    # (positions pos + 1, ...) and the last stage keeps those its model agrees with.
    draft: list[int] = dataclasses.field(default_factory=list)


@message("sampled")
class Sampled:
    model: str
    tokens: list[SampledToken]


@message("free")
class Free:
    model: str
    rids: list[str]
    # for requests that ended with their last token: its position, so many rows of each stage's cache are the
    # request's own (rows past it may be guessed tokens a pass rejected); stages keep the reply's blocks up to it
    ends: list[int] = dataclasses.field(default_factory=list)


@record
class TokenLogprob:
    """What the last stage tells of one sampled token when the request asked for logprobs: its log-probability and
    the most likely tokens' ids and log-probabilities, in the distribution it was drawn from."""

    logprob: float
    top_ids: list[int] = dataclasses.field(default_factory=list)
    top_logprobs: list[float] = dataclasses.field(default_factory=list)


@record
class TokenBatch:
    rid: str
    tokens: list[int]
    done: bool = False
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] = dataclasses.field(default_factory=list)  # one per token when asked for
    prompt_logprobs: list[TokenLogprob] = dataclasses.field(default_factory=list)  # prompt tokens 1, 2, ... in order


@message("tokens")
class Tokens:
    model: str
    batches: list[TokenBatch]


@message("stage_times")
class StageTimes:
    """Where one request's time went on one stage, sent to the leader when the stage drops the request (one message
    per stage per request, not one per token). Times are the stage's own clock; see swarm.stage.timing."""

    model: str
    rid: str
    stage: int
    prefill_s: float = 0.0  # compute of the prompt's chunks
    prefill_tokens: int = 0
    decode_s: float = 0.0  # compute of the decode steps (each step's whole pass, sampling included on the last stage)
    decode_steps: int = 0
    ring_s: float = 0.0  # stage 0 of several: from a decode step's hidden state leaving to its token coming back
    ring_steps: int = 0
    sent_bytes: int = 0  # what the stage sent on for the decode steps: hidden states, or the last stage's tokens
    sent_tokens: int = 0
    # The last stage, drafting ahead: passes that sampled (the prompt's last chunk and each decode step), the tokens
    # they gave, the tokens guessed and those kept; all 0 without drafting.
    spec_passes: int = 0
    spec_tokens: int = 0
    spec_drafted: int = 0
    spec_accepted: int = 0


@message("failed")
class Failed:
    model: str
    rid: str
    message: str
    stage: int | None = None
    not_loaded: bool = False


@message("hop_lost")
class HopLost:
    model: str
    hop_id: str
    path: str | None = None


# --- what a fellow reports of its machine ---------------------------------------------------------------------------


@record
class Gpu:
    index: int
    name: str
    total_bytes: int
    free_bytes: int
    # From NVML for the Performance column; None where the driver does not say (or the fellow predates them).
    load_percent: float | None = None
    power_w: float | None = None
    power_limit_w: float | None = None
    temperature_c: float | None = None


@record
class Hardware:
    cpu_cores: int
    ram_total_bytes: int
    ram_free_bytes: int
    gpus: list[Gpu] = dataclasses.field(default_factory=list)
    cpu_load_percent: float | None = None  # the whole machine's, since the previous report
    # The quantization kinds it can load, by device ("cpu", "cuda"); None from a fellow before quantized loads.
    quantization: dict[str, list[str]] | None = None

    def serving_free_bytes(self, device: str = "auto") -> int:
        """Memory a stage may use: the roomiest GPU's free memory, or free RAM when serving on the CPU."""
        if self.gpus and device != "cpu":
            return max(g.free_bytes for g in self.gpus)
        return self.ram_free_bytes

    def quantization_kinds(self, device: str = "auto") -> list[str] | None:
        """The kinds it loads on the device it serves on (as serving_free_bytes picks it); None when unreported."""
        if self.quantization is None:
            return None
        kinds = self.quantization.get("cuda" if self.gpus and device != "cpu" else "cpu")
        return [k for k in kinds if isinstance(k, str)] if isinstance(kinds, list) else []

    def to_wire(self) -> dict:
        return to_map(self)

    @classmethod
    def from_wire(cls, data: Any) -> Hardware:
        return from_map(cls, data, "hardware")

    def describe(self) -> str:
        if self.gpus:
            return ", ".join(f"{g.name} ({g.free_bytes / 1e9:.1f} GB free)" for g in self.gpus)
        return f"{self.cpu_cores} CPU cores, {self.ram_free_bytes / 1e9:.1f} GB RAM free"
