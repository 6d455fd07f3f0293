"""Drafting ahead with a draft model (SWARM_SERVE_DRAFT_MODEL) through the real ring protocol and stage models in one
process: where the draft model is the target itself every guess is kept; a different model's guesses are mostly
thrown away; the greedy reply is generate's either way. The draft model's cache follows the ring's (cropped to what
was kept, never fed the conversation again). The leader's choice of the draft model, and its refusals, as plain
functions; the draft model's memory in placement and the token budget."""

from __future__ import annotations

import dataclasses

import pytest

from exactness import check_reply, reference
from reference_model import load_reference_model
from swarm.errors import PlacementError
from swarm.leader.planning.draft_model import (
    Candidate,
    check_named,
    choose_auto,
    same_tokenizers,
    shares_vocabulary,
)
from swarm.leader.planning.placement import DraftSize, FellowCapacity, ModelSize, place
from swarm.leader.serving.admission import budget
from swarm.stage import LocalRing, StageModel, StageSpec, drafting, stage_specs
from swarm.stage.draft_model import DraftModel
from swarm.store.manifest import load_manifest

PROMPT = [5, 17, 42, 99, 7, 3, 250, 11]
STEPS = 40


def whole(model_dir) -> StageModel:
    return StageModel.load_dir(model_dir, StageSpec(0, load_manifest(model_dir).num_layers, True, True))


def ring_of(model_dir, stages: int, draft_dir=None) -> LocalRing:
    specs = stage_specs(load_manifest(model_dir).num_layers, stages)
    models = [StageModel.load_dir(model_dir, s) for s in specs]
    if draft_dir is not None:
        models[-1].drafter = DraftModel(whole(draft_dir))
    return LocalRing(models, prefill_chunk=4)


def counting(drafter: DraftModel) -> list[int]:
    """Token positions the draft model computes, counted by wrapping its forward."""
    fed = [0]
    forward = drafter.model.forward

    def counted(rid, position, input_ids=None, **kwargs):
        fed[0] += input_ids.shape[1]
        return forward(rid, position, input_ids=input_ids, **kwargs)

    drafter.model.forward = counted
    return fed


@pytest.mark.parametrize("stages", [2, 3])
def test_draft_model_that_is_the_target_has_every_guess_kept(tiny_model_dirs, stages):
    """The tiny Llama's reply from PROMPT never repeats two tokens, so prompt lookup proposes nothing (checked); the
    same model as the draft model then guesses right every time, and the reply is generate's in a quarter of the
    passes."""
    llama = tiny_model_dirs["llama"]
    want, margins = reference(load_reference_model(llama), PROMPT, STEPS)
    ring = ring_of(llama, stages)
    reply = ring.submit("lookup", PROMPT, STEPS, draft=3)
    ring.run()
    check_reply(reply.tokens, want, margins)
    assert ring.times["lookup"][stages - 1].spec_drafted == 0  # prompt lookup alone finds nothing here

    ring = ring_of(llama, stages, draft_dir=llama)
    drafter = ring.stages[-1].drafter
    fed = counting(drafter)
    reply = ring.submit("draft", PROMPT, STEPS, draft=3)
    ring.run()
    check_reply(reply.tokens, want, margins)
    spec = ring.times["draft"][stages - 1]
    assert spec.spec_tokens == STEPS and spec.spec_passes == spec.spec_tokens - spec.spec_accepted
    assert spec.spec_accepted == spec.spec_drafted > 0, spec
    assert spec.spec_passes <= STEPS // 3, spec  # 3 guesses and one more per pass, nearly always
    # the draft model read the prompt and each token once, plus its own guesses: never the conversation again
    assert fed[0] <= len(PROMPT) + STEPS + spec.spec_drafted, (fed[0], spec)
    assert drafter.requests() == [] and ring.stages[-1].requests() == []  # its cache went with the request


def test_another_draft_model_has_guesses_thrown_away_and_the_reply_exact(tiny_model_dirs, monkeypatch):
    """A different tiny model (same vocabulary, other weights) guesses: nearly all are rejected, its cache is cropped
    back each time, and the reply is still generate's. The other way round with the Qwen3, whose reply repeats:
    prompt lookup's guesses and the draft model's together, the reply generate's, and prompt lookup runs once a
    pass (the draft model's side hands its proposal on)."""
    llama, qwen3 = tiny_model_dirs["llama"], tiny_model_dirs["qwen3"]
    lookups = [0]
    propose = drafting.propose

    def counted(*args, **kwargs):
        lookups[0] += 1
        return propose(*args, **kwargs)

    monkeypatch.setattr(drafting, "propose", counted)
    for target, draft in ((llama, qwen3), (qwen3, llama)):
        want, margins = reference(load_reference_model(target), PROMPT, STEPS)
        ring = ring_of(target, 2, draft_dir=draft)
        fed = counting(ring.stages[-1].drafter)
        lookups[0] = 0
        reply = ring.submit("a", PROMPT, STEPS, draft=3)
        ring.run()
        assert 0 < lookups[0] <= ring.times["a"][1].spec_passes, lookups
        check_reply(reply.tokens, want, margins)
        spec = ring.times["a"][1]
        assert spec.spec_tokens == STEPS and spec.spec_passes == spec.spec_tokens - spec.spec_accepted
        assert spec.spec_drafted > spec.spec_accepted, spec  # guesses thrown away
        assert spec.spec_drafted >= spec.spec_passes - 2, spec  # it guessed in nearly every pass
        if target == llama:  # lookup finds nothing there: the schedule took the draft model to one guess a pass
            assert spec.spec_drafted <= spec.spec_passes + 3, spec
        assert fed[0] <= len(PROMPT) + STEPS + spec.spec_drafted, (fed[0], spec)


def test_draft_model_stops_with_the_reply_and_while_busy(tiny_model_dirs):
    """An eos token or max_tokens inside a verified pass ends the reply there, the draft model's cache with it; with
    more chats than stages nobody guesses (the draft model is not even run)."""
    llama = tiny_model_dirs["llama"]
    model = load_reference_model(llama)
    want, margins = reference(model, PROMPT, STEPS)
    eos = [want[9]]
    cut, _ = reference(model, PROMPT, STEPS, eos=eos)
    ring = ring_of(llama, 2, draft_dir=llama)
    reply = ring.submit("eos", PROMPT, STEPS, eos=eos, draft=3)
    short = ring.submit("short", PROMPT, 6, draft=4)
    ring.run()
    assert reply.tokens == cut and reply.finish_reason == "stop"
    assert short.tokens == want[:6] and short.finish_reason == "length"
    assert ring.stages[-1].drafter.requests() == []

    ring = ring_of(llama, 2, draft_dir=llama)
    fed = counting(ring.stages[-1].drafter)
    replies = [ring.submit(f"r{i}", PROMPT, 12, draft=3) for i in range(3)]
    ring.run()
    for r in replies:
        check_reply(r.tokens, want[:12], margins)
    assert sum(ring.times[f"r{i}"][1].spec_drafted for i in range(3)) < 3 * 12
    assert fed[0] < 3 * (len(PROMPT) + 12)


# --- the leader's choice --------------------------------------------------------------------------------------------

GB = 10**9
QWEN = "d" * 64  # a vocabulary digest


def model(name, size_gb, vocabulary=QWEN, pool=1, sliding=False, vocab=151936):
    return Candidate(name, pool, int(size_gb * GB), vocab, vocabulary, sliding)


def test_auto_picks_the_smallest_smaller_model_of_the_pool_with_the_tokenizer():
    target = model("qwen3-32b", 64)
    catalogue = [target, model("qwen3-8b", 16), model("qwen3-0.6b", 1.2), model("qwen3-0.6b@lab", 1.2, pool=2),
                 model("llama-1b", 1.0, vocabulary="e" * 64, vocab=128256), model("qwen3-1.7b", 3.4),
                 model("qwen3-big", 70), model("mistral-tiny", 0.5, sliding=True)]
    chosen, why = choose_auto(target, catalogue)
    assert chosen.name == "qwen3-0.6b" and why == ""
    # tokenizer files that differ byte for byte: the comparison decides
    catalogue = [model("other-0.6b", 1.2, vocabulary="f" * 64), model("qwen3-8b", 16)]
    assert choose_auto(target, catalogue, compare=lambda a, b: b == "other-0.6b")[0].name == "other-0.6b"
    assert choose_auto(target, catalogue, compare=lambda a, b: False)[0].name == "qwen3-8b"
    # none: why, and what to import
    chosen, why = choose_auto(model("qwen3-0.6b", 1.2), catalogue + [model("qwen3-32b", 64)])
    assert chosen is None
    assert "no smaller model in its pool" in why and "Import a small model of its family" in why
    chosen, why = choose_auto(target, [model("llama-1b", 1.0, vocabulary="e" * 64)])
    assert chosen is None and "1 smaller model of its pool, none with its tokenizer" in why


def test_a_named_draft_model_that_cannot_draft_refuses_the_load():
    target = model("qwen3-32b", 64)
    assert check_named(target, "qwen3-0.6b", model("qwen3-0.6b", 1.2)).name == "qwen3-0.6b"
    assert check_named(target, "qwen3-32b", target) is target  # the target itself: allowed (every guess kept)
    with pytest.raises(PlacementError, match=r"names nope, which is not in the catalogue.*Import it into that pool"):
        check_named(target, "nope", None)
    with pytest.raises(PlacementError, match="in another pool"):
        check_named(target, "qwen3-0.6b", model("qwen3-0.6b", 1.2, pool=2))
    with pytest.raises(PlacementError, match="whose tokenizer is not qwen3-32b's.*needs the target's tokenizer"):
        check_named(target, "llama-1b", model("llama-1b", 1.0, vocabulary="e" * 64))
    with pytest.raises(PlacementError, match="sliding-window"):
        check_named(target, "m", model("m", 1.0, sliding=True))
    # models without a tokenizer (token ids only): the same vocabulary size
    assert shares_vocabulary(model("a", 1, vocabulary=None, vocab=320), model("b", 1, vocabulary=None, vocab=320))
    assert not shares_vocabulary(model("a", 1, vocabulary=None, vocab=320), model("b", 1, vocabulary=None, vocab=321))
    assert not shares_vocabulary(model("a", 1, vocabulary=None), model("b", 1))


@pytest.mark.e2e
def test_tokenizers_compared_by_vocabulary_and_probe(smollm_model_dir, tmp_path):
    from transformers import AutoTokenizer

    smollm = AutoTokenizer.from_pretrained(smollm_model_dir)
    assert same_tokenizers(smollm, AutoTokenizer.from_pretrained(smollm_model_dir))
    other = AutoTokenizer.from_pretrained(smollm_model_dir)
    other.add_tokens(["<draft-only>"])  # one more token: another vocabulary
    assert not same_tokenizers(smollm, other)


def test_the_draft_model_counts_in_the_last_stage_memory():
    """The last fellow holds the draft model's weights and its cache: it gets fewer layers, its need grows, and the
    ring's token budget shrinks; a draft model that does not fit says so."""
    size = ModelSize(tuple([100_000_000] * 8), 50_000_000, 50_000_000, False, 10_000)
    fellows = [FellowCapacity(1, "a", 4 * GB), FellowCapacity(2, "b", 4 * GB)]
    plain = place(size, fellows, 2, 4096)
    draft = DraftSize(1_000_000_000, 40_000)
    with_draft = place(size, fellows, 2, 4096, draft=draft)
    assert with_draft[-1].end_layer - with_draft[-1].first_layer < plain[-1].end_layer - plain[-1].first_layer
    assert with_draft[-1].draft_bytes == draft.weight_bytes and with_draft[0].draft_bytes == 0
    assert with_draft[-1].need_bytes > plain[-1].need_bytes - plain[-1].weight_bytes + with_draft[-1].weight_bytes
    free = {1: 4 * GB, 2: 4 * GB}
    assert budget(with_draft, free, 10_000, 1024, 4096).tokens < budget(plain, free, 10_000, 1024, 4096).tokens
    with pytest.raises(PlacementError, match=r"GB draft model\).*unset SWARM_SERVE_DRAFT_MODEL"):
        place(size, fellows, 2, 4096, draft=DraftSize(4 * GB, 0))


def test_the_draft_model_setting_needs_drafting_ahead():
    from swarm.config import Settings
    from swarm.errors import ConfigError

    assert Settings.from_env({"SWARM_SERVE_SPECULATIVE": "3", "SWARM_SERVE_DRAFT_MODEL": "auto"}).serve_draft_model \
        == "auto"
    assert Settings.from_env({}).serve_draft_model is None
    with pytest.raises(ConfigError, match="drafting ahead is off.*SWARM_SERVE_SPECULATIVE=2"):
        Settings.from_env({"SWARM_SERVE_DRAFT_MODEL": "auto"})


def test_sampled_choices_of_one_prompt_draft_and_leave_nothing_behind(tiny_model_dirs):
    """A group (sampled choices of one prompt, prefilled once): the prompt's carrier guesses nothing, each choice
    guesses with the draft model once it has a token, and when they end no draft cache is left -- the carrier's
    went when its cache was handed on."""
    from swarm import messages

    llama = tiny_model_dirs["llama"]
    ring = ring_of(llama, 2, draft_dir=llama)
    sampling = messages.Sampling(temperature=0.8, seed=5)
    replies = ring.submit_group("carrier", [("c1", 1), ("c2", 2)], PROMPT, 12, sampling)
    generate = ring.inboxes[0].pop()
    ring.inboxes[0].append(dataclasses.replace(generate, draft=3))
    ring.run()
    assert all(len(r.tokens) == 12 and r.error is None for r in replies.values())
    assert sum(ring.times[rid][1].spec_drafted for rid in replies) > 0
    assert ring.stages[-1].drafter.requests() == [] and ring.holding() == [[], []]


def test_a_draft_model_that_does_not_fit_or_an_older_last_fellow_leaves_it_out_or_refuses():
    """The leader's choice at placement (Loader._with_draft_model): counted on the last fellow when it fits and that
    fellow runs draft models; left out, with a log line, where the fellow is of an earlier version or -- auto -- it
    does not fit; a draft model named explicitly that does not fit refuses the load."""
    from types import SimpleNamespace as NS

    from swarm.config import Settings
    from swarm.leader.serving.loader import Loader

    size = ModelSize(tuple([100_000_000] * 8), 50_000_000, 50_000_000, False, 10_000)
    fellows = [FellowCapacity(1, "a", 4 * GB), FellowCapacity(2, "b", 4 * GB)]
    plans = place(size, fellows, 2, 4096)

    def leader(setting: str, draft_model: bool = True):
        settings = Settings.from_env({"SWARM_SERVE_SPECULATIVE": "3", "SWARM_SERVE_DRAFT_MODEL": setting})
        return NS(settings=settings, hub=NS(online={1: NS(name="a", draft_model=True),
                                                    2: NS(name="b", draft_model=draft_model)}))

    fits, too_big = DraftSize(GB, 40_000), DraftSize(4 * GB, 0)
    chosen = Loader(leader("auto"))._with_draft_model("m", plans, size, fellows, 2, fits)
    assert chosen[-1].draft_bytes == GB
    assert Loader(leader("auto", draft_model=False))._with_draft_model("m", plans, size, fellows, 2, fits) is plans
    assert Loader(leader("auto"))._with_draft_model("m", plans, size, fellows, 2, too_big) is plans
    with pytest.raises(PlacementError, match="draft model"):
        Loader(leader("small"))._with_draft_model("m", plans, size, fellows, 2, too_big)
