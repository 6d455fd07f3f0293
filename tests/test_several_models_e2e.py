"""Several models in one pool (issue 37), over a real leader and two fellows on loopback that lend 0.5 GB each
(SWARM_SERVE_MEMORY_GB): three tiny Llamas with the built-in model's tokenizer, each over both fellows, need about
0.21 GB a stage (weights, KV budget, working memory), so two fit together and a third does not.

A request for a model that is imported but not loaded loads it (auto-load, on by default) and answers; two models
answer chats at once, each transformers' generate (near-tie rule); a third model's request gets a 503 naming the idle
model to unload, and with Evict idle models on, unloads the least recently used one and answers."""

from __future__ import annotations

import concurrent.futures

import httpx
import pytest
import torch

from exactness import check_reply, reference
from swarm.store.manifest import load_manifest
from web_helpers import BackgroundSwarm

pytestmark = pytest.mark.e2e

NAMES = ("tiny-a", "tiny-b", "tiny-c")
TOKENS = 8


def chat_of(name: str) -> list[dict]:
    return [{"role": "user", "content": f"Say something about {name}."}]


@pytest.fixture(scope="module")
def models(module_tmp, smollm_model_dir):
    from tiny_llama import with_tokenizer_of

    root = module_tmp("several-models")
    return {name: with_tokenizer_of(smollm_model_dir, root, name, seed=11 + i) for i, name in enumerate(NAMES)}


@pytest.fixture(scope="module")
def wanted(models):
    """name -> (greedy reply, margins) of transformers' generate in float32."""
    from reference_model import load_reference_model
    from swarm.leader.chat.chat_format import encode_chat

    out = {}
    for name, folder in models.items():
        ids = encode_chat(folder, chat_of(name), None)
        model = load_reference_model(folder, dtype=torch.float32)
        out[name] = reference(model, ids, TOKENS, eos=load_manifest(folder).eos_token_ids)
    return out


@pytest.fixture(scope="module")
def bg(module_tmp, models):
    swarm = BackgroundSwarm(module_tmp("several-models-swarm"), list(models.values()),
                            fellow_env={"SWARM_SERVE_MEMORY_GB": "0.5"}).start()
    try:
        yield swarm
    finally:
        swarm.stop()


@pytest.fixture(scope="module")
def http(bg):
    with httpx.Client(base_url=bg.swarm.url, headers={"authorization": f"Bearer {bg.swarm.token}"},
                      timeout=120) as client:
        yield client


def chat(http, name: str) -> httpx.Response:
    return http.post("/v1/chat/completions", json={"model": name, "messages": chat_of(name), "temperature": 0,
                                                   "max_tokens": TOKENS, "return_token_ids": True})


def statuses(http) -> dict[str, str]:
    return {m["id"]: m["status"] for m in http.get("/v1/models").json()["data"]}


def check(response: httpx.Response, want) -> None:
    assert response.status_code == 200, response.text
    check_reply(response.json()["choices"][0]["token_ids"], *want)


def test_a_request_loads_its_model_and_two_models_answer_at_once(bg, http, wanted):
    assert http.get("/api/v1/settings/models").json() == {"auto_load": True, "evict_idle": False}
    assert http.post("/api/v1/models/tiny-a/load", json={"num_stages": 2}).status_code == 202
    bg.call(bg.swarm.leader.serving.loader.wait_ready, "tiny-a", 120)
    assert statuses(http) == {"tiny-a": "ready", "tiny-b": "not_loaded", "tiny-c": "not_loaded"}

    # tiny-b is imported, not loaded: the request loads it beside tiny-a, waits, and answers
    check(chat(http, "tiny-b"), wanted["tiny-b"])
    assert statuses(http) == {"tiny-a": "ready", "tiny-b": "ready", "tiny-c": "not_loaded"}
    serving = bg.swarm.leader.serving
    assert {s.plan.fellow_id for s in serving.models["tiny-b"].stages} == \
        {s.plan.fellow_id for s in serving.models["tiny-a"].stages}  # both over both fellows

    # chats to both at once, twice each: every reply generate's
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        replies = [(name, pool.submit(chat, http, name)) for name in ("tiny-a", "tiny-b") * 2]
        for name, reply in replies:
            check(reply.result(), wanted[name])


def test_a_third_model_is_refused_saying_what_to_unload_then_evicts_the_idle_one(bg, http, wanted):
    serving = bg.swarm.leader.serving
    for name in ("tiny-a", "tiny-b"):  # loaded as the test above leaves them; tiny-a used last
        if serving.status(name) != "ready":
            assert http.post(f"/api/v1/models/{name}/load", json={"num_stages": 2}).status_code == 202
            bg.call(serving.loader.wait_ready, name, 120)
    check(chat(http, "tiny-b"), wanted["tiny-b"])
    check(chat(http, "tiny-a"), wanted["tiny-a"])  # tiny-b is now the least recently used

    # no room for a third, and evicting is off: a 503 that says what happened and what to unload
    refused = chat(http, "tiny-c")
    assert refused.status_code == 503, refused.text
    error = refused.json()["error"]
    assert error["code"] == "model_not_loaded"
    assert "tiny-c is not loaded, and the pool has no room to load it" in error["message"]
    assert "Unload tiny-b (swarm model-unload tiny-b" in error["message"]
    assert "Evict idle models" in error["message"]
    assert statuses(http) == {"tiny-a": "ready", "tiny-b": "ready", "tiny-c": "not_loaded"}

    # with Evict idle models on, the least recently used idle model goes and tiny-c answers
    switched = http.put("/api/v1/settings/models", json={"evict_idle": True})
    assert switched.json() == {"auto_load": True, "evict_idle": True}
    check(chat(http, "tiny-c"), wanted["tiny-c"])
    assert statuses(http) == {"tiny-a": "ready", "tiny-b": "not_loaded", "tiny-c": "ready"}

    # auto-load off: a request for a model not loaded is refused at once, saying so
    assert http.put("/api/v1/settings/models", json={"auto_load": False, "evict_idle": False}).status_code == 200
    serving.reload_on_request.discard("tiny-b")  # as an admin's unload leaves it (not gone idle)
    refused = chat(http, "tiny-b")
    assert refused.status_code == 503 and "auto-load is off" in refused.json()["error"]["message"]
    assert http.put("/api/v1/settings/models", json={"auto_load": True}).json() == \
        {"auto_load": True, "evict_idle": False}
