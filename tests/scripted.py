"""A tiny Qwen3 that answers by script: its greedy reply is a fixed text, token by token, through the real ring.

Every layer computes nothing (zero projections: each layer passes its input on), embeddings are one-hot, and the
head maps each token to the token the script puts after it. The script's pieces are tokens of their own (added to a
small byte-level BPE), so the chain never repeats a token. With its Qwen3-style chat template (``enable_thinking``
puts an empty thinking block in the prompt), this makes reasoning, stop strings and tool calls testable end to end
with exact expectations.

The same model can be built as another family (``family``: qwen3_moe, gpt_oss, glm4_moe), with that family's
transformers config (its layers, experts included, zero too), its markers as single tokens and its chat template
(tests/templates): the manifest then names the family, so the leader reads the reply in the family's chat format
(gpt-oss's harmony, GLM-4.5's tags) exactly as it would a real checkpoint's. A piece may hold several markers (one
token): the reply is a chain where every token has one successor, so a marker that comes twice needs a second token.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}"
    "{% endif %}"
)
SPECIAL = ["<|im_start|>", "<|im_end|>"]
TEMPLATES = Path(__file__).parent / "templates"


@dataclasses.dataclass(frozen=True)
class Family:
    """What a scripted model of a family is built with: its transformers config, its special tokens (``eos``
    first among them, then the other tokens its generation config ends a reply at), its other markers, its template."""

    config: str
    config_kwargs: dict
    special: tuple[str, ...]
    eos: str
    template: str | None = None  # a file of tests/templates; None: CHAT_TEMPLATE
    tags: tuple[str, ...] = ("<think>", "</think>", "assistant\n", "\n\n")
    more_eos: tuple[str, ...] = ()


# the families' templates spell out the tools, a few hundred tokens of a byte-level vocabulary
_LONG = {"max_position_embeddings": 2048}
FAMILIES = {
    "qwen3": Family("Qwen3Config", {}, tuple(SPECIAL), "<|im_end|>"),
    "qwen3_moe": Family("Qwen3MoeConfig", dict(num_experts=2, num_experts_per_tok=1, moe_intermediate_size=8, **_LONG),
                        tuple(SPECIAL), "<|im_end|>", "qwen3_moe.jinja",
                        ("<think>", "</think>", "assistant\n", "\n\n", "<tool_call>", "</tool_call>")),
    # gpt-oss-20b's special tokens; a reply ends at <|return|>, or at <|call|> for a tool's result
    "gpt_oss": Family("GptOssConfig", dict(num_local_experts=2, num_experts_per_tok=1, sliding_window=8, **_LONG),
                      ("<|return|>", "<|startoftext|>", "<|endoftext|>", "<|constrain|>", "<|channel|>", "<|start|>",
                       "<|end|>", "<|message|>", "<|call|>"), "<|return|>", "gpt_oss.jinja", (),
                      ("<|endoftext|>", "<|call|>")),
    # GLM-4.5: role tokens special, tags not; its generation config ends a reply at <|user|> and <|observation|>
    # (the turn of a tool's result) too
    "glm4_moe": Family("Glm4MoeConfig", dict(n_routed_experts=2, num_experts_per_tok=1, moe_intermediate_size=8,
                                             n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1,
                                             **_LONG),
                       ("<|endoftext|>", "[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>",
                        "<|observation|>"), "<|endoftext|>", "glm4_moe.jinja",
                       ("<think>", "</think>", "<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>",
                        "</arg_value>", "<tool_response>", "</tool_response>"), ("<|user|>", "<|observation|>")),
}


def build(folder: Path, scripts: dict[str, list[str]], chat_template: str | None = None,
          family: str = "qwen3") -> Path:
    """A transformers folder (weights, tokenizer, chat template) whose reply after ``prompt_end`` is the pieces of
    ``scripts[prompt_end]`` then the family's end of turn. ``prompt_end`` is the token the prompt ends with
    ("assistant\\n" after Qwen's generation prompt, "\\n\\n" after an empty thinking block). ``chat_template``
    replaces the family's."""
    import torch
    import transformers
    from tokenizers import AddedToken, ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    kind = FAMILIES[family]
    if chat_template is None:
        chat_template = (TEMPLATES / kind.template).read_text() if kind.template else CHAT_TEMPLATE
    pieces = [p for script in scripts.values() for p in script]
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(["hello world " * 10], vocab_size=260, min_frequency=2, show_progress=False)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token=kind.eos, pad_token=kind.eos)
    tokenizer.add_special_tokens({"additional_special_tokens": [t for t in kind.special if t != kind.eos]})
    # not normalized: matched with the special tokens, longest first (a piece may hold markers)
    words = {*kind.tags, *scripts, *pieces} - set(kind.special)
    tokenizer.add_tokens([AddedToken(w, normalized=False) for w in sorted(words, key=len, reverse=True)])
    tokenizer.chat_template = chat_template
    vocab = len(tokenizer)
    eos = tokenizer.convert_tokens_to_ids(kind.eos)

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
    config = getattr(transformers, kind.config)(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=16, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, tie_word_embeddings=False, eos_token_id=eos, bos_token_id=eos,
        pad_token_id=eos, **{"max_position_embeddings": 512, **kind.config_kwargs})
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
        model.model.embed_tokens.weight[torch.arange(vocab), torch.arange(vocab)] = 1.0
        for a in range(vocab):
            model.lm_head.weight[nxt.get(a, eos), a] = 10.0
    ends = [eos, *tokenizer.convert_tokens_to_ids(list(kind.more_eos))]
    model.generation_config.eos_token_id = ends if len(ends) > 1 else eos
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    config_path = folder / "tokenizer_config.json"
    data = json.loads(config_path.read_text())
    data["chat_template"] = chat_template
    config_path.write_text(json.dumps(data))
    return folder


def imported(root: Path, name: str, scripts: dict[str, list[str]], family: str = "qwen3") -> Path:
    """A scripted model built under ``root`` and imported as ``name``; its model dir."""
    from swarm.store.importer import import_model

    build(root / "src", scripts, family=family)
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
