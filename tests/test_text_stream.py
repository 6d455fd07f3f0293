"""Streaming text from tokens: incremental detokenising gives exactly the full decode, whatever the batching, and
never sends half a UTF-8 character."""

from __future__ import annotations

import random

import pytest

from swarm.leader.chat.chat_format import TextStream

TEXTS = [
    "Héllo wörld, naïve café — déjà vu.",
    "你好，世界！这是一个测试。",
    "emoji 🎉🎉 and 👩‍👩‍👧 families, then plain text again.",
    "  leading spaces\nnew lines\n\n  and   gaps  ",
]


@pytest.fixture(scope="module")
def tokenizer():
    """A byte-level BPE with few merges, so most non-ASCII characters span several tokens."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(["the quick brown fox jumps over the lazy dog " * 20, *TEXTS], vocab_size=300,
                            min_frequency=2, show_progress=False)
    return PreTrainedTokenizerFast(tokenizer_object=bpe)


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_deltas_add_up_to_the_full_decode(tokenizer, text, seed):
    ids = tokenizer.encode(text)
    assert len(ids) > len(text) // 3  # the tokenizer really splits characters into bytes here
    rng = random.Random(seed)
    stream = TextStream(tokenizer)
    deltas = []
    i = 0
    while i < len(ids):
        n = 1 if seed == 0 else rng.randint(1, 4)  # one token at a time, or batches as fellows post them
        delta = stream.push(ids[i : i + n])
        assert "\ufffd" not in delta, "half a character went out"
        deltas.append(delta)
        i += n
    deltas.append(stream.flush())
    assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=True)


def test_each_push_decodes_only_a_few_tokens(tokenizer):
    """Work per token stays flat as the reply grows (the old stream decoded the whole reply every time)."""
    lengths = []
    real_decode = tokenizer.decode

    def counting_decode(ids, **kwargs):
        lengths.append(len(ids))
        return real_decode(ids, **kwargs)

    tokenizer.decode = counting_decode
    try:
        stream = TextStream(tokenizer)
        for token in tokenizer.encode(" ".join(TEXTS) * 5):
            stream.push([token])
    finally:
        del tokenizer.decode
    assert max(lengths) < 16
