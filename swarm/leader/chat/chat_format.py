"""From OpenAI-style messages to token ids and back: the model's chat template, sampling defaults, streaming text.

Tokenisation happens on the leader; fellows see token ids only.
"""

from __future__ import annotations

import json
import logging
import threading
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

# Sampling defaults when a request leaves a parameter unset (the user's manual, Sampling): the Qwen values are the
# ones the Qwen model cards recommend; top_k 0 and min_p 0 mean off.
QWEN3_THINKING = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.0}
QWEN_NON_THINKING = {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "min_p": 0.0}
OTHER = {"temperature": 0.7, "top_p": 0.95, "top_k": 0, "min_p": 0.0}
# Qwen3's dense and mixture-of-experts models (Qwen3-30B-A3B, Qwen3-235B-A22B): the same sampling, the same switches
QWEN3 = ("qwen3", "qwen3_moe")
# OpenAI's reasoning_effort values; "none" and "minimal" turn an on/off switch off, the others on
EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")
HARMONY_EFFORTS = ("low", "medium", "high")  # gpt-oss's template's "Reasoning: ..." levels


def sampling_defaults(architecture: str, thinking: bool, name: str = "", generation_top_k: int | None = None) -> dict:
    """What a request leaves unset, per the user's manual's table. Qwen3's Instruct-2507 and Coder models, which do
    not think, get the thinking-off row; ``generation_top_k`` (a model served on one fellow keeps its own
    generation_config's top_k) fills the other models' top_k."""
    lowered = name.lower()
    if architecture in QWEN3:
        non_thinking = "2507" in lowered and "instruct" in lowered or "coder" in lowered
        return dict(QWEN3_THINKING if thinking and not non_thinking else QWEN_NON_THINKING)
    if architecture == "qwen2":
        return dict(QWEN_NON_THINKING)
    out = dict(OTHER)
    if generation_top_k:
        out["top_k"] = int(generation_top_k)
    return out


def generation_top_k(model_dir: Path) -> int | None:
    """The top_k of the model's own generation_config.json, when it has one."""
    path = Path(model_dir) / "generation_config.json"
    try:
        value = json.loads(path.read_text()).get("top_k")
    except (OSError, ValueError):
        return None
    return int(value) if isinstance(value, int) and not isinstance(value, bool) else None


def prompt_thinking(model_dir: Path, prompt: list[int]) -> str:
    """Where the prompt leaves the reply's thinking block (swarm.leader.chat.reasoning): OPENED when the chat template
    opened it (the reply starts inside it), CLOSED when it wrote an empty one (thinking off: GLM-4.5's prompt ends with
    it, and the reply starts with the template's line break before the answer), else ""."""
    from swarm.leader.chat.reasoning import CLOSE, CLOSED, OPEN, OPENED

    tail = load_tokenizer(str(model_dir)).decode(prompt[-4:], skip_special_tokens=False).rstrip()
    return OPENED if tail.endswith(OPEN) else CLOSED if tail.endswith(CLOSE) else ""


def prompt_opens_thinking(model_dir: Path, prompt: list[int]) -> bool:
    """Whether the chat template opened the thinking block in the prompt (the reply starts inside it)."""
    from swarm.leader.chat.reasoning import OPENED

    return prompt_thinking(model_dir, prompt) == OPENED


def think_tokens(model_dir: Path) -> list[int] | None:
    """The ids of <think> and </think> when the model's tokenizer has each as one token (a reasoning model)."""
    tokenizer = load_tokenizer(str(model_dir))
    vocab = tokenizer.get_vocab()
    ids = [vocab.get("<think>"), vocab.get("</think>")]
    return ids if all(isinstance(i, int) for i in ids) else None


_tokenizers: dict[str, object] = {}
# One lock for loading: transformers' lazy imports are not safe to race from several worker threads (a burst of
# first requests once broke every caller but the first with "cannot import name 'AutoTokenizer'").
_loading = threading.Lock()


def loaded_tokenizer(model_dir: str):
    """The model's tokenizer if it is loaded already, else None; never loads it, never waits (the event loop's)."""
    return _tokenizers.get(model_dir)


def load_tokenizer(model_dir: str):
    """The model's tokenizer, loaded once per model folder (from any thread)."""
    tokenizer = _tokenizers.get(model_dir)
    if tokenizer is None:
        with _loading:
            tokenizer = _tokenizers.get(model_dir)
            if tokenizer is None:
                from transformers import AutoTokenizer

                tokenizer = _tokenizers[model_dir] = AutoTokenizer.from_pretrained(model_dir)
    return tokenizer


def _text(content) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts: keep the text ones
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
    return str(content)


def _message(m: dict) -> dict:
    """A message as chat templates take it: text content; an assistant's tool calls with their arguments as objects
    (templates write them with ``tojson``, as vLLM gives them) and its reasoning, sent back as ``reasoning_content``
    (or vLLM's ``reasoning``: GLM's and Qwen3's templates keep it within a turn of tool calls); a tool result's call id
    and name."""
    out = {"role": m["role"], "content": _text(m.get("content"))}
    reasoning = m.get("reasoning_content", m.get("reasoning"))
    if m["role"] == "assistant" and isinstance(reasoning, str) and reasoning:
        out["reasoning_content"] = reasoning
    calls = m.get("tool_calls")
    if isinstance(calls, list) and calls:
        out["tool_calls"] = []
        for call in calls:
            function = dict(call.get("function") or {}) if isinstance(call, dict) else {}
            if isinstance(function.get("arguments"), str):
                try:
                    function["arguments"] = json.loads(function["arguments"])
                except ValueError:
                    pass  # the template gets the text as it is
            out["tool_calls"].append({**call, "function": function})
    for key in ("tool_call_id", "name"):
        if isinstance(m.get(key), str):
            out[key] = m[key]
    return out


def thinking_of(enable_thinking: bool | None, effort: str | None) -> bool | None:
    """The on/off switch a request asks for: ``enable_thinking`` as it is sent, else what ``reasoning_effort`` says
    ("none" and "minimal" off, the other levels on), else None (the model's own default)."""
    if enable_thinking is not None or effort is None:
        return enable_thinking
    return effort not in ("none", "minimal")


def reasoning_kwargs(architecture: str, enable_thinking: bool | None, effort: str | None = None) -> dict[str, Any]:
    """The template's reasoning switches: ``enable_thinking`` (Qwen3's and GLM's templates), and for gpt-oss, which
    always reasons, its template's ``reasoning_effort`` ("Reasoning: low|medium|high" in the system message): the
    level asked for, low when thinking is off (the template's default is medium)."""
    kwargs: dict[str, Any] = {}
    thinking = thinking_of(enable_thinking, effort)
    if thinking is not None:
        kwargs["enable_thinking"] = thinking
    if chat_format(architecture) == "harmony":
        if effort in HARMONY_EFFORTS:
            kwargs["reasoning_effort"] = effort
        elif effort == "xhigh":
            kwargs["reasoning_effort"] = "high"
        elif thinking is False:
            kwargs["reasoning_effort"] = "low"
    return kwargs


def encode_chat(model_dir: Path, messages: list[dict], enable_thinking: bool | None,
                architecture: str = "", tools: list[dict] | None = None, effort: str | None = None) -> list[int]:
    """The prompt's token ids through the model's chat template (with ``tools``, when given, as the template's
    ``tools``). The switches of ``reasoning_kwargs`` reach the template; thinking off reaches Qwen3 as Qwen's
    ``/no_think`` soft switch on the last user message too."""
    tokenizer = load_tokenizer(str(model_dir))
    clean = [_message(m) for m in messages]
    if chat_format(architecture) == "harmony":
        clean = [harmony_message(m) for m in clean]
    kwargs = reasoning_kwargs(architecture, enable_thinking, effort)
    if kwargs.get("enable_thinking") is False and architecture in QWEN3:
        last_user = max((i for i, m in enumerate(clean) if m["role"] == "user"), default=None)
        if last_user is not None and not clean[last_user]["content"].rstrip().endswith("/no_think"):
            clean[last_user]["content"] = clean[last_user]["content"].rstrip() + " /no_think"
    if tools:
        if "tools" not in (tokenizer.chat_template or ""):
            from swarm.errors import BadRequest

            raise BadRequest(f"model {Path(model_dir).name}'s chat template does not take tools, so the model would "
                             "not see them. Leave 'tools' out, or describe the tools in the system message.",
                             "unsupported_parameter")
        kwargs["tools"] = tools
    if tokenizer.chat_template:
        ids = tokenizer.apply_chat_template(clean, add_generation_prompt=True, tokenize=True, **kwargs)
        if not isinstance(ids, list):  # transformers 5 returns a BatchEncoding
            ids = ids["input_ids"]
        return [int(i) for i in ids]
    text = "".join(f"{m['role']}: {m['content']}\n" for m in clean) + "assistant:"
    return tokenizer.encode(text)


# The chat formats whose replies are split by their own parser rather than by <think> tags and <tool_call> blocks:
# model type -> format. gpt-oss writes harmony (swarm.leader.chat.harmony); GLM-4.5 thinks in <think> tags but writes
# its tool calls in its own tags (swarm.leader.chat.tool_calls.parse_glm).
CHAT_FORMATS = {"gpt_oss": "harmony", "glm4_moe": "glm", "llama": "llama"}
# harmony's <|call|> ends a reply that calls a tool (the caller runs it and sends its result), as <|return|> ends one
# that is over; some gpt-oss generation configs list only the latter
HARMONY_CALL = "<|call|>"


def chat_format(architecture: str) -> str:
    """How a model's replies carry thinking and tool calls: "harmony", "glm", "llama", or "hermes" (the rest)."""
    return CHAT_FORMATS.get(architecture, "hermes")


def eos_ids(model_dir: Path, manifest: dict) -> list[int]:
    ids = {int(i) for i in manifest.get("eos_token_ids") or []}
    tokenizer = load_tokenizer(str(model_dir))
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    if chat_format(manifest.get("architecture", "")) == "harmony":
        call = tokenizer.get_vocab().get(HARMONY_CALL)
        if isinstance(call, int):
            ids.add(call)
    return sorted(ids)


def harmony_message(m: dict) -> dict:
    """A message for gpt-oss's template, which takes an assistant's reasoning as ``thinking``. On a turn that called a
    tool it renders the reasoning (the one place its template keeps it) and refuses text beside it, so there the
    reasoning goes in, and the text, which was a preamble to the user (the commentary channel), stays out."""
    reasoning = m.get("reasoning_content")
    if m["role"] != "assistant" or not reasoning:
        return m
    if m.get("tool_calls"):
        return {**m, "thinking": reasoning, "content": ""}
    return {**m, "thinking": reasoning}


class TextStream:
    """Turns a growing list of token ids into text deltas, incrementally: each push decodes only the last few tokens
    (from the start of the previous delta), so a long reply costs the same per token as a short one. An incomplete
    UTF-8 character (a byte-level token that ends mid-character) is held back until the next token completes it."""

    def __init__(self, tokenizer, keep_special: bool = False):
        self.tokenizer = tokenizer
        self.keep_special = keep_special  # harmony's channel markers are special tokens, and its parser reads them
        self.tokens: list[int] = []
        self._prefix = 0  # decoding starts here, so a token's leading space is decoded in context
        self._read = 0  # tokens up to here have been turned into text

    def _decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=not self.keep_special)

    def push(self, tokens: list[int]) -> str:
        self.tokens.extend(tokens)
        return self._advance(final=False)

    def flush(self) -> str:
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        seen = self._decode(self.tokens[self._prefix : self._read])
        text = self._decode(self.tokens[self._prefix :])
        if (text.endswith("\ufffd") and not final) or len(text) <= len(seen):
            return ""
        self._prefix, self._read = self._read, len(self.tokens)
        return text[len(seen) :]


def warm_up(model_dir: Path) -> None:
    """Load the tokenizer and run the chat template once, so the first real request pays for neither."""
    ids = encode_chat(model_dir, [{"role": "user", "content": "Hello"}], None)
    load_tokenizer(str(model_dir)).decode(ids[-4:], skip_special_tokens=True)
    from swarm.leader.api.limits import longest_token_bytes

    longest_token_bytes(str(model_dir))  # its vocabulary scan here in the worker thread, not on the first chat's loop
