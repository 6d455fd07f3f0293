"""The MoE families with particulars of their own: GLM-4.5 (``glm4_moe``: dense first layers, grouped sigmoid routing
with a correction bias, shared experts, partial rotary, QK norms, a multi-token-prediction layer the import leaves
out) and gpt-oss (``gpt_oss``: attention sinks, alternating sliding-window layers, biased experts, MXFP4 experts in
its safetensors checkpoints). Tiny random models saved by transformers, imported, split over 1, 2 and 3 stages and
matched token for token against transformers' generate -- in one process, as 8 chats batched together, and over
real fellows."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import trio

from conftest import shared_once
from exactness import check_reply, reference

# 8 chats at once; several are longer than gpt-oss's window of 4 and than a prefill chunk of 8
PROMPTS = [[5, 17, 42, 99, 7, 150, 3, 88, 21, 64, 9, 200], [11, 12, 13], list(range(30, 50)), [1, 250, 31, 5],
           [300, 4], list(range(100, 113)), [7] * 9, [60, 61, 250, 3, 9, 14]]
NEW_TOKENS = 8
LAYERS = 4
_COMMON = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=320,
               max_position_embeddings=256, initializer_range=0.2, bos_token_id=1, eos_token_id=2, pad_token_id=0,
               num_hidden_layers=LAYERS, tie_word_embeddings=False)
FAMILIES = {
    # 8 experts in 2 groups, top-2 from the best group, one shared expert; layer 0 dense
    "glm4_moe": ("Glm4MoeConfig", dict(intermediate_size=96, n_routed_experts=8, num_experts_per_tok=2,
                                       moe_intermediate_size=32, n_shared_experts=1, first_k_dense_replace=1,
                                       n_group=2, topk_group=1, routed_scaling_factor=1.5, use_qk_norm=True,
                                       partial_rotary_factor=0.5, num_nextn_predict_layers=1)),
    # sliding, full, sliding, full; a window of 4 tokens
    "gpt_oss": ("GptOssConfig", dict(intermediate_size=32, num_local_experts=4, num_experts_per_tok=2,
                                     sliding_window=4)),
}
MXFP4 = "gpt_oss-mxfp4"  # the gpt_oss model with its experts replaced by MXFP4 blocks, as gpt-oss checkpoints ship


def _mxfp4_checkpoint(source: Path, target: Path) -> None:
    """``source``'s checkpoint with each fused expert matrix stored as gpt-oss stores it: random MXFP4 blocks and
    scales (exponents 2^-5 .. 2^0) under ``X_blocks`` / ``X_scales``, and config.json's mxfp4 quantization_config."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(source, target)
    tensors = load_file(target / "model.safetensors")
    generator = torch.Generator().manual_seed(7)
    for name in [k for k in tensors if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        experts, columns, rows = tensors.pop(name).shape  # the layer's (experts, in, out)
        tensors[name + "_blocks"] = torch.randint(0, 256, (experts, rows, columns // 32, 16), generator=generator,
                                                  dtype=torch.uint8)
        tensors[name + "_scales"] = torch.randint(122, 128, (experts, rows, columns // 32), generator=generator,
                                                  dtype=torch.uint8)
    save_file(tensors, target / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((target / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (target / "config.json").write_text(json.dumps(config))


def _with_mtp_layer(source: Path) -> None:
    """Adds GLM-4.5's multi-token-prediction layer (the layer after the stack, here a projection) to the checkpoint."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(source / "model.safetensors")
    tensors[f"model.layers.{LAYERS}.eh_proj.weight"] = torch.randn(64, 128)
    save_file(tensors, source / "model.safetensors", metadata={"format": "pt"})


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    """kind -> (the transformers folder, the imported model dir), for each family and the MXFP4 checkpoint."""
    import transformers

    from swarm.store.importer import import_model

    def build(root: Path) -> None:
        for kind, (class_name, kwargs) in FAMILIES.items():
            config = getattr(transformers, class_name)(**_COMMON, **kwargs)
            torch.manual_seed(1234)
            transformers.AutoModelForCausalLM.from_config(config).save_pretrained(root / f"src-{kind}")
        _with_mtp_layer(root / "src-glm4_moe")
        _mxfp4_checkpoint(root / "src-gpt_oss", root / f"src-{MXFP4}")
        for kind in (*FAMILIES, MXFP4):
            import_model(str(root / f"src-{kind}"), root / "models", kind)

    root = shared_once(tmp_path_factory, "moe-families", build)
    return {kind: (root / f"src-{kind}", root / "models" / kind) for kind in (*FAMILIES, MXFP4)}


def _source_model(source: Path):
    import transformers

    extra = {}
    if "quantization_config" in json.loads((source / "config.json").read_text()):  # transformers dequantizes MXFP4
        extra["quantization_config"] = transformers.Mxfp4Config(dequantize=True)
    return transformers.AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32, **extra).eval()


@pytest.mark.parametrize("kind", [*FAMILIES, MXFP4])
def test_layer_files_hold_what_the_decoder_layer_expects(family_dirs, kind):
    from safetensors import safe_open
    from safetensors.torch import load_file

    source, model_dir = family_dirs[kind]
    with safe_open(str(source / "model.safetensors"), framework="pt") as handle:
        names = list(handle.keys())
    if kind == "glm4_moe":  # per-expert checkpoint tensors, and the MTP layer after the stack
        assert any(".experts.0." in k for k in names) and any(k.startswith(f"model.layers.{LAYERS}.") for k in names)
    if kind == MXFP4:
        assert any(k.endswith("gate_up_proj_blocks") for k in names)
        assert "quantization_config" not in json.loads((model_dir / "config.json").read_text())  # stored dequantized
    model = _source_model(source)  # transformers' own load: its conversion, its MXFP4 dequantization
    assert len(list((model_dir / "weights").glob("layer_*"))) == LAYERS
    for i in range(LAYERS):
        stored = load_file(model_dir / "weights" / f"layer_{i:03d}.safetensors")
        want = model.model.layers[i].state_dict()
        assert set(stored) == set(want)
        assert all(torch.equal(stored[k], want[k]) for k in want), (kind, i)
    if kind == "glm4_moe":  # the first layer dense, the others routed with a shared expert
        assert "mlp.gate_proj.weight" in load_file(model_dir / "weights" / "layer_000.safetensors")
        later = load_file(model_dir / "weights" / "layer_001.safetensors")
        assert later["mlp.experts.gate_up_proj"].shape[0] == 8 and "mlp.shared_experts.up_proj.weight" in later


@pytest.mark.parametrize("kind", [*FAMILIES, MXFP4])
@pytest.mark.parametrize("stages", [1, 2, 3])
def test_stages_in_one_process_match_generate(family_dirs, kind, stages):
    from swarm.stage.local import LocalRing
    from swarm.stage.slice import StageModel
    from swarm.stage.slice_load import stage_specs

    source, model_dir = family_dirs[kind]
    model = _source_model(source)
    ring = LocalRing([StageModel.load_dir(model_dir, s) for s in stage_specs(LAYERS, stages)], prefill_chunk=8)
    for prompt in PROMPTS[:3]:
        want, margins = reference(model, prompt, NEW_TOKENS)
        assert check_reply(ring.generate(prompt, NEW_TOKENS), want, margins) == "identical"


def test_gpt_oss_stages_attend_with_sinks_and_windows(family_dirs):
    """The sinks and the windows change the reply: a stage without them (SDPA, which drops the sinks) or with
    every layer full leaves generate's reply on the prompts above."""
    from swarm.stage.local import LocalRing
    from swarm.stage.slice import StageModel
    from swarm.stage.slice_load import stage_specs

    source, model_dir = family_dirs["gpt_oss"]
    model = _source_model(source)
    stage = StageModel.load_dir(model_dir, stage_specs(LAYERS, 1)[0])
    assert stage.config._attn_implementation == "eager"
    assert stage.mask_types == ["sliding_attention", "full_attention"] * 2
    wants = [reference(model, p, NEW_TOKENS)[0] for p in PROMPTS[:3]]
    stage.config._attn_implementation = "sdpa"  # what the stages of the other families use: no sinks
    without_sinks = [LocalRing([stage]).generate(p, NEW_TOKENS, rid=f"s{i}") for i, p in enumerate(PROMPTS[:3])]
    assert without_sinks != wants


@pytest.mark.parametrize("kind", list(FAMILIES))
def test_eight_chats_batched_in_one_process_match_generate(family_dirs, kind):
    """Concurrent requests share each pass (swarm.stage.ragged): every row attends to its own cache, with gpt-oss's
    sinks and windows."""
    from swarm import messages
    from swarm.stage.local import LocalRing
    from swarm.stage.slice import StageModel
    from swarm.stage.slice_load import stage_specs

    source, model_dir = family_dirs[kind]
    model = _source_model(source)
    expected = [reference(model, p, NEW_TOKENS) for p in PROMPTS]
    ring = LocalRing([StageModel.load_dir(model_dir, s) for s in stage_specs(LAYERS, 3)], prefill_chunk=8)
    replies = [ring.submit(f"r{i}", p, NEW_TOKENS, messages.Sampling(), (), 0) for i, p in enumerate(PROMPTS)]
    ring.run()
    one_by_one = 3 * sum(-(-len(p) // 8) + NEW_TOKENS - 1 for p in PROMPTS)  # passes of each request alone
    assert ring.batches < one_by_one / 2  # the requests shared their passes
    verdicts = [check_reply(r.tokens, want, margins) for r, (want, margins) in zip(replies, expected)]
    assert verdicts == ["identical"] * len(PROMPTS)


@pytest.mark.e2e
async def test_families_over_the_ring_match_generate_alone_and_as_concurrent_chats(tmp_path, family_dirs):
    from harness import running_swarm

    kinds = list(FAMILIES)
    expected = {}
    for kind in kinds:
        model = _source_model(family_dirs[kind][0])
        expected[kind] = [reference(model, p, NEW_TOKENS) for p in PROMPTS]

    async def tokens(swarm, name, prompt):
        return await swarm.greedy(name, prompt, NEW_TOKENS)

    with trio.fail_after(280):
        async with running_swarm(tmp_path, [family_dirs[k][1] for k in kinds], fellows=3,
                                 fellow_env={"SWARM_SERVE_PREFILL_CHUNK": "8"}) as swarm:
            for kind in kinds:
                for stages in (1, 2, 3):
                    view = await swarm.load(kind, stages)
                    assert len(view["stages"]) == stages
                    want, margins = expected[kind][0]
                    assert check_reply(await tokens(swarm, kind, PROMPTS[0]), want, margins) == "identical"
                    got: dict[int, list[int]] = {}

                    async def chat(i, prompt, kind=kind, got=got):
                        got[i] = await tokens(swarm, kind, prompt)

                    async with trio.open_nursery() as nursery:  # concurrent chats: batched decode
                        for i, prompt in enumerate(PROMPTS):
                            nursery.start_soon(chat, i, prompt)
                    verdicts = [check_reply(got[i], want, margins) for i, (want, margins) in enumerate(expected[kind])]
                    assert verdicts == ["identical"] * len(PROMPTS), (kind, stages, verdicts)
                    await swarm.leader.serving.loader.unload(kind)


# --- chat formats: replies rendered by each family's own chat template (tests/templates: gpt-oss-20b's
# chat_template.jinja, GLM-4.5's as llama.cpp's models/templates/glm_4_5.jinja keeps it), tokenized with the family's
# markers as single tokens (gpt-oss-20b's special tokens; GLM-4.5's role tokens special, its tags not) ----------------

TEMPLATES = Path(__file__).parent / "templates"
HARMONY_SPECIAL = ["<|startoftext|>", "<|endoftext|>", "<|return|>", "<|constrain|>", "<|channel|>", "<|start|>",
                   "<|end|>", "<|message|>", "<|call|>", "<|endofprompt|>"]
GLM_SPECIAL = ["[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>", "<|endoftext|>"]
GLM_TAGS = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>",
            "</arg_value>", "<tool_response>", "</tool_response>"]
WEATHER = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}]


def _tokenizer_dir(root: Path, family: str) -> Path:
    """A byte-level tokenizer (every byte a token) with the family's markers as single tokens and its template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokenizer = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    if family == "gpt_oss":
        tokenizer.add_special_tokens(HARMONY_SPECIAL)
        eos = "<|return|>"
    else:
        tokenizer.add_special_tokens(GLM_SPECIAL)
        tokenizer.add_tokens(GLM_TAGS)
        eos = "<|endoftext|>"
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=eos, pad_token="<|endoftext|>",
                                   chat_template=(TEMPLATES / f"{family}.jinja").read_text())
    fast.save_pretrained(root / family)
    return root / family


@pytest.fixture(scope="module")
def chat_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("chat-formats")
    return {family: _tokenizer_dir(root, family) for family in ("gpt_oss", "glm4_moe")}


def _reply_tokens(model_dir: Path, messages: list[dict], reply: dict, **kwargs) -> tuple[list[int], list[int]]:
    """(prompt, reply) token ids: the template's prompt for ``messages``, and the tokens the template renders for the
    assistant message ``reply`` after it -- what the model would write."""
    from swarm.leader.chat.chat_format import encode_chat, load_tokenizer

    prompt = encode_chat(model_dir, messages, **kwargs)
    tokenizer = load_tokenizer(str(model_dir))
    extra = {k: v for k, v in kwargs.items() if k == "enable_thinking" and v is not None}
    whole = tokenizer.apply_chat_template([*messages, reply], tools=kwargs.get("tools"), tokenize=True, **extra)
    whole = list(whole["input_ids"] if not isinstance(whole, list) else whole)
    assert whole[: len(prompt)] == prompt
    return prompt, whole[len(prompt):]


def _stream(model_dir: Path, tokens: list[int], family: str, tools: list[dict] | None, inside: bool = False):
    """The reply as the API splits it, fed one token at a time: (reasoning, content, tool calls)."""
    from swarm.leader.api.replies import ReplyText
    from swarm.leader.chat.chat_format import load_tokenizer
    from swarm.leader.chat.tool_calls import ToolCallSplitter

    text = ReplyText(load_tokenizer(str(model_dir)), inside, harmony=family == "harmony")
    calls = ToolCallSplitter("hermes" if family == "harmony" else family, tools) if tools else None
    reasoning = content = ""
    for token in tokens:
        r, c = text.push([token])
        reasoning, content = reasoning + r, content + (calls.push(c) if calls and c else c)
    r, c = text.flush()
    reasoning, content = reasoning + r, content + (calls.push(c) if calls and c else c)
    found: list[dict] = []
    if calls is not None:
        rest, found = calls.finish()
        content += rest
    return reasoning, content, found


def test_harmony_reply_splits_into_reasoning_and_content(chat_dirs):
    from swarm.leader.chat.chat_format import load_tokenizer

    model_dir = chat_dirs["gpt_oss"]
    user = [{"role": "user", "content": "What is the capital of France?"}]
    prompt, reply = _reply_tokens(model_dir, user, {"role": "assistant", "thinking": "The user asks. Easy: Paris.",
                                                   "content": "The capital of France is Paris."}, enable_thinking=None)
    tokenizer = load_tokenizer(str(model_dir))
    assert tokenizer.decode(prompt, skip_special_tokens=False).endswith("<|start|>assistant")
    assert tokenizer.decode(reply, skip_special_tokens=False).startswith("<|channel|>analysis<|message|>")
    assert _stream(model_dir, reply, "harmony", None) == ("The user asks. Easy: Paris.",
                                                          "The capital of France is Paris.", [])


def test_harmony_tool_call_becomes_an_openai_tool_call(chat_dirs):
    from swarm.leader.chat.chat_format import eos_ids, load_tokenizer

    model_dir = chat_dirs["gpt_oss"]
    user = [{"role": "user", "content": "Weather in Paris for 3 days?"}]
    call = {"role": "assistant", "thinking": "Need the weather tool.",
            "tool_calls": [{"type": "function", "function": {"name": "get_weather",
                                                             "arguments": {"city": "Paris", "days": 3}}}]}
    prompt, reply = _reply_tokens(model_dir, user, call, enable_thinking=None, tools=WEATHER)
    tokenizer = load_tokenizer(str(model_dir))
    assert "to=functions.get_weather" in tokenizer.decode(reply, skip_special_tokens=False)
    reasoning, content, calls = _stream(model_dir, reply, "harmony", WEATHER)
    assert (reasoning, content.strip()) == ("Need the weather tool.", "")
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Paris", "days": 3})]
    # the reply ends at <|call|> (the caller runs the tool), as at <|return|>
    ends = eos_ids(model_dir, {"architecture": "gpt_oss", "eos_token_ids": []})
    assert reply[-1] in ends and tokenizer.convert_tokens_to_ids("<|return|>") in ends


def test_harmony_thinking_off_asks_for_low_reasoning_effort(chat_dirs):
    from swarm.leader.chat.chat_format import encode_chat, load_tokenizer

    model_dir = chat_dirs["gpt_oss"]
    user = [{"role": "user", "content": "Hi"}]
    rendered = {thinking: load_tokenizer(str(model_dir)).decode(encode_chat(model_dir, user, thinking, "gpt_oss"))
                for thinking in (None, False)}
    assert "Reasoning: medium" in rendered[None] and "Reasoning: low" in rendered[False]


def test_harmony_without_channels_is_all_content(chat_dirs):
    """A model that does not write harmony (a tiny random one) has its whole reply as the answer."""
    from swarm.leader.chat.chat_format import load_tokenizer

    model_dir = chat_dirs["gpt_oss"]
    tokens = load_tokenizer(str(model_dir)).encode("just text, <no> channels")
    assert _stream(model_dir, tokens, "harmony", None) == ("", "just text, <no> channels", [])


@pytest.mark.parametrize("thinking", [True, False])
def test_glm_reply_with_thinking_and_a_tool_call(chat_dirs, thinking):
    from swarm.leader.chat.chat_format import load_tokenizer, prompt_opens_thinking

    model_dir = chat_dirs["glm4_moe"]
    user = [{"role": "user", "content": "Weather in Paris for 3 days?"}]
    call = {"role": "assistant", "reasoning_content": "Need the weather tool." if thinking else "",
            "content": "Let me check.", "tool_calls": [{"type": "function", "function": {
                "name": "get_weather", "arguments": {"city": "Paris", "days": 3}}}]}
    prompt, reply = _reply_tokens(model_dir, user, call, enable_thinking=thinking, tools=WEATHER)
    tokenizer = load_tokenizer(str(model_dir))
    text = tokenizer.decode(prompt, skip_special_tokens=False)
    assert text.endswith("<|assistant|>" if thinking else "<|assistant|>\n<think></think>")  # GLM's switch
    assert "/nothink" in text if not thinking else "/nothink" not in text
    assert not prompt_opens_thinking(model_dir, prompt)  # thinking off: the empty block is in the prompt already
    reasoning, content, calls = _stream(model_dir, reply, "glm", WEATHER)
    assert reasoning == ("Need the weather tool." if thinking else "")
    assert content.strip() == "Let me check."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Paris", "days": 3})]


def test_glm_string_arguments_stay_strings_by_the_tools_schema():
    from swarm.leader.chat.tool_calls import parse_glm

    text = "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>123</arg_value>\n</tool_call>"
    assert json.loads(parse_glm(text, WEATHER)[1][0]["function"]["arguments"]) == {"city": "123"}
    assert json.loads(parse_glm(text)[1][0]["function"]["arguments"]) == {"city": 123}  # no schema: as JSON


def test_glm_router_stays_float32_in_bfloat16(family_dirs, tmp_path):
    """As transformers' from_pretrained keeps GLM's router weight and correction bias in float32 in a 16-bit load
    (_keep_in_fp32_modules_strict), so do a bfloat16 import and a bfloat16 stage: same values, same replies."""
    import transformers
    from safetensors import safe_open

    from swarm.stage.local import LocalRing
    from swarm.stage.slice import StageModel
    from swarm.stage.slice_load import stage_specs
    from swarm.store.importer import import_model

    source, _ = family_dirs["glm4_moe"]
    import_model(str(source), tmp_path, "glm-bf16", dtype="bfloat16")
    model_dir = tmp_path / "glm-bf16"
    with safe_open(str(model_dir / "weights" / "layer_001.safetensors"), framework="pt") as handle:
        stored = {k: handle.get_slice(k).get_dtype() for k in handle.keys()}
    assert stored["mlp.gate.weight"] == stored["mlp.gate.e_score_correction_bias"] == "F32"
    assert stored["mlp.experts.gate_up_proj"] == stored["self_attn.q_proj.weight"] == "BF16"
    model = transformers.AutoModelForCausalLM.from_pretrained(source, dtype=torch.bfloat16).eval()
    stages = [StageModel.load_dir(model_dir, s, dtype=torch.bfloat16) for s in stage_specs(LAYERS, 2)]
    gate = stages[0].layers[1].mlp.gate  # layer 1: the first routed layer
    assert gate.weight.dtype == gate.e_score_correction_bias.dtype == torch.float32
    assert torch.equal(gate.weight, model.model.layers[1].mlp.gate.weight)
    assert stages[0].layers[1].mlp.experts.gate_up_proj.dtype == torch.bfloat16
    for prompt in PROMPTS[:2]:
        want, margins = reference(model, prompt, NEW_TOKENS)
        assert check_reply(LocalRing(stages).generate(prompt, NEW_TOKENS), want, margins) == "identical"
