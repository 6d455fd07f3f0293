"""Chat traffic for holding tests and the soak bench: many clients at once through the OpenAI API, each behaving as
a real one might -- reading a whole reply or a stream, cancelling mid-reply, going away without a word, reading
slowly -- and a tally of what came back.

Every greedy reply that was read in full (or in part, before a cancel) is compared with transformers' ``generate``
on the same prompt, with the near-tie rule of tests/exactness.py: a reply may leave generate's only at a step where
generate's own top two logits were within ``tol``. A request is *lost* when it got neither an answer nor a refusal
before the client's own deadline: there must be none.

Used by tests/test_holding.py (a burst and two minutes of mixed traffic) and bench/soak.py (minutes to an hour).
"""

from __future__ import annotations

import dataclasses
import json
import random
import statistics
import time
from pathlib import Path

import httpx
import psutil
import trio

WORDS = ("the lighthouse keeper wrote down every ship that passed the rocks at night and every storm that came in "
         "from the west while the town below slept and the harbour bells rang for the fishing boats").split()

# what a client does with its request, and how often
KINDS = {"whole": 0.3, "stream": 0.3, "cancel": 0.15, "vanish": 0.1, "slow": 0.15}


def prompt_text(tokenizer, target: int, seed: int) -> str:
    """A user message of about ``target`` tokens (a question, then notes to read)."""
    rng = random.Random(seed)
    head = f"Question {seed}: what did the keeper see? Answer in one line. Notes:"
    words = [head]
    while len(tokenizer.encode(" ".join(words))) < target:
        words.extend(rng.choice(WORDS) for _ in range(8))
    return " ".join(words)


@dataclasses.dataclass
class Prompt:
    messages: list[dict]
    ids: list[int]  # through the chat template, as the leader encodes it
    want: list[int]  # generate's greedy reply
    margins: list[float]  # generate's top-1 minus top-2 logit at each step
    text_ends: list[int]  # len(decode(want[:i+1])) for each i: where each token's text ends


def build_prompts(model_dir: Path, lengths: list[int], max_tokens: int, eos: list[int]) -> list[Prompt]:
    """The prompts and generate's replies to them (the reference model in float32, as the ring computes)."""
    import torch

    from exactness import reference
    from reference_model import load_reference_model
    from swarm.leader.chat.chat_format import encode_chat, load_tokenizer

    tokenizer = load_tokenizer(str(model_dir))
    model = load_reference_model(model_dir, dtype=torch.float32)
    prompts = []
    for i, length in enumerate(lengths):
        messages = [{"role": "user", "content": prompt_text(tokenizer, length, i)}]
        ids = encode_chat(model_dir, messages, None)
        want, margins = reference(model, ids, max_tokens, eos=eos)
        ends = [len(tokenizer.decode(want[: j + 1], skip_special_tokens=True)) for j in range(len(want))]
        prompts.append(Prompt(messages, ids, want, margins, ends))
    return prompts


@dataclasses.dataclass
class Outcome:
    kind: str
    prompt: int
    status: str  # done | cancelled | vanished | refused:<code> | failed:<code> | lost
    exact: str = ""  # identical | prefix | near-tie | differs: <where>  ("" when nothing to compare)
    ttft_s: float | None = None
    latency_s: float | None = None
    tokens: int = 0


def compare(prompt: Prompt, text: str, tokenizer, tol: float = 1e-3, whole: bool = True) -> str:
    """identical / prefix (a cut-off reply that agrees so far) / near-tie at N / differs at N (...)."""
    want = tokenizer.decode(prompt.want, skip_special_tokens=True)  # as the API's text: no end-of-turn token
    if text == want:
        return "identical"
    if not whole and want.startswith(text):
        return "prefix"
    at = next((i for i, (a, b) in enumerate(zip(text, want)) if a != b), min(len(text), len(want)))
    step = next((i for i, end in enumerate(prompt.text_ends) if end > at), len(prompt.want) - 1)
    if step < len(prompt.margins) and prompt.margins[step] < tol:
        return f"near-tie at {step}"
    return f"differs at token {step} (char {at}): got {text[at:at + 30]!r}, want {want[at:at + 30]!r}"


class Traffic:
    """``clients`` clients send requests back to back until ``duration_s`` has passed (or ``requests`` in all)."""

    def __init__(self, url: str, token: str, model: str, prompts: list[Prompt], tokenizer, *, max_tokens: int,
                 seed: int = 1, kinds: dict[str, float] | None = None, deadline_s: float = 600):
        self.url, self.token, self.model = url, token, model
        self.prompts, self.tokenizer, self.max_tokens = prompts, tokenizer, max_tokens
        self.rng = random.Random(seed)
        self.kinds = kinds or KINDS
        self.deadline_s = deadline_s
        self.outcomes: list[Outcome] = []
        self.started = 0

    async def run(self, clients: int, *, duration_s: float | None = None, requests: int | None = None) -> None:
        limits = httpx.Limits(max_connections=clients * 2, max_keepalive_connections=clients)
        async with httpx.AsyncClient(base_url=self.url, limits=limits, timeout=self.deadline_s,
                                     headers={"authorization": f"Bearer {self.token}"}) as http:
            end = trio.current_time() + duration_s if duration_s is not None else None
            async with trio.open_nursery() as nursery:
                for _ in range(clients):
                    nursery.start_soon(self._client, http, end, requests)

    async def _client(self, http: httpx.AsyncClient, end: float | None, requests: int | None) -> None:
        while (end is None or trio.current_time() < end) and (requests is None or self.started < requests):
            self.started += 1
            kind = self.rng.choices(list(self.kinds), weights=list(self.kinds.values()))[0]
            index = self.rng.randrange(len(self.prompts))
            outcome = Outcome(kind, index, "lost")
            self.outcomes.append(outcome)
            with trio.move_on_after(self.deadline_s):
                await self._one(http, outcome, self.rng.random())

    async def _one(self, http: httpx.AsyncClient, outcome: Outcome, luck: float) -> None:
        prompt = self.prompts[outcome.prompt]
        body = {"model": self.model, "messages": prompt.messages, "temperature": 0, "max_tokens": self.max_tokens,
                "stream": outcome.kind in ("stream", "cancel", "slow")}
        t0 = time.perf_counter()
        if outcome.kind == "vanish":  # a whole reply asked for, then the client goes away without a word
            with trio.move_on_after(0.2 + 3 * luck):
                response = await http.post("/v1/chat/completions", json=body)
                self._whole(outcome, response, prompt, t0)
                return
            outcome.status = "vanished"
            return
        if not body["stream"]:
            response = await http.post("/v1/chat/completions", json=body)
            self._whole(outcome, response, prompt, t0)
            return
        stop_after = 1 + int(luck * self.max_tokens * 0.6) if outcome.kind == "cancel" else None
        text: list[str] = []
        async with http.stream("POST", "/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                await response.aread()
                self._refused(outcome, response)
                return
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                data = json.loads(line[6:])
                if "error" in data:
                    outcome.status = f"failed:{data['error'].get('code')}"
                    return
                delta = data["choices"][0]["delta"].get("content") or ""
                if delta:
                    outcome.ttft_s = outcome.ttft_s or time.perf_counter() - t0
                    outcome.tokens += 1
                    text.append(delta)
                if data["choices"][0].get("finish_reason"):
                    outcome.status = "done"
                if stop_after is not None and outcome.tokens >= stop_after:
                    outcome.status = "cancelled"
                    break
                if outcome.kind == "slow":
                    await trio.sleep(0.25)
        outcome.latency_s = time.perf_counter() - t0
        if outcome.status in ("done", "cancelled"):
            outcome.exact = compare(prompt, "".join(text), self.tokenizer, whole=outcome.status == "done")

    def _whole(self, outcome: Outcome, response: httpx.Response, prompt: Prompt, t0: float) -> None:
        if response.status_code != 200:
            self._refused(outcome, response)
            return
        data = response.json()
        outcome.status = "done"
        outcome.latency_s = time.perf_counter() - t0
        outcome.ttft_s = (data.get("swarm", {}).get("timing", {}).get("ttft_ms") or 0) / 1000 or None
        outcome.tokens = data["usage"]["completion_tokens"]
        outcome.exact = compare(prompt, data["choices"][0]["message"]["content"], self.tokenizer)

    @staticmethod
    def _refused(outcome: Outcome, response: httpx.Response) -> None:
        try:
            code = response.json()["error"]["code"]
        except (ValueError, KeyError, TypeError):
            code = str(response.status_code)
        outcome.status = (f"refused:{code}" if response.status_code in (413, 429)
                          else f"failed:{response.status_code}:{code}")

    # --- the tally ------------------------------------------------------------------------------------------------

    def tally(self) -> dict:
        by_status: dict[str, int] = {}
        for o in self.outcomes:
            by_status[o.status] = by_status.get(o.status, 0) + 1
        exact: dict[str, int] = {}
        for o in self.outcomes:
            if o.exact:
                key = o.exact.split(" at ")[0]
                exact[key] = exact.get(key, 0) + 1
        return {"requests": len(self.outcomes), "by_status": by_status, "exact": exact,
                "differs": [o.exact for o in self.outcomes if o.exact.startswith("differs")],
                "lost": sum(o.status == "lost" for o in self.outcomes),
                "failed": [o.status for o in self.outcomes if o.status.startswith("failed")],
                "tokens": sum(o.tokens for o in self.outcomes),
                "ttft_s": percentiles([o.ttft_s for o in self.outcomes if o.ttft_s is not None]),
                "latency_s": percentiles([o.latency_s for o in self.outcomes
                                          if o.latency_s is not None and o.status == "done"])}


def percentiles(values: list[float]) -> dict:
    if not values:
        return {"p50": None, "p95": None}
    values = sorted(values)
    return {"p50": round(statistics.median(values), 3), "p95": round(values[min(len(values) - 1,
                                                                                 int(0.95 * len(values)))], 3)}


def rss_mb(pids: dict[str, int]) -> dict[str, float]:
    """Resident memory of each named process, in MB."""
    out = {}
    for name, pid in pids.items():
        try:
            out[name] = round(psutil.Process(pid).memory_info().rss / 2**20, 1)
        except psutil.Error:
            out[name] = float("nan")
    return out
