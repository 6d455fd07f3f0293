"""From OpenAI-style messages to token ids and back: the model's chat template, sampling defaults, streaming text.

Tokenisation happens on the leader; fellows see token ids only.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path

log = logging.getLogger(__name__)

# Sampling defaults when a request leaves a parameter unset (the user's manual, Sampling): the Qwen values are the
# ones the Qwen model cards recommend; top_k 0 and min_p 0 mean off.
QWEN3_THINKING = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.0}
QWEN_NON_THINKING = {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "min_p": 0.0}
OTHER = {"temperature": 0.7, "top_p": 0.95, "top_k": 0, "min_p": 0.0}


def sampling_defaults(architecture: str, thinking: bool) -> dict:
    if architecture == "qwen3":
        return dict(QWEN3_THINKING if thinking else QWEN_NON_THINKING)
    if architecture == "qwen2":
        return dict(QWEN_NON_THINKING)
    return dict(OTHER)


@functools.lru_cache(maxsize=8)
def load_tokenizer(model_dir: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def _text(content) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts: keep the text ones
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
    return str(content)


def encode_chat(model_dir: Path, messages: list[dict], enable_thinking: bool | None) -> list[int]:
    tokenizer = load_tokenizer(str(model_dir))
    clean = [{"role": m["role"], "content": _text(m.get("content"))} for m in messages]
    kwargs = {}
    if enable_thinking is not None:
        kwargs["enable_thinking"] = enable_thinking
    if tokenizer.chat_template:
        ids = tokenizer.apply_chat_template(clean, add_generation_prompt=True, tokenize=True, **kwargs)
        if not isinstance(ids, list):  # transformers 5 returns a BatchEncoding
            ids = ids["input_ids"]
        return [int(i) for i in ids]
    text = "".join(f"{m['role']}: {m['content']}\n" for m in clean) + "assistant:"
    return tokenizer.encode(text)


def eos_ids(model_dir: Path, manifest: dict) -> list[int]:
    ids = set(int(i) for i in manifest.get("eos_token_ids") or [])
    tokenizer = load_tokenizer(str(model_dir))
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return sorted(ids)


class TextStream:
    """Turns a growing list of token ids into text deltas, holding back an incomplete UTF-8 character."""

    def __init__(self, model_dir: Path):
        self.tokenizer = load_tokenizer(str(model_dir))
        self.tokens: list[int] = []
        self.sent = ""

    def push(self, tokens: list[int]) -> str:
        self.tokens.extend(tokens)
        text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        if text.endswith("\ufffd"):
            return ""
        delta = text[len(self.sent):] if text.startswith(self.sent) else text
        self.sent = text
        return delta

    def flush(self) -> str:
        text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        delta = text[len(self.sent):] if text.startswith(self.sent) else ""
        self.sent = text
        return delta
