"""The chat page in headless Chromium names its pool: /pools/{owner}/{pool}/inference shows that pool and its models
only, /inference shows "All your pools" and every model of the user's pools, and the pool picker opens another pool's
page. No fellow is needed: nothing is loaded."""

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
            browser.close()
    finally:
        bg.stop()
