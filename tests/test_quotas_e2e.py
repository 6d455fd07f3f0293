"""Quotas and usage through a real leader and fellow, as a user's program meets them: the openai client gets a 429
with Retry-After and a message saying when it may send again; an API token's own limit holds that token alone;
the admin reads usage per user, token and model as JSON and CSV, a user only their own."""

from __future__ import annotations

import csv
import io

import openai
import pytest
import trio

from harness import running_swarm
from scripted import build, hold_compute
from swarm import cli
from swarm.store.importer import import_model

pytestmark = pytest.mark.e2e

REPLY = "Counted."


@pytest.fixture(scope="module")
def model_dir(module_tmp):
    root = module_tmp("quotas")
    build(root / "src", {"assistant\n": [REPLY]})
    import_model(str(root / "src"), root / "models", "metered")
    return root / "models" / "metered"


async def test_quotas_refuse_with_a_time_to_come_back_and_usage_adds_up(tmp_path, model_dir, monkeypatch, capsys):
    name = model_dir.name
    gate = hold_compute(monkeypatch)
    gate.set()
    with trio.fail_after(200):
        async with running_swarm(tmp_path, [model_dir], fellows=1) as swarm:
            store = swarm.leader.store
            bob = await trio.to_thread.run_sync(store.create_user, "bob", "bob's long password")
            bob_token, laptop = await trio.to_thread.run_sync(store.create_api_token, bob.id, "laptop")
            phone_token, phone = await trio.to_thread.run_sync(store.create_api_token, bob.id, "phone")
            bob_http = {"authorization": f"Bearer {bob_token}"}
            await swarm.load(name, 1)

            def client(token: str) -> openai.OpenAI:
                return openai.OpenAI(base_url=f"{swarm.url}/v1", api_key=token, max_retries=0, timeout=60)

            async def ask(token: str):
                return await trio.to_thread.run_sync(lambda: client(token).chat.completions.create(
                    model=name, messages=[{"role": "user", "content": "Count"}], temperature=0, max_tokens=8))

            # only admins set quotas, and what they set is checked
            refused = await swarm.http.put("/api/v1/quotas/user/bob", json={"concurrent_requests": 1},
                                           headers=bob_http)
            assert refused.status_code == 403
            wrong = await swarm.http.put("/api/v1/quotas/user/bob", json={"tokens_per_week": 1})
            assert wrong.status_code == 400 and "unknown limit" in wrong.json()["error"]["message"]
            nobody = await swarm.http.put("/api/v1/quotas/user/carol", json={})
            assert nobody.status_code == 400 and "no user 'carol'" in nobody.json()["error"]["message"]

            # a day's completion tokens: the first reply fits, the next is refused until the window lets go
            first = await ask(bob_token)
            assert first.choices[0].message.content == REPLY
            used = first.usage.completion_tokens
            assert (await swarm.http.put("/api/v1/quotas/user/bob",
                                         json={"completion_tokens_per_day": used})).status_code == 200
            with pytest.raises(openai.RateLimitError) as info:
                await ask(phone_token)
            error = info.value
            assert error.status_code == 429 and error.code == "quota_exceeded"
            wait = int(error.response.headers["retry-after"])
            assert 86_000 < wait <= 86_400
            assert f"you have used {used} of the {used} completion tokens per day" in error.message
            assert "your account allows" in error.message and "You can send again at" in error.message
            # the admin lifts it: bob may chat again at once
            assert (await swarm.http.delete("/api/v1/quotas/user/bob")).status_code == 200
            assert (await ask(phone_token)).choices[0].message.content == REPLY

            # a token's own limit: one request at once on the laptop's token, the phone's is free
            put = await swarm.http.put(f"/api/v1/quotas/token/{laptop.id}", json={"concurrent_requests": 1})
            assert put.json() == {"scope": "token", "id": laptop.id, "limits": {"concurrent_requests": 1}}
            gate.clear()  # the next reply stays in flight
            replies = []

            async def held_reply():
                replies.append(await ask(bob_token))

            def laptop_busy() -> bool:
                book = swarm.leader.serving.book
                return any(r.token_id == laptop.id for r in [*book.by_rid.values(), *book.waiting.get(name, [])])

            async with trio.open_nursery() as nursery:
                nursery.start_soon(held_reply)
                with trio.fail_after(20):
                    while not laptop_busy():
                        await trio.sleep(0.05)
                with pytest.raises(openai.RateLimitError) as info:
                    await ask(bob_token)
                assert "this API token allows 1 request at once" in info.value.message
                assert info.value.response.headers["retry-after"] == "5"
                gate.set()
            assert replies[0].choices[0].message.content == REPLY
            assert (await ask(phone_token)).choices[0].message.content == REPLY
            listed = (await swarm.http.get("/api/v1/quotas")).json()
            assert listed["quotas"] == [{"scope": "token", "id": laptop.id, "name": f"laptop ({laptop.prefix}…)",
                                         "limits": {"concurrent_requests": 1},
                                         "updated_at": listed["quotas"][0]["updated_at"]}]

            # usage per user, token and model, once the records are written (a second or two after each reply)
            async def usage(**query) -> dict:
                return (await swarm.http.get("/api/v1/usage", params={"by": "user,token,model", **query})).json()

            with trio.fail_after(20):
                while sum(r["requests"] for r in (await usage())["rows"]) < 4:
                    await trio.sleep(0.5)
            rows = [r for r in (await usage())["rows"] if r["user"] == "bob"]
            by_token = {r["token"]: r["requests"] for r in rows}
            assert by_token == {f"laptop ({laptop.prefix}…)": 2, f"phone ({phone.prefix}…)": 2}
            assert all(r["model"] == name and r["completion_tokens"] == r["requests"] * used for r in rows)
            text = (await swarm.http.get("/api/v1/usage", params={"by": "user", "format": "csv"})).text
            table = list(csv.DictReader(io.StringIO(text)))
            assert {r["user"]: int(r["requests"]) for r in table}["bob"] == 4
            # bob sees his own usage, not others'
            own = (await swarm.http.get("/api/v1/usage", params={"by": "user"}, headers=bob_http)).json()
            assert {r["user"] for r in own["rows"]} == {"bob"}
            other = await swarm.http.get("/api/v1/usage", params={"user": "admin"}, headers=bob_http)
            assert other.status_code == 403

            # the same from the command line
            async def swarm_cli(*argv: str) -> tuple[int, str, str]:
                code = await trio.to_thread.run_sync(
                    cli.main, [*argv, "--leader", swarm.url, "--token", swarm.token])
                out = capsys.readouterr()
                return code, out.out, out.err

            code, out, _ = await swarm_cli("admin", "quota-set", "user", "bob", "--prompt-tokens-per-day", "5000",
                                           "--concurrent-requests", "2")
            assert code == 0 and out == "user bob: prompt_tokens_per_day 5000, concurrent_requests 2\n"
            code, out, _ = await swarm_cli("admin", "quotas")
            assert "user   bob: concurrent_requests 2, prompt_tokens_per_day 5000" in out
            assert f"token  laptop ({laptop.prefix}…): concurrent_requests 1" in out
            code, out, _ = await swarm_cli("admin", "usage", "--by", "user", "--csv")
            assert out.splitlines()[0] == "period,user_id,user,requests,failed,prompt_tokens,completion_tokens"
            code, out, _ = await swarm_cli("admin", "usage", "--by", "token", "--user", "bob")
            assert code == 0 and f"phone ({phone.prefix}…): 2 requests (0 failed)" in out
            code, _, err = await swarm_cli("admin", "quota-remove", "user", "carol")
            assert code == 1 and "there is no user 'carol'" in err
