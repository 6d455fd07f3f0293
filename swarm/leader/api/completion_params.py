"""The parameters of the legacy POST /v1/completions (swarm.leader.api.completions), checked as OpenAI's and vLLM's:
a prompt (a text, token ids, or a batch of either), echo, logprobs, and the sampling the chat route takes
(swarm.leader.api.openai_params)."""

from __future__ import annotations

import dataclasses

from swarm.errors import BadRequest
from swarm.leader.api.openai_params import (
    MAX_CHOICES,
    MAX_TOP_LOGPROBS,
    PENALTY_KEYS,
    SAMPLING_KEYS,
    check_fields,
    parse_flag,
    parse_integer,
    parse_sampling,
    parse_stop,
)

COMPLETION_FIELDS = frozenset({
    "model", "prompt", "stream", "max_tokens", "echo", "logprobs", "stop", "n", "return_token_ids", "ignore_eos",
    "logit_bias", *SAMPLING_KEYS, *PENALTY_KEYS,
})
MAX_PROMPTS = 32  # prompts in one request (evaluation harnesses batch theirs)
DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's and vLLM's default for this route


@dataclasses.dataclass
class CompletionParams:
    """A validated legacy completion request."""

    model: str
    prompts: list  # each a text or a list of token ids
    stream: bool
    max_tokens: int  # 0: nothing generated (with echo and logprobs: the prompt's log-likelihood)
    echo: bool
    sampling: dict
    stop: list[str]
    n: int
    logprobs: int | None
    return_token_ids: bool = False
    ignore_eos: bool = False


def _token_ids(value) -> bool:
    return isinstance(value, list) and bool(value) and all(
        isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value)


def parse_completion_body(body: dict, max_tokens_limit: int) -> CompletionParams:
    body = check_fields(body, COMPLETION_FIELDS)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise BadRequest("'model' is required: one of the ids from GET /v1/models.", "missing_model")
    prompt = body.get("prompt")
    if isinstance(prompt, str) or _token_ids(prompt):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) or _token_ids(p) for p in prompt):
        prompts = list(prompt)
    else:
        raise BadRequest("'prompt' must be a text, a list of token ids, or a list of either.", "invalid_prompt")
    if len(prompts) > MAX_PROMPTS:
        raise BadRequest(f"'prompt' holds {len(prompts)} prompts; send at most {MAX_PROMPTS} at once.",
                         "invalid_prompt")
    if any(p == "" for p in prompts):
        raise BadRequest("'prompt' may not be empty.", "invalid_prompt")
    max_tokens = parse_integer(body, "max_tokens", 0, max_tokens_limit)
    n = parse_integer(body, "n", 1, MAX_CHOICES) or 1
    echo = body.get("echo", False)
    if not isinstance(echo, bool):
        raise BadRequest("'echo' must be true or false.", "invalid_echo")
    return CompletionParams(model, prompts, parse_flag(body, "stream"),
                            DEFAULT_COMPLETION_TOKENS if max_tokens is None else max_tokens, echo,
                            parse_sampling(body), parse_stop(body.get("stop")), n,
                            parse_integer(body, "logprobs", 0, MAX_TOP_LOGPROBS), parse_flag(body, "return_token_ids"),
                            parse_flag(body, "ignore_eos"))
