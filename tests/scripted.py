"""A tiny Qwen3 that answers by script: its greedy reply is a fixed text, token by token, through the real ring.

Every layer computes nothing (zero projections: each layer passes its input on), embeddings are one-hot, and the
head maps each token to the token the script puts after it. The script's pieces are tokens of their own (added to a
small byte-level BPE), so the chain never repeats a token. With its Qwen3-style chat template (``enable_thinking``
puts an empty thinking block in the prompt), this makes reasoning, stop strings and tool calls testable end to end
with exact expectations.
"""

from __future__ import annotations

import json
from pathlib import Path

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}"
    "{% endif %}"
)
SPECIAL = ["<|im_start|>", "<|im_end|>"]


def build(folder: Path, scripts: dict[str, list[str]], chat_template: str = CHAT_TEMPLATE) -> Path:
    """A transformers folder (weights, tokenizer, chat template) whose reply after ``prompt_end`` is the pieces of
    ``scripts[prompt_end]`` then <|im_end|>. ``prompt_end`` is the text the prompt ends with ("assistant\\n" after
    the generation prompt, "\\n\\n" after an empty thinking block)."""
    import torch
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

    pieces = [p for script in scripts.values() for p in script]
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(["hello world " * 10], vocab_size=260, min_frequency=2, show_progress=False)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|im_end|>")
    tokenizer.add_special_tokens({"additional_special_tokens": SPECIAL})
    tokenizer.add_tokens(sorted({"<think>", "</think>", "assistant\n", "\n\n", *pieces}, key=len, reverse=True))
    tokenizer.chat_template = chat_template
    vocab = len(tokenizer)
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")

    def single(text: str) -> int:
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert len(ids) == 1, f"{text!r} is not one token: {ids}"
        return ids[0]

    nxt: dict[int, int] = {}
    for prompt_end, script in scripts.items():
        chain = [single(prompt_end), *map(single, script), eos]
        for a, b in zip(chain, chain[1:]):
            assert nxt.get(a, b) == b, f"the scripts disagree after {tokenizer.decode([a])!r}"
            nxt[a] = b
    hidden = vocab + (-vocab) % 8
    config = Qwen3Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=16, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=16, tie_word_embeddings=False,
                         max_position_embeddings=512, eos_token_id=eos, bos_token_id=eos, pad_token_id=eos)
    model = Qwen3ForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
        model.model.embed_tokens.weight[torch.arange(vocab), torch.arange(vocab)] = 1.0
        for a in range(vocab):
            model.lm_head.weight[nxt.get(a, eos), a] = 10.0
    model.generation_config.eos_token_id = eos
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    config_path = folder / "tokenizer_config.json"
    data = json.loads(config_path.read_text())
    data["chat_template"] = chat_template
    config_path.write_text(json.dumps(data))
    return folder


def imported(root: Path, name: str, scripts: dict[str, list[str]]) -> Path:
    """A scripted model built under ``root`` and imported as ``name``; its model dir."""
    from swarm.store.importer import import_model

    build(root / "src", scripts)
    import_model(str(root / "src"), root / "models", name)
    return root / "models" / name


def hold_compute(monkeypatch):
    """Stages compute requests only while the returned event is set: a reply in flight stays in flight until the
    test sets it (or 120 s pass). A stage's warm-up at load (swarm.stage.warm_up) is not held: loads complete."""
    import threading

    from swarm.stage import execute
    from swarm.stage.warm_up import WARM_UP_RID

    opened = threading.Event()
    original = execute.run_batch

    def held(stage, batch, *args, **kwargs):
        if any(work.request.rid != WARM_UP_RID for work in batch):
            opened.wait(120)
        return original(stage, batch, *args, **kwargs)

    monkeypatch.setattr(execute, "run_batch", held)
    return opened
