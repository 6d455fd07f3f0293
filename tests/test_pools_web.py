"""The chat page in headless Chromium names its pool: /pools/{owner}/{pool}/inference shows that pool and its models
only, /inference shows "All your pools" and every model of the user's pools, and the pool picker opens another pool's
page; Admin > Pools creates a pool, adds a member and mints a join token for it. No fellow is needed: nothing is
loaded."""

from __future__ import annotations

import pytest

from web_helpers import CHROMIUM_ARGS, BackgroundSwarm, chromium_path

pytestmark = [pytest.mark.browser, pytest.mark.e2e]

playwright_sync = pytest.importorskip("playwright.sync_api")
if chromium_path() is None:
    pytest.skip("Chromium is not installed (apt-get install chromium)", allow_module_level=True)

expect = playwright_sync.expect


def test_the_page_names_its_pool_and_lists_its_models_only(tmp_path, smollm_model_dir):
    from swarm.store.fleet import model_id

    bg = BackgroundSwarm(tmp_path, [smollm_model_dir], fellows=0).start()
    try:
        store = bg.swarm.leader.store
        builtin = smollm_model_dir.name  # in the default pool

        def add_lab():
            lab = store.create_pool("lab", 1)
            (tmp_path / "leader" / "models" / model_id("smol", "lab")).symlink_to(smollm_model_dir)
            store.upsert_model(model_id("smol", "lab"), lab.id, store.get_model(builtin).manifest_json)

        bg.sync(add_lab)
        with playwright_sync.sync_playwright() as p:
            browser = p.chromium.launch(executable_path=chromium_path(), args=CHROMIUM_ARGS, headless=True)
            page = browser.new_page()
            page.set_default_timeout(20_000)
            page.goto(f"{bg.swarm.url}/auth/link?token={bg.sync(store.create_login_link, 1)}")
            expect(page.locator("#pool-context")).to_have_text("All your pools")  # admin, two pools: /inference
            picker = page.locator("#model-picker option")
            expect(picker).to_have_text(["smol@lab", builtin])  # by id

            page.goto(f"{bg.swarm.url}/pools/admin/lab/inference")
            expect(page.locator("#pool-context")).to_have_text("admin / lab")
            expect(picker).to_have_text(["smol@lab"])
            page.locator("#pool-picker").select_option(label="default")
            page.wait_for_url("**/pools/admin/default/inference")
            expect(page.locator("#pool-context")).to_have_text("admin / default")
            expect(picker).to_have_text([builtin])

            # Admin > Pools: a new pool, a member for it, and a join token that names it
            page.goto(f"{bg.swarm.url}/admin")
            page.fill("#new-pool-name", "kids")
            page.get_by_role("button", name="Create pool").click()
            row = page.locator("#pools-table tr", has_text="kids")
            expect(row).to_have_count(1)
            row.get_by_label("Add a member to pool kids").select_option("admin")
            expect(row.get_by_role("button", name="Remove admin from pool kids")).to_be_visible()
            page.select_option("#join-pool", "kids")
            page.click("#new-join-token")
            expect(page.locator("dialog")).to_contain_text("that should join pool kids")
            page.locator("dialog").get_by_role("button", name="Done").click()
            expect(page.locator("#join-table")).to_contain_text("kids")
            kids = bg.sync(store.pool_by_name, "kids")
            assert [u.name for u in bg.sync(store.pool_members, kids.id)] == ["admin"]
            assert [t.pool_id for t in bg.sync(store.list_join_tokens)][-1] == kids.id
            browser.close()
    finally:
        bg.stop()
