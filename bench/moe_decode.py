"""Decoding a mixture of experts: a tiny-but-not-trivial random Qwen3-MoE (8 layers, 32 experts, top-4, hidden 512,
expert rows 256) over 1 and 2 stages in one process (swarm.stage.local.LocalRing: the stages' own code, no network)
against transformers' generate in one process; the share of a token's time spent in the experts; each stage's
memory against the plan; and the planner's speed (this machine's calibration, the layers' active bytes) against the
measured one.

    .venv/bin/python bench/moe_decode.py [--tokens 48] [--rounds 3] [--threads 1] [--quantization none]

Decode speed is (tokens - 1) / (time of a reply of --tokens tokens - time of a reply of 1 token): the prompt's
prefill cancels. Each figure is the median of --rounds rounds. The planner counts a ring of several stages at its
after-idle speed (fellows on PCs of their own); in one process the stages take turns without waiting, so the
2-stage plan is expected a little slower than measured here.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import torch  # noqa: E402

CONFIG = dict(hidden_size=512, num_hidden_layers=8, num_experts=32, num_experts_per_tok=4, moe_intermediate_size=256,
              intermediate_size=1024, num_attention_heads=8, num_key_value_heads=4, head_dim=64, vocab_size=4096,
              max_position_embeddings=2048, tie_word_embeddings=False, initializer_range=0.05, bos_token_id=1,
              eos_token_id=2, pad_token_id=0)
PROMPT = [1, 517, 42, 999, 7, 1500, 3, 88, 2100, 64, 9, 200, 3001, 12, 77, 640]


CHAT_TEMPLATE = ("{% for message in messages %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n"
                 "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def tokenizer_for(source: Path) -> None:
    """A byte-level BPE of CONFIG's vocabulary with a chat template, saved beside the weights: the leader tokenizes
    chats (bench/plan_vs_measured.py --moe serves this model over fellow processes)."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    bpe = ByteLevelBPETokenizer()
    text = ["The quick brown fox jumps over the lazy dog. Count from one to a hundred: one, two, three, four."] * 50
    bpe.train_from_iterator(text, vocab_size=CONFIG["vocab_size"] - 2, min_frequency=1, show_progress=False)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|im_end|>")
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(source)
    config_path = source / "tokenizer_config.json"
    data = json.loads(config_path.read_text())
    data["chat_template"] = CHAT_TEMPLATE
    config_path.write_text(json.dumps(data))


def build(tmp: Path, tokenizer: bool = False) -> tuple[Path, Path]:
    import transformers

    from swarm.store.importer import import_model

    torch.manual_seed(7)
    source = tmp / "src"
    transformers.AutoModelForCausalLM.from_config(transformers.Qwen3MoeConfig(**CONFIG)).save_pretrained(source)
    if tokenizer:
        tokenizer_for(source)
    import_model(str(source), tmp / "models", "moe")
    return source, tmp / "models" / "moe"


def decode_rate(reply, tokens: int, rounds: int) -> tuple[float, list[float]]:
    """Median decode tokens/s of ``reply(n)`` (a greedy reply of n tokens), and each round's."""
    rates = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        reply(1)
        t1 = time.perf_counter()
        reply(tokens)
        t2 = time.perf_counter()
        rates.append((tokens - 1) / ((t2 - t1) - (t1 - t0)))
    return statistics.median(rates), rates


class ExpertClock:
    """Time spent inside the experts modules of ``layers`` while on."""

    def __init__(self, layers):
        self.total, self._t = 0.0, 0.0
        for layer in layers:
            layer.mlp.experts.register_forward_pre_hook(self._start)
            layer.mlp.experts.register_forward_hook(self._stop)

    def _start(self, *_):
        self._t = time.perf_counter()

    def _stop(self, *_):
        self.total += time.perf_counter() - self._t


def expert_share(ring, stages, tokens: int) -> float:
    """The share of a decode token's time ``ring`` spends in its stages' experts: a reply of ``tokens`` less one of
    a single token (its prefill), both timed whole and inside the experts."""
    clock = ExpertClock([layer for stage in stages for layer in stage.layers])
    t0, e0 = time.perf_counter(), clock.total
    ring.generate(PROMPT, 1)
    t1, e1 = time.perf_counter(), clock.total
    ring.generate(PROMPT, tokens)
    t2, e2 = time.perf_counter(), clock.total
    return ((e2 - e1) - (e1 - e0)) / ((t2 - t1) - (t1 - t0))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--quantization", default="none")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    import transformers

    from swarm.fellow import calibration
    from swarm.leader.planning.placement import StagePlan, stage_weight_bytes
    from swarm.leader.planning.planner import Hop, expert_weight_bytes, layer_speed, predict, with_active_experts
    from swarm.leader.serving.models import model_size
    from swarm.stage.local import LocalRing
    from swarm.stage.slice import StageModel
    from swarm.stage.slice_load import stage_specs
    from swarm.store.manifest import load_manifest

    print(f"machine: {platform.machine()} {platform.processor() or ''}, {torch.get_num_threads()} torch threads, "
          f"torch {torch.__version__}, transformers {transformers.__version__}; a shared machine: figures are noisy")
    with tempfile.TemporaryDirectory() as tmp:
        source, model_dir = build(Path(tmp))
        kind = args.quantization
        layers = CONFIG["num_hidden_layers"]
        manifest = json.loads(load_manifest(model_dir).to_json())
        size = model_size(manifest, cpu=True, quantization=kind)
        config = json.loads((model_dir / "config.json").read_text())
        moe_size = with_active_experts(size, config, expert_weight_bytes(manifest, True, kind))
        active = moe_size.compute_bytes or size.layer_bytes
        print(f"model: {layers} layers, {CONFIG['num_experts']} experts, top-{CONFIG['num_experts_per_tok']}, hidden "
              f"{CONFIG['hidden_size']}; a layer {size.layer_bytes[0] / 1e6:.1f} MB, a token reads "
              f"{active[0] / 1e6:.2f} MB of it ({kind})")

        for implementation in ("grouped_mm", "eager"):
            model = transformers.AutoModelForCausalLM.from_pretrained(
                source, dtype=torch.float32, experts_implementation=implementation).eval()
            if kind != "none":
                from swarm.stage.quantize import quantize_model

                model = quantize_model(model, kind)
            ids = torch.tensor([PROMPT])

            def generate(n, model=model, ids=ids):
                with torch.inference_mode():
                    model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)

            rate, rates = decode_rate(generate, args.tokens, args.rounds)
            print(f"transformers generate, one process, experts_implementation={implementation}: {rate:.1f} tok/s "
                  f"(rounds {', '.join(f'{r:.1f}' for r in rates)})")
            del model

        for n in (1, 2):
            specs = stage_specs(layers, n)
            stages = [StageModel.load_dir(model_dir, s, quantization=kind) for s in specs]
            for stage in stages:
                stage.warm_up()
            ring = LocalRing(stages)
            plans, memory = [], []
            for i, (spec, stage) in enumerate(zip(specs, stages)):
                planned = stage_weight_bytes(size, spec.first_layer, spec.end_layer, spec.is_first, spec.is_last)
                plans.append(StagePlan(i, i, f"stage-{i}", spec.first_layer, spec.end_layer, planned, 0))
                memory.append(f"stage {i}: {stage.parameter_bytes() / 1e6:.1f} MB held, {planned / 1e6:.1f} planned")
            hops = [Hop(0.0, True, "in-process")] * n if n > 1 else []
            hidden = CONFIG["hidden_size"] * 4
            measured, ratios, whole_ratios = [], [], []
            for _ in range(args.rounds):  # calibrated right before each measurement: the same load on both
                cal = calibration.measure("cpu", args.threads)
                speed = layer_speed(cal, kind=kind)
                rate, _ = decode_rate(lambda t, ring=ring: ring.generate(PROMPT, t), args.tokens, 1)
                plan = predict(plans, moe_size, dict.fromkeys(range(n), speed), hops, hidden)
                whole = predict(plans, size, dict.fromkeys(range(n), speed), hops, hidden)
                measured.append(rate)
                ratios.append(plan["tokens_per_s"] / rate)
                whole_ratios.append(whole["tokens_per_s"] / rate)
                print(f"  {n} stage(s): calibration: a dense layer's decode {speed.decode_fixed_ms:.2f} ms + "
                      f"{speed.decode_per_byte_ms * 1e6:.3f} ms/MB, MoE routing {cal['moe']['router_ms']:.3f} ms + "
                      f"{cal['moe']['expert_ms']:.3f} ms an expert; planned {plan['tokens_per_s']:.1f} tok/s "
                      f"(every expert counted: {whole['tokens_per_s']:.1f}), measured {rate:.1f}", flush=True)
            share = expert_share(ring, stages, args.tokens)
            each = ", ".join(f"{r:.1f}" for r in measured)
            print(f"swarm, {n} stage(s) in one process: {statistics.median(measured):.1f} tok/s (rounds {each}); "
                  f"experts {share:.0%} of a token's time\n"
                  f"  memory: {'; '.join(memory)}\n"
                  f"  predicted/measured: median {statistics.median(ratios):.2f} (rounds "
                  f"{', '.join(f'{r:.2f}' for r in ratios)}); counting every expert "
                  f"{statistics.median(whole_ratios):.2f}", flush=True)


if __name__ == "__main__":
    main()
