"""From OpenAI-style messages to token ids and back: the model's chat template, sampling defaults, streaming text.

Tokenisation happens on the leader; fellows see token ids only.
"""

from __future__ import annotations

import logging
import threading
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


_tokenizers: dict[str, object] = {}
# One lock for loading: transformers' lazy imports are not safe to race from several worker threads (a burst of
# first requests once broke every caller but the first with "cannot import name 'AutoTokenizer'").
_loading = threading.Lock()


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
    """Turns a growing list of token ids into text deltas, incrementally: each push decodes only the last few tokens
    (from the start of the previous delta), so a long reply costs the same per token as a short one. An incomplete
    UTF-8 character (a byte-level token that ends mid-character) is held back until the next token completes it."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.tokens: list[int] = []
        self._prefix = 0  # decoding starts here, so a token's leading space is decoded in context
        self._read = 0  # tokens up to here have been turned into text

    def _decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

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
