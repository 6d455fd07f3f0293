"""Constrained sampling on the last stage (response_format): SmolLM2 over two stages must write JSON that follows a
schema -- greedy and sampled, where unconstrained it writes prose."""

from __future__ import annotations

import json
import time

import pytest

from swarm import messages
from swarm.leader.api.openai_params import parse_response_format
from swarm.leader.chat.chat_format import encode_chat, load_tokenizer
from swarm.stage import LocalRing, StageModel, stage_specs
from swarm.store.manifest import load_manifest

pytestmark = pytest.mark.e2e

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150},
                                           "likes": {"type": "array", "items": {"enum": ["tea", "coffee"]},
                                                     "maxItems": 2}},
          "required": ["name", "age", "likes"], "additionalProperties": False}


def check(value: dict) -> None:
    assert set(value) == {"name", "age", "likes"}
    assert isinstance(value["name"], str) and len(value["name"]) <= 20
    assert isinstance(value["age"], int) and 0 <= value["age"] <= 150
    assert isinstance(value["likes"], list) and set(value["likes"]) <= {"tea", "coffee"} and len(value["likes"]) <= 2


def test_a_schema_the_built_in_model_must_follow(smollm_model_dir, session_summary):
    specs = stage_specs(load_manifest(smollm_model_dir).num_layers, 2)
    stages = [StageModel.load_dir(smollm_model_dir, s) for s in specs]
    stages[-1].tokenizer_dir = smollm_model_dir  # what a fellow's loader gives the last stage
    ring = LocalRing(stages)
    tokenizer = load_tokenizer(str(smollm_model_dir))
    prompt = encode_chat(smollm_model_dir, [{"role": "user", "content": "Tell me about a person."}], None)
    eos = [tokenizer.eos_token_id]
    grammar = parse_response_format({"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}})

    free = ring.submit("free", prompt, 60, messages.Sampling(), eos)
    ring.run()
    with pytest.raises(ValueError):
        json.loads(tokenizer.decode(free.tokens, skip_special_tokens=True))  # left to itself it writes prose

    started = time.perf_counter()
    greedy = ring.submit("greedy", prompt, 80, messages.Sampling(grammar=grammar), eos)
    ring.run()
    took = time.perf_counter() - started
    assert greedy.finish_reason == "stop"  # the grammar ended and only the end of turn was left
    check(json.loads(tokenizer.decode(greedy.tokens, skip_special_tokens=True)))
    for seed in (1, 2, 3):
        sampled = ring.submit(f"s{seed}", prompt, 80, messages.Sampling(temperature=1.0, seed=seed, grammar=grammar),
                              eos)
        ring.run()
        check(json.loads(tokenizer.decode(sampled.tokens, skip_special_tokens=True)))
    any_object = messages.Sampling(grammar=parse_response_format({"type": "json_object"}))
    objects = ring.submit("object", prompt, 80, any_object, eos)
    ring.run()
    assert isinstance(json.loads(tokenizer.decode(objects.tokens, skip_special_tokens=True)), dict)
    assert ring.holding() == [[], []]

    # the grammar's own cost per token (the mask before each draw and the token after it)
    from swarm.stage.grammar import Constraint

    constraint = Constraint(stages[-1], grammar, eos, [])
    import torch

    logits = torch.zeros(int(stages[-1].config.vocab_size))
    started = time.perf_counter()
    for token in greedy.tokens[:-1]:
        constraint.apply(logits)
        constraint.consume(token)
    per_token = (time.perf_counter() - started) / (len(greedy.tokens) - 1)
    session_summary("structured output", f"{len(greedy.tokens)} tokens in {took:.2f} s over two stages; the "
                                         f"grammar's mask and step {per_token * 1000:.2f} ms a token")


@pytest.fixture(scope="module")
def thinking_dir(module_tmp):
    from scripted import build
    from swarm.store.importer import import_model

    root = module_tmp("thinking")
    build(root / "src", {"assistant\n": ["<think>", "Two and two make four.", "</think>", "The answer is 4."],
                         "\n\n": ["Just 4."]})
    import_model(str(root / "src"), root / "models", "qwen3-thinks")
    return root / "models" / "qwen3-thinks"


async def test_a_reasoning_model_thinks_first_then_follows_the_schema(tmp_path, thinking_dir):
    """Qwen3-style: the grammar applies after the thinking block, so the thinking stays free and the answer is the
    JSON; with thinking off the JSON starts at once."""
    import trio

    from harness import running_swarm

    schema = {"type": "object", "properties": {"answer": {"enum": [4]}}, "required": ["answer"],
              "additionalProperties": False}
    body = {"model": thinking_dir.name, "messages": [{"role": "user", "content": "What is 2+2?"}], "temperature": 0,
            "max_tokens": 30,
            "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}}
    with trio.fail_after(120):
        async with running_swarm(tmp_path, [thinking_dir], fellows=2) as swarm:
            await swarm.load(thinking_dir.name, 2)
            data = (await swarm.http.post("/v1/chat/completions", json=body)).json()
            message = data["choices"][0]["message"]
            assert message["reasoning_content"] == "Two and two make four."
            assert json.loads(message["content"]) == {"answer": 4} and data["choices"][0]["finish_reason"] == "stop"
            off = {**body, "chat_template_kwargs": {"enable_thinking": False}}
            data = (await swarm.http.post("/v1/chat/completions", json=off)).json()
            assert json.loads(data["choices"][0]["message"]["content"]) == {"answer": 4}
            assert "reasoning_content" not in data["choices"][0]["message"]
