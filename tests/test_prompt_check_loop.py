"""The leader's early prompt check (swarm.leader.api.limits) runs on its event loop, so it must never load a tokenizer
or wait for one being loaded: at a model's first chat it used to, and on a busy machine the whole leader stopped for
4-12 s (no heartbeats: every fellow of the ring dropped the leader and rejoined; seen in the network lab)."""

from __future__ import annotations

import json
import threading

import pytest

from swarm.errors import ContextTooLong
from swarm.leader.api import limits
from swarm.leader.chat import chat_format


def _tokenizer_dir(path, longest: str):
    """A real word-level tokenizer folder whose longest vocabulary entry is ``longest``."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, "a": 1, "bb": 2, longest: 3}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    path.mkdir()
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    return str(path)


def test_the_prompt_check_does_not_wait_for_a_tokenizer_being_loaded(tmp_path):
    model_dir = _tokenizer_dir(tmp_path / "model", "c" * 10)
    finished = threading.Event()

    def first_chat():
        limits.check_prompt_bytes("hello", model_dir, 100)
        finished.set()

    # The load-time warm-up holds the loading lock while it imports transformers (seconds on a busy machine).
    with chat_format._loading:
        worker = threading.Thread(target=first_chat, daemon=True)
        worker.start()
        assert finished.wait(5), "the prompt check waited for the tokenizer's loading lock"
    worker.join(5)


def test_the_check_uses_the_vocabulary_once_the_tokenizer_is_loaded(tmp_path):
    model_dir = _tokenizer_dir(tmp_path / "model", "c" * 10)
    text = "x" * (100 * 10 + 1)  # more than 100 tokens of at most 10 bytes can carry
    limits.check_prompt_bytes(text, model_dir, 100)  # not loaded yet: only the fallback bound, which this passes
    assert chat_format.loaded_tokenizer(model_dir) is None, "the check loaded the tokenizer"
    chat_format.load_tokenizer(model_dir)  # as the warm-up or the first encode does, in a worker thread
    assert limits.longest_token_bytes(model_dir) == 10
    with pytest.raises(ContextTooLong, match="at most 1000 bytes"):
        limits.check_prompt_bytes(text, model_dir, 100)
