"""The browser app in a real headless Chromium against a real leader and two fellows serving SmolLM2 over 2 stages.

One swarm and one load serve the whole module: the swarm runs in its own trio loop on a background thread and the
tests drive Playwright's sync API from the test thread. Screenshots go to test-artifacts/."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time

import httpx
import pytest

from harness import wait_for
from web_helpers import ARTIFACTS, CHROMIUM_ARGS, BackgroundSwarm, chromium_path

pytestmark = [pytest.mark.browser, pytest.mark.e2e]

playwright_sync = pytest.importorskip("playwright.sync_api")
if chromium_path() is None:
    pytest.skip("Chromium is not installed (apt-get install chromium)", allow_module_level=True)

expect = playwright_sync.expect


@pytest.fixture(scope="module")
def bg(module_tmp, smollm_model_dir):
    swarm = BackgroundSwarm(module_tmp("web"), [smollm_model_dir]).start()
    try:
        swarm.call(swarm.swarm.load, smollm_model_dir.name, 2)
        yield swarm
    finally:
        swarm.stop()


@pytest.fixture(scope="module")
def model(smollm_model_dir) -> str:
    return smollm_model_dir.name


@pytest.fixture(scope="module")
def browser():
    ARTIFACTS.mkdir(exist_ok=True)
    with playwright_sync.sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=chromium_path(), args=CHROMIUM_ARGS, headless=True)
        yield chromium
        chromium.close()


def api(bg, method: str, path: str, **kwargs) -> httpx.Response:
    """The admin's API token, from the test thread."""
    with httpx.Client(base_url=bg.swarm.url, headers={"authorization": f"Bearer {bg.swarm.token}"}, timeout=30) as c:
        return c.request(method, path, **kwargs)


def signed_in_page(bg, browser, user_id: int = 1, width: int = 1280, height: int = 860, max_tokens: int = 24,
                   column: str = "chats", not_loaded: str | None = None):
    """A fresh browser context signed in through a one-time link, with small replies for speed. With ``not_loaded``
    (a model), that model is unloaded first and the page opens showing it not loaded."""
    if not_loaded is not None:
        assert api(bg, "POST", f"/api/v1/models/{not_loaded}/unload").status_code == 200
    context = browser.new_context(viewport={"width": width, "height": height})
    context.grant_permissions(["clipboard-read", "clipboard-write"], origin=bg.swarm.url)
    context.add_init_script(f"""
        localStorage.setItem('swarm.maxTokens', '{max_tokens}');
        localStorage.setItem('swarm.temperature', '0');
        if (!localStorage.getItem('swarm.column'))
            localStorage.setItem('swarm.column', {json.dumps(json.dumps(column))});
    """)
    page = context.new_page()
    page.set_default_timeout(20_000)
    errors = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.errors = errors
    link = bg.sync(bg.swarm.leader.store.create_login_link, user_id)
    page.goto(f"{bg.swarm.url}/auth/link?token={link}")
    expect(page.locator("#status-pill")).to_have_text("Model not loaded" if not_loaded else "Model ready")
    return page


def expect_ready(bg, page, model: str, timeout_ms: int = 120_000) -> None:
    """The page shows the model ready within ``timeout_ms``; else fail with the page's error line and the API's view
    of the model (its status and load error), not just the pill's text."""
    try:
        expect(page.locator("#status-pill")).to_have_text("Model ready", timeout=timeout_ms)
    except AssertionError as exc:
        box = page.locator("#page-error")
        shown = box.inner_text() if box.is_visible() else "(no error shown)"
        view = api(bg, "GET", f"/api/v1/models/{model}").json()
        raise AssertionError(f"{model} is not ready: the page says {shown!r}; the API says status "
                             f"{view.get('status')!r}, error {view.get('error')!r}, "
                             f"stages {view.get('stages')}") from exc


def shot(page, name: str) -> None:
    page.screenshot(path=str(ARTIFACTS / f"{name}.png"), full_page=False)


def test_sign_in_with_password_and_signed_out_redirect(bg, browser):
    context = browser.new_context()
    page = context.new_page()
    page.goto(f"{bg.swarm.url}/pools/admin/default/inference")
    page.wait_for_url("**/login**")
    page.fill("#name", "admin")
    page.fill("#password", "wrong")
    page.click("#signin-button")
    expect(page.locator("#signin-error")).to_be_visible()
    shot(page, "login")
    page.fill("#password", bg.swarm.leader.first_start.admin_password)
    page.click("#signin-button")
    page.wait_for_url("**/inference**")
    assert page.url.endswith("/pools/admin/default/inference"), page.url  # back where the signed-out visit began
    expect(page.locator("#status-pill")).to_have_text("Model ready")
    context.close()


def test_chat_streams_saves_and_survives_reload(bg, browser, model):
    page = signed_in_page(bg, browser)
    box = page.locator("#composer-input")
    box.fill("What is the capital of France?")
    box.press("Shift+Enter")
    assert box.input_value().endswith("\n")  # Shift+Enter is a new line, not a send
    box.press("Enter")
    reply = page.locator(".msg.assistant").last
    expect(reply.locator(".answer")).not_to_be_empty()
    expect(reply.locator(".speed")).to_contain_text("tokens/s", timeout=60_000)
    expect(reply.locator(".speed")).to_contain_text("s to first token")
    # the fellows' split of each token's time (swarm.timing in the stream's last chunk), as in the seed
    expect(reply.locator(".speed")).to_contain_text(
        re.compile(r"s to first token · stage 0 [\d.]+ ms/token · link [\d.]+ ms · stage 1 [\d.]+ ms$"))
    line = reply.locator(".speed").inner_text()
    expect(reply.locator(".model-name")).to_have_text(model)
    expect(page.locator("#save-state")).to_have_text("Saved")
    expect(page.locator("#announcer")).not_to_be_empty()
    assert "#chat=" in page.url
    text = reply.locator(".answer").inner_text()
    assert text.strip()
    shot(page, "chat-1280")
    chat_id = page.url.split("#chat=")[1]
    # Reload: the address names the chat; it comes back with its reply, model and speed line as it was.
    page.reload()
    expect(page.locator(".msg.assistant .answer")).to_have_text(text)
    expect(page.locator(".msg.assistant .speed")).to_have_text(line)
    expect(page.locator(f'.chat-row[data-chat-id="{chat_id}"]')).to_be_visible()
    expect(page.locator(".chat-group h3").first).to_have_text("Today")
    assert not page.errors, page.errors
    page.context.close()


def test_stop_ends_generation_on_the_fellows(bg, browser, model):
    page = signed_in_page(bg, browser, max_tokens=2000)
    page.locator("#composer-input").fill("Write a very long story about a dragon who learns to bake bread.")
    page.locator("#composer-input").press("Enter")
    reply = page.locator(".msg.assistant").last
    expect(page.locator("#stop-button")).to_be_visible()
    # (a locator wait: the page's CSP forbids the eval a string predicate of wait_for_function needs)
    expect(reply.locator(".answer")).to_have_text(re.compile(r"[\s\S]{41}"), timeout=60_000)  # > 40 characters
    assert bg.swarm.leader.serving.requests, "the reply should still be generating"
    page.click("#stop-button")
    expect(page.locator("#send-button")).to_be_visible()
    expect(reply.locator(".speed")).to_contain_text("stopped")
    def generating():
        return bg.sync(lambda: (list(bg.swarm.leader.serving.requests),
                                [list(f.stages[model].driver.stage_model.requests()) for f in bg.swarm.fellows]))

    wait_for(lambda: generating() == ([], [[]] * len(bg.swarm.fellows)), 10, interval=0.2,
             message=lambda: f"still generating after Stop: {generating()}")
    expect(page.locator("#save-state")).to_have_text("Saved")
    page.context.close()


def test_saved_chats_rename_search_delete(bg, browser, model):
    created = []
    for title in ("Alpha notes", "Beta plans"):
        r = api(bg, "POST", "/api/v1/chats", json={"title": title, "model": model, "messages": [
            {"role": "user", "content": f"About {title}"}, {"role": "assistant", "content": "Sure.", "model": model}]})
        assert r.status_code == 201, r.text
        created.append(r.json()["id"])
    page = signed_in_page(bg, browser)
    rows = page.locator(".chat-row")
    expect(rows.first).to_contain_text("Beta plans")  # most recently used first
    expect(rows.first).to_contain_text("2 messages")
    # Search filters by title.
    page.fill(".chat-search", "alpha")
    expect(page.locator(".chat-row")).to_have_count(1)
    expect(page.locator(".chat-row")).to_contain_text("Alpha notes")
    page.fill(".chat-search", "")
    expect(page.locator(".chat-row")).to_have_count(len(api(bg, "GET", "/api/v1/chats").json()["chats"]))
    # Rename from the row's … menu.
    row = page.locator(f'.chat-row[data-chat-id="{created[0]}"]')
    row.get_by_role("button", name="More actions for Alpha notes").click()
    page.get_by_role("menuitem", name="Rename").click()
    page.locator("dialog input").fill("Gamma renamed")
    page.locator("dialog").get_by_role("button", name="Rename").click()
    expect(row).to_contain_text("Gamma renamed")
    assert api(bg, "GET", f"/api/v1/chats/{created[0]}").json()["title"] == "Gamma renamed"
    # Open it, rename from the bar, then delete from the bar (asks first).
    row.locator(".chat-open").click()
    expect(page.locator("#chat-title")).to_have_text("Gamma renamed")
    page.click("#rename-chat")
    page.locator("dialog input").fill("Delta")
    page.keyboard.press("Enter")
    expect(page.locator("#chat-title")).to_have_text("Delta")
    page.click("#delete-chat")
    page.locator("dialog").get_by_role("button", name="Cancel").click()
    assert api(bg, "GET", f"/api/v1/chats/{created[0]}").status_code == 200
    page.click("#delete-chat")
    page.locator("dialog").get_by_role("button", name="Delete").click()
    expect(page.locator(f'.chat-row[data-chat-id="{created[0]}"]')).to_have_count(0)
    expect(page.locator("#chat-title")).to_have_text("New chat")
    assert api(bg, "GET", f"/api/v1/chats/{created[0]}").status_code == 404
    # Delete from the row menu.
    other = page.locator(f'.chat-row[data-chat-id="{created[1]}"]')
    other.get_by_role("button", name="More actions for Beta plans").click()
    page.get_by_role("menuitem", name="Delete").click()
    page.locator("dialog").get_by_role("button", name="Delete").click()
    expect(other).to_have_count(0)
    page.context.close()


RICH = """Here is the maths: the area is \\(\\pi r^2\\), and the sum is

$$\\sum_{i=1}^{n} i = \\frac{n(n+1)}{2}$$

and \\[E = mc^2\\]. A coffee costs $5 and a sandwich $10.

```python
def greet(name):
    return f"Hello, {name}!"
```

| Stage | Fellow | Layers |
|---|---|---|
| 0 | fellow-0 | L0-14 |
| 1 | fellow-1 | L15-29 |

```mermaid
graph LR
  A[Stage 0] --> B[Stage 1]
```

```mermaid
graph LR
  A[ --> oops ((
```
"""


def test_rendering_math_code_table_mermaid_reasoning(bg, browser, model):
    messages = [
        {"role": "user", "content": "Show me everything"},
        {"role": "assistant", "content": "<think>The user wants a demo.</think>" + RICH, "model": model,
         "stats": {"tps": 12.5, "tokens": 80, "ttft_ms": 420},
         "timing": {"split": "fellows", "link_ms_per_token": 152.4,
                    "stages": [{"stage": 0, "compute_ms_per_token": 4.04},
                               {"stage": 1, "compute_ms_per_token": 0.46}]}},
        {"role": "user", "content": "And briefly?"},
        {"role": "assistant", "content": "<think>\n\n</think>Short answer.", "model": model,
         "stats": {"tps": 80, "tokens": 3, "ttft_ms": 90},
         "timing": {"split": "fellows", "link_ms_per_token": None,
                    "stages": [{"stage": 0, "compute_ms_per_token": 12}]}},
    ]
    r = api(bg, "POST", "/api/v1/chats", json={"title": "Rendering", "model": model, "messages": messages})
    chat_id = r.json()["id"]
    page = signed_in_page(bg, browser)
    page.goto(f"{bg.swarm.url}/pools/admin/default/inference#chat={chat_id}")
    first = page.locator(".msg.assistant").first
    expect(first.locator(".katex")).to_have_count(3)
    expect(first.locator(".katex-display")).to_have_count(2)
    expect(first.locator(".answer")).to_contain_text("A coffee costs $5 and a sandwich $10.")
    code = first.locator(".code-block").first
    expect(code.locator(".hljs-keyword").first).to_have_text("def")
    code.get_by_role("button", name="Copy code").click()
    clip = page.evaluate("navigator.clipboard.readText()")
    assert clip.startswith("def greet(name):") and "Hello" in clip
    expect(first.locator("table th")).to_have_count(3)
    expect(first.locator("table td").first).to_have_text("0")
    expect(first.locator(".mermaid-diagram svg")).to_have_count(1, timeout=20_000)
    expect(first.locator(".mermaid-error")).to_contain_text("Diagram error")
    reasoning = first.locator("details.reasoning")
    expect(reasoning).to_be_visible()
    assert reasoning.get_attribute("open") is None  # collapsed once the reply is complete
    expect(first.locator(".speed")).to_have_text(
        "12.5 tokens/s · 80 tokens · 0.42 s to first token · stage 0 4 ms/token · link 152 ms · stage 1 0.5 ms")
    last = page.locator(".msg.assistant").last
    expect(last.locator(".speed")).to_have_text(
        "80.0 tokens/s · 3 tokens · 0.09 s to first token · compute 12 ms/token")
    expect(last.locator("details.reasoning")).to_be_hidden()  # an empty Reasoning block is hidden
    expect(last.get_by_role("button", name="Regenerate")).to_be_visible()
    first.scroll_into_view_if_needed()
    shot(page, "rendering")
    assert not page.errors, page.errors
    page.context.close()


def test_another_user_cannot_open_the_chat(bg, browser, model):
    r = api(bg, "POST", "/api/v1/chats", json={"title": "Private", "model": model,
                                               "messages": [{"role": "user", "content": "secret"}]})
    chat_id = r.json()["id"]
    r = api(bg, "POST", "/api/v1/users", json={"name": "bob", "password": "bob-password-1"})
    assert r.status_code == 201, r.text
    bob = r.json()["user"]["id"]
    page = signed_in_page(bg, browser, user_id=bob)
    page.goto(f"{bg.swarm.url}/pools/admin/default/inference#chat={chat_id}")
    expect(page.locator("#page-error")).to_contain_text("not yours")
    expect(page.locator(".msg")).to_have_count(0)
    expect(page.locator(f'.chat-row[data-chat-id="{chat_id}"]')).to_have_count(0)
    page.goto(f"{bg.swarm.url}/admin")
    expect(page.locator("#admin-main")).to_contain_text("This page is for admins")
    page.context.close()


def test_layout_wide_and_phone(bg, browser):
    page = signed_in_page(bg, browser, width=1280, height=800, column="settings")
    expect(page.locator("#panel-settings")).to_be_visible()
    expect(page.locator("#model-facts .stage-lines li").first).to_contain_text(
        re.compile(r"Stage 0: fellow-\d · L0-14"))
    side = page.locator("#side-column").bounding_box()
    chat = page.locator("#chat-area").bounding_box()
    assert side["x"] >= chat["x"] + chat["width"] - 1  # the column is to the right of the chat
    shot(page, "settings-1280")
    page.click('[data-column="settings"]')  # pressing the open one hides the column
    expect(page.locator("#side-column")).to_be_hidden()
    assert page.evaluate("localStorage.getItem('swarm.column')") == '""'
    page.click('[data-column="chats"]')
    expect(page.locator("#panel-chats")).to_be_visible()
    page.context.close()

    page = signed_in_page(bg, browser, width=390, height=844)
    expect(page.locator(".column-buttons .label").first).to_be_hidden()  # icons only on a phone
    chat = page.locator("#chat-area").bounding_box()
    side = page.locator("#side-column").bounding_box()
    assert side["y"] >= chat["y"] + chat["height"] - 1  # the column sits below the chat
    assert page.evaluate("document.documentElement.scrollWidth") <= 390  # nothing sticks out sideways
    shot(page, "phone-390")
    page.locator("#composer-input").fill("Hi")
    page.locator("#composer-input").press("Enter")
    expect(page.locator(".msg.assistant .speed")).to_contain_text("tokens/s", timeout=60_000)
    shot(page, "phone-390-chat")
    page.click('[data-column="settings"]')
    page.wait_for_timeout(600)
    shot(page, "phone-390-settings")
    page.context.close()


def test_admin_page(bg, browser):
    page = signed_in_page(bg, browser)
    page.goto(f"{bg.swarm.url}/admin")
    expect(page.locator("#fellows-table")).to_contain_text("fellow-0")
    expect(page.locator("#fellows-table")).to_contain_text("Online")
    from swarm import __version__, wire

    expect(page.locator("#fellows-table")).to_contain_text(f"{__version__} (protocol {wire.PROTOCOL_VERSION})")
    expect(page.locator("#fellows-outdated")).to_be_hidden()
    conn = bg.sync(lambda: next(c for c in bg.swarm.leader.hub.online.values() if c.name == "fellow-1"))
    bg.sync(setattr, conn, "protocol", wire.PROTOCOL_VERSION - 1)  # as an older build of swarm would say
    try:  # the page polls the fellows every 5 s
        expect(page.locator("#fellows-outdated")).to_contain_text("fellow-1 runs another version", timeout=15_000)
        expect(page.locator("#fellows-outdated").get_by_role("button", name="Update outdated fellows")).to_be_visible()
        expect(page.locator("#fellows-table .version-outdated")).to_contain_text(
            f"needs protocol {wire.PROTOCOL_VERSION}")
    finally:
        bg.sync(setattr, conn, "protocol", wire.PROTOCOL_VERSION)
    expect(page.locator("#users-table")).to_contain_text("admin")
    expect(page.locator("#pools-table")).to_contain_text("default")
    # live moves (SWARM_SERVE_REBALANCE=propose by default): none while nothing serves
    expect(page.locator("#moves-table")).to_contain_text("No faster placement to propose now.")
    switch = page.locator("#direct-links")
    expect(switch).not_to_be_checked()
    switch.check()
    expect(page.locator("#direct-links-state")).to_have_text("Direct links are on")
    assert api(bg, "GET", "/api/v1/settings/direct-links").json() == {"enabled": True}
    page.fill("#verify-fraction", "0.05")  # spot checks: the share of passes recomputed by a standby
    page.locator("#verify-fraction").dispatch_event("change")
    expect(page.locator("#verify-state")).to_contain_text("passes checked")
    try:
        view = api(bg, "GET", "/api/v1/verification").json()
        assert view["fraction"] == 0.05
        for unchecked in view["unchecked"]:  # a model serving with no standby: the card names each stage not checked
            expect(page.locator("#verify-alerts")).to_contain_text(unchecked["message"])
    finally:
        api(bg, "PUT", "/api/v1/verification", json={"fraction": 0})
    page.click("#new-join-token")
    expect(page.locator("dialog .token-once")).to_contain_text(f"curl -fsSL \"{bg.swarm.url}/install.sh?token=swj1.")
    shot(page, "admin")
    page.locator("dialog").get_by_role("button", name="Done").click()
    page.context.close()


def test_a_user_over_a_quota_is_told_when_to_chat_again_and_the_admin_sees_usage(bg, browser):
    page = signed_in_page(bg, browser, max_tokens=8)
    box = page.locator("#composer-input")
    box.fill("Hello")
    box.press("Enter")
    expect(page.locator(".msg.assistant .speed")).to_contain_text("tokens/s", timeout=60_000)
    assert api(bg, "PUT", "/api/v1/quotas/user/admin", json={"completion_tokens_per_day": 1}).status_code == 200
    try:
        box.fill("Hello again")
        box.press("Enter")
        refused = page.locator(".msg.assistant .msg-error").last
        expect(refused).to_contain_text(
            re.compile(r"you have used \d+ of the 1 completion tokens per day .* your account allows"))
        expect(refused).to_contain_text(re.compile(r"You can send again at \d\d:\d\d:\d\d UTC \(in 2\d h"))
    finally:
        assert api(bg, "DELETE", "/api/v1/quotas/user/admin").status_code == 200

    # the admin page: usage per period as a chart and a table; quotas set and removed from the form
    bg.sync(bg.swarm.leader.store.create_user, "quota-user", "a long enough password")
    for _ in range(40):  # finished requests reach the store a few seconds after their reply
        if api(bg, "GET", "/api/v1/usage").json()["rows"]:
            break
        time.sleep(0.25)
    page.goto(f"{bg.swarm.url}/admin")
    expect(page.locator("#usage-table")).to_contain_text("admin · ")
    assert page.locator("#usage-chart svg rect.completion").count() >= 1
    assert "format=csv" in page.locator("#usage-csv").get_attribute("href")
    page.select_option("#quota-scope", "user")
    page.fill("#quota-ref", "quota-user")
    page.fill("#quota-concurrent_requests", "2")
    page.fill("#quota-completion_tokens_per_day", "50000")
    page.get_by_role("button", name="Set quota").click()
    expect(page.locator("#quotas-table")).to_contain_text("User quota-user")
    expect(page.locator("#quotas-table")).to_contain_text("50,000 completion tokens/day, 2 at once")
    shot(page, "admin-usage")
    page.get_by_role("button", name="Remove the quota of User quota-user").click()
    expect(page.locator("#quotas-table")).to_contain_text("No quotas")
    assert api(bg, "GET", "/api/v1/quotas").json()["quotas"] == []
    assert not page.errors, page.errors
    page.context.close()


def test_edit_and_regenerate(bg, browser):
    page = signed_in_page(bg, browser, max_tokens=8)
    box = page.locator("#composer-input")
    box.fill("Say hello")
    box.press("Enter")
    expect(page.locator(".msg.assistant .speed")).to_contain_text("tokens/s", timeout=60_000)
    # Regenerate replaces the latest reply.
    page.locator(".msg.assistant").get_by_role("button", name="Regenerate").click()
    expect(page.locator("#stop-button")).to_be_hidden(timeout=60_000)
    expect(page.locator(".msg")).to_have_count(2)
    # Edit, then Escape: nothing changes.
    page.locator(".msg.user").get_by_role("button", name="Edit message").click()
    expect(page.locator("#editing-note")).to_be_visible()
    assert box.input_value() == "Say hello"
    box.press("Escape")
    expect(page.locator("#editing-note")).to_be_hidden()
    assert box.input_value() == ""
    # Edit and send: the message and everything after it are replaced.
    page.locator(".msg.user").get_by_role("button", name="Edit message").click()
    box.fill("Say goodbye")
    box.press("Enter")
    expect(page.locator(".msg.assistant .speed")).to_contain_text("tokens/s", timeout=60_000)
    expect(page.locator(".msg")).to_have_count(2)
    expect(page.locator(".msg.user .bubble")).to_have_text("Say goodbye")
    expect(page.locator("#save-state")).to_have_text("Saved")
    chat_id = page.url.split("#chat=")[1]
    saved = api(bg, "GET", f"/api/v1/chats/{chat_id}").json()["messages"]
    assert [m["role"] for m in saved] == ["user", "assistant"] and saved[0]["content"] == "Say goodbye"
    assert not page.errors, page.errors
    page.context.close()


def test_dark_theme(bg, browser):
    context = browser.new_context(viewport={"width": 1280, "height": 800}, color_scheme="dark")
    link = bg.sync(bg.swarm.leader.store.create_login_link, 1)
    page = context.new_page()
    page.goto(f"{bg.swarm.url}/auth/link?token={link}")
    expect(page.locator("#status-pill")).to_have_text("Model ready")
    background = page.evaluate("getComputedStyle(document.body).backgroundColor")
    assert background == "rgb(24, 24, 27)", background
    page.locator(".chat-row .chat-open").first.click()
    expect(page.locator(".msg").first).to_be_visible()
    shot(page, "dark-1280")
    context.close()


def test_performance_column(bg, browser, model):
    """The Performance column: the speed chart, the pipeline's stages and link, the time per token, the bottleneck and
    the last 15 minutes; it asks every 2 s while open and not at all while closed; the range is remembered."""
    for prompt in ("Name three colours.", "Count from one to five."):
        reply = api(bg, "POST", "/v1/chat/completions", json={"model": model, "max_tokens": 16, "temperature": 0,
                                                                "messages": [{"role": "user", "content": prompt}]})
        assert reply.status_code == 200, reply.text
    page = signed_in_page(bg, browser, width=1280, height=1000, column="performance")
    asked: list[str] = []
    page.on("request", lambda r: asked.append(r.url) if "/performance" in r.url else None)
    expect(page.locator("#panel-performance")).to_be_visible()
    expect(page.locator(".perf-stage")).to_have_count(2)
    expect(page.locator(".perf-stage").first).to_contain_text(re.compile(r"Stage 0fellow-\d · layers 0–14"))
    expect(page.locator(".perf-stage").first).to_contain_text("CPU")  # no GPU here: cores, load and RAM
    expect(page.locator(".perf-link").first).to_contain_text(re.compile(r"^(Direct link|Tunnel|Relay)"))
    expect(page.locator(".perf-link").first).to_contain_text("per token forward")
    expect(page.locator("svg.perf-chart")).to_have_attribute(
        "aria-label", re.compile(r"over the last 15 minutes in 30-second steps: peak [\d.]+, latest [\d.]+\."))
    expect(page.locator(".perf-split > div").first).to_be_visible()
    expect(page.locator(".perf-bottleneck")).to_contain_text("takes most of each token's time")
    expect(page.locator(".perf-table")).to_contain_text("Replies")
    table = api(bg, "GET", f"/api/v1/models/{model}/performance").json()["last_15m"]
    expect(page.locator(".perf-table tbody tr").first).to_contain_text(f"{table['replies']}")
    shot(page, "performance-1280")
    # open: a request every 2 s
    before = len(asked)
    page.wait_for_timeout(4_500)
    assert 2 <= len(asked) - before <= 3, asked[before:]
    # closed: none
    page.click('[data-column="performance"]')
    expect(page.locator("#panel-performance")).to_be_hidden()
    page.wait_for_timeout(500)
    before = len(asked)
    page.wait_for_timeout(4_500)
    assert len(asked) == before, asked[before:]
    # the range switch, remembered in this browser
    page.click('[data-column="performance"]')
    page.click('#perf-range [data-range="6h"]')
    expect(page.locator('#perf-range [data-range="6h"]')).to_have_attribute("aria-checked", "true")
    expect(page.locator("svg.perf-chart")).to_have_attribute("aria-label",
                                                             re.compile(r"last 6 hours in 15-minute steps"))
    assert "range=6h" in asked[-1]
    page.reload()
    expect(page.locator('#perf-range [data-range="6h"]')).to_have_attribute("aria-checked", "true")
    expect(page.locator('#perf-range [data-range="15m"]')).to_have_attribute("aria-checked", "false")
    expect(page.locator("svg.perf-chart")).to_have_attribute("aria-label", re.compile(r"last 6 hours"))
    assert page.evaluate("localStorage.getItem('swarm.perfRange')") == '"6h"'
    # past 2 stages the time-per-token bar has a segment per hop after the stage it leaves (the API's hop_ms; a
    # made-up split of 3 stages, drawn by the column's own code)
    segments = page.evaluate("""async () => {
        const { timeBar } = await import("/static/js/performance.js");
        const part = (label, kind, ms) => ({ label, kind, ms, share: ms / 100 });
        const [bar] = timeBar({ source: "fellows", ms_per_token: 100, prompt_ms: null, bytes_per_token: {},
            hop_ms: [5, 10, 15], parts: [part("stage 0", "compute", 20), part("link", "link", 30),
                                         part("stage 1", "compute", 25), part("stage 2", "compute", 25)] }, "");
        return [...bar.children].map((d) => [d.title, d.className, d.style.flexGrow]);
    }""")
    assert segments == [["stage 0 20 ms", "compute k0", "0.2"], ["link 0→1 5 ms", "link k1", "0.05"],
                        ["stage 1 25 ms", "compute k2", "0.25"], ["link 1→2 10 ms", "link k3", "0.1"],
                        ["stage 2 25 ms", "compute k4", "0.25"], ["link 2→0 15 ms", "link k5", "0.15"]]
    assert not page.errors, page.errors
    page.context.close()

    page = signed_in_page(bg, browser, width=390, height=844, column="performance")
    expect(page.locator(".perf-stage")).to_have_count(2)
    page.locator("#panel-performance").scroll_into_view_if_needed()
    assert page.evaluate("document.documentElement.scrollWidth") <= 390  # nothing sticks out sideways
    side = page.locator("#side-column").bounding_box()
    assert side["width"] <= 390
    page.locator(".perf-stage").first.scroll_into_view_if_needed()
    shot(page, "performance-390")
    page.locator(".perf-table").scroll_into_view_if_needed()
    shot(page, "performance-390-table")
    assert not page.errors, page.errors
    page.context.close()


def test_the_quantization_choice_shows_its_longest_option_whole(bg, browser):
    """The choice beside the model picker was capped at 130 px: at 1280 px "Full precision" showed as "Full
    precisior". It is as wide as its longest option, on a wide screen and on a phone."""
    for width in (1280, 390):
        page = signed_in_page(bg, browser, width=width)
        sizes = page.locator("#quantization-picker").evaluate("""s => {
            const shown = s.offsetWidth, scroll = s.scrollWidth, client = s.clientWidth;
            s.style.maxWidth = "none"; s.style.flex = "none"; s.style.width = "auto";
            const natural = s.offsetWidth;  /* a select's own width: its longest option's */
            s.style.maxWidth = s.style.flex = s.style.width = "";
            return {shown, natural, scroll, client};
        }""")
        assert sizes["shown"] >= sizes["natural"], (width, sizes)
        assert sizes["scroll"] <= sizes["client"], (width, sizes)
        assert page.evaluate("document.documentElement.scrollWidth") <= width  # nothing pushed out sideways
        page.context.close()


def test_sending_while_not_loaded_loads_first(bg, browser, model):
    """Near the end of the module: it unloads the model the other tests share (and loads it again)."""
    page = signed_in_page(bg, browser, height=800, max_tokens=8, not_loaded=model)
    expect(page.locator("#load-button")).to_have_text("Load")
    expect(page.locator("#load-button")).to_be_enabled()
    expect(page.locator(".suggestion").first).to_be_disabled()
    expect(page.locator(".suggest-note")).to_contain_text("until the model is loaded")
    shot(page, "not-loaded")
    page.locator("#composer-input").fill("Hello")
    page.locator("#composer-input").press("Enter")
    expect(page.locator(".msg.assistant .speed")).to_contain_text("tokens/s", timeout=120_000)
    expect_ready(bg, page, model, 20_000)
    expect(page.locator("#load-button")).to_have_text("Unload")
    assert api(bg, "GET", f"/api/v1/models/{model}").json()["status"] == "ready"  # sending loaded it
    assert page.locator(".msg.assistant").count() == 1  # one reply, to the message sent while not loaded
    assert not page.errors, page.errors
    page.context.close()


def test_a_quantized_load_from_the_choice_beside_load_shows_its_compression(bg, browser, model):
    """After the not-loaded test: loads the model again, at int8, as picked beside Load; Settings shows it."""
    page = signed_in_page(bg, browser, column="settings", not_loaded=model)
    expect(page.locator("#quantization-picker")).to_have_value("")  # the model's own kind
    page.select_option("#quantization-picker", "int8")
    page.click("#load-button")
    expect_ready(bg, page, model)
    assert api(bg, "GET", f"/api/v1/models/{model}").json()["quantization"] == "int8"
    expect(page.locator("#model-compression")).to_have_text(re.compile(r"^int8 · \d\.\dx smaller$"))
    shot(page, "quantized-settings")
    page.reload()  # the choice is remembered in this browser
    expect(page.locator("#quantization-picker")).to_have_value("int8")
    assert not page.errors, page.errors
    page.context.close()


def test_settings_shows_the_planned_speed(bg, browser, model):
    """The Settings panel's model facts carry the planner's sentence (GET /api/v1/models/{id}/plan). The fellows here
    run with SWARM_CALIBRATE=0, so each is given a made-up calibration first: 1 ms + 1e-7 ms/byte a decode step, and
    a made-up probe of its links: 0.5 ms round trips, as loopback is when the machine is not busy (a probe that met a
    fellow loading a model reads far more, and with compute this cheap would leave a fellow out)."""
    from swarm.control_links import LinkFigures, LinkReport

    def calibrate():
        online = bg.swarm.leader.hub.online
        for conn in online.values():
            conn.calibration = {"prefill_tokens": 256, "points": [
                {"weight_bytes": 1_000_000, "decode_ms": 1.1, "prefill_ms": 30},
                {"weight_bytes": 10_000_000, "decode_ms": 2.0, "prefill_ms": 300}]}
            links = [LinkFigures(peer, "direct", rtt_ms=0.5, mbps=1000.0) for peer in online if peer != conn.id]
            bg.swarm.leader.serving.link_matrix.on_report(conn, LinkReport(links))

    bg.sync(calibrate)
    page = signed_in_page(bg, browser, column="settings")
    # over both fellows; or, where the serving ring's own hops measured slow links on a busy machine (they win over
    # the probe above), on one, the other left out and the sentence saying why
    expect(page.locator("#model-plan")).to_have_text(re.compile(
        r"^about [\d.]+ tokens/s, first token of a 1,000-token prompt in [\d.]+ s (over 2 stages|on fellow-\d); "
        r"the slowest part is (stage \d on fellow-\d \(compute\)|the links between stages)"
        r"(; fellow-\d left out: [\d.]+ ms to fellow-\d .*)?$"))
    plan = api(bg, "GET", f"/api/v1/models/{model}/plan").json()
    assert plan["num_stages"] == (2 if "over 2 stages" in page.locator("#model-plan").inner_text() else 1), plan
    shot(page, "settings-planned-speed")
    assert not page.errors, page.errors
    page.context.close()


def test_the_api_examples_run_as_shown_for_every_face(bg, browser, model):
    """Settings -> API: each face's Python example, copied from the page with a pasted token, runs and prints the
    model's reply through that vendor's client against this leader -- with the page's temperature 0 and max tokens
    in it, the same greedy reply through every face; the curl examples answer too."""
    token = api(bg, "POST", "/api/v1/tokens", json={"name": "examples"}).json()["token"]
    page = signed_in_page(bg, browser, column="settings")
    page.fill("input[aria-label='Paste a token']", token)
    page.get_by_role("button", name="Add", exact=True).click()
    faces = {"chat": "openai", "responses": "openai", "messages": "anthropic", "ollama": "ollama"}
    shown: dict[tuple[str, str], str] = {}
    for face in faces:
        page.select_option("#api-face-picker", face)
        for tab in ("Python", "curl"):
            page.get_by_role("tab", name=tab).click()
            shown[face, tab] = page.locator("pre.example").inner_text()
    shot(page, "settings-api-examples")
    assert not page.errors, page.errors
    page.context.close()
    assert all(token in text and model in text for text in shown.values())
    for face, package in faces.items():
        assert f"import {package}" in shown[face, "Python"] or f"from {package} import" in shown[face, "Python"]
    commands = {(face, "Python"): [sys.executable, "-c", shown[face, "Python"]] for face in faces}
    # curl (scripts/bootstrap installs it) for two faces: the four share one builder; chat streams (SSE), messages
    # sends Anthropic's headers
    commands.update({(face, "curl"): ["bash", "-c", shown[face, "curl"]] for face in ("chat", "messages")})
    runs = {key: subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for key, command in commands.items()}  # all at once: the pool batches them
    deadline = time.monotonic() + 200
    replies: dict[tuple[str, str], str] = {}
    for (face, tab), run in runs.items():
        try:
            out, err = run.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            run.kill()
            out, err = run.communicate()
        assert run.returncode == 0 and out.strip(), (face, tab, out, err[-2000:])
        replies[face, tab] = out
        if tab == "curl" and face == "chat":
            assert out.startswith("data: ") and "[DONE]" in out, out[:500]
        elif tab == "curl":
            assert "error" not in json.loads(out), out[:500]
    assert len({replies[face, "Python"].strip() for face in faces}) == 1, replies
    assert all('"max_tokens": 24, "temperature": 0' in shown[face, "curl"] for face in ("chat", "messages"))
