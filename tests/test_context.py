"""A model's served context (issue 36): its own unless the admin or its load caps it; placement keeps room for one
conversation of it at the KV cache kind asked for, and a load that cannot says so and offers the length that fits."""

from __future__ import annotations

import pytest
import trio
from starlette.testclient import TestClient

from swarm.config import Settings
from swarm.errors import ConfigError, ContextTooLong, PlacementError
from swarm.leader.api.limits import FALLBACK_CONTEXT, context_reason, served_context
from swarm.leader.planning.placement import OVERHEAD_BYTES, FellowCapacity, ModelSize, place
from swarm.leader.serving.admission import budget
from swarm.leader.serving.models import model_size

GB = 10**9
KV = 100_000  # bytes a token per layer: big enough that the KV cache, not the weights, decides


def size(layers: int = 20, per_layer: int = 10_000_000, kv: int = KV) -> ModelSize:
    return ModelSize((per_layer,) * layers, 50_000_000, 1_000, True, kv)


def test_a_model_serves_its_own_context_unless_a_cap_is_lower():
    assert Settings.from_env({}).serve_context_tokens is None  # unset: each model's own
    assert served_context(32768, None) == 32768
    assert served_context(None, None) == FALLBACK_CONTEXT  # a config that names no context
    assert served_context(32768, 8192) == 8192 and served_context(32768, None, 4096) == 4096
    assert served_context(2048, 8192, 4096) == 2048  # never past what the model was made for
    assert context_reason(2048, None) == "the model's own context"
    assert context_reason(32768, None, 4096) == ("the context its load asked for (context_tokens); the model's own is "
                                                 "32768")
    assert context_reason(32768, 8192) == "SWARM_SERVE_CONTEXT_TOKENS on the leader; the model's own is 32768"
    assert "names no context length" in context_reason(None, None)
    with pytest.raises(ConfigError, match="at least 16 tokens, or unset it"):
        Settings.from_env({"SWARM_SERVE_CONTEXT_TOKENS": "8"})
    with pytest.raises(ConfigError, match="SWARM_SERVE_KV_CACHE is 'q4'"):
        Settings.from_env({"SWARM_SERVE_KV_CACHE": "q4"})


def test_a_ring_that_cannot_hold_one_full_conversation_is_refused_with_the_length_that_fits():
    model = size()
    # each fellow: its 10 layers (100 MB) + working memory + room for ~3,000 tokens of KV cache (10 layers x 100 KB)
    free = 10 * 10_000_000 + 50_000_000 + OVERHEAD_BYTES + 3_000 * 10 * KV
    fellows = [FellowCapacity(1, "a", free), FellowCapacity(2, "b", free)]
    with pytest.raises(PlacementError) as refused:
        place(model, fellows, 2, 32768)
    message = str(refused.value)
    assert message.startswith("stage 0 on a needs ") and "KV cache at 32768 tokens" in message, message
    assert "not even one conversation of the full context fits. At most 2816 tokens fit" in message, message
    assert "--context-tokens 2816" in message and "--kv-cache q8" in message, message
    plans = place(model, fellows, 2, 2816)  # the length offered places
    assert all(p.need_bytes <= free for p in plans)
    # at q8 the same fellows hold ~3.76x as many tokens as at float32 (1.0625 bytes an element against 4)
    q8 = size(kv=int(KV * 1.0625 / 4))
    assert place(q8, fellows, 2, 10240)
    # weights that do not fit at all: no length is offered
    with pytest.raises(PlacementError) as refused:
        place(size(per_layer=10**9), fellows, 2, 1024)
    assert "At most" not in str(refused.value) and "use more stages" in str(refused.value)


def test_one_fellow_keeps_room_for_a_full_conversation_beyond_the_headroom():
    model = size(layers=10)
    weight = 10 * 10_000_000 + 50_000_000 + 1_000
    free = weight + 2 * GB  # 2 GB of KV room: ~1,800 tokens at 1 MB a token
    fellows = [FellowCapacity(1, "solo", free)]
    plans = place(model, fellows, 1, 1024)
    assert plans[0].kv_bytes >= 1024 * 10 * KV
    with pytest.raises(PlacementError) as refused:
        place(model, fellows, 1, 32768)
    message = str(refused.value)
    assert "KV cache at 32768 tokens, one full-length conversation), solo has 2.2 GB free" in message, message
    assert "At most 1792 tokens fit" in message, message
    place(model, fellows, 1, 1792)


def test_placement_and_the_token_budget_count_the_kv_cache_kind():
    manifest = {"dtype": "bfloat16", "num_layers": 2, "hidden_size": 64, "kv_bytes_per_token": 512,
                "files": [{"kind": "layer", "layer": i, "size": 1000} for i in range(2)]}
    cpu = {kind: model_size(manifest, cpu=True, kv_cache=kind).kv_bytes_per_token_per_layer
           for kind in ("auto", "f32", "f16", "q8")}
    assert cpu == {"auto": 1024, "f32": 1024, "f16": 512, "q8": 272}  # 256 elements: float32 on CPU by default
    assert model_size(manifest, cpu=False, kv_cache="auto").kv_bytes_per_token_per_layer == 512  # GPU: bfloat16
    model = size(kv=cpu["auto"])
    fellows = [FellowCapacity(1, "a", GB), FellowCapacity(2, "b", GB)]
    plans = place(model, fellows, 2, 4096)
    free = {1: GB, 2: GB}
    assert budget(plans, free, cpu["q8"], 1024, 4096).tokens > 3.7 * budget(plans, free, cpu["auto"], 1024, 4096).tokens


@pytest.fixture
def leader(tmp_path, tiny_model_dirs):
    from harness import install_model
    from swarm.leader.app import Leader

    leader = Leader(tmp_path / "leader", Settings.from_env({}))
    install_model(tmp_path / "leader", tiny_model_dirs["qwen3"])
    return leader


def test_the_load_call_checks_its_context_and_kv_cache_before_anything_loads(leader):
    token = leader.first_start.admin_token
    with TestClient(leader.app, backend="trio") as client:
        def load(body):
            return client.post("/api/v1/models/qwen3/load", json=body, headers={"authorization": f"Bearer {token}"})

        bad = load({"kv_cache": "q4"})
        assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_kv_cache"
        assert "one of auto, f32, f16, q8" in bad.json()["error"]["message"]
        short = load({"context_tokens": 8})
        assert short.status_code == 400 and short.json()["error"]["code"] == "invalid_context_tokens"
        assert load({"context_tokens": "many"}).json()["error"]["code"] == "invalid_context_tokens"
    assert leader.serving.models == {}


def test_the_served_context_is_the_models_own_then_its_loads_cap(leader):
    serving = leader.serving

    async def context():
        return await serving.contexts.context_of("qwen3")

    assert trio.run(context) == 256  # the tiny model's max_position_embeddings
    serving.context_caps["qwen3"] = 128
    assert trio.run(context) == 128
    with pytest.raises(ContextTooLong, match="maximum context length.*the context its load asked for"):
        serving.contexts.check_context("qwen3", 200, 150, 50)
    assert serving.contexts.largest_context() == FALLBACK_CONTEXT  # nothing loaded yet: the /v1 body limit's context
