"""Every Python module of the package stays under MAX_LINES (STYLE.md: split a module by responsibility before it
crosses it). The vendored static files under swarm/web/static are not ours and not counted."""

from __future__ import annotations

from pathlib import Path

import swarm

MAX_LINES = 400
PACKAGE = Path(swarm.__file__).parent
VENDORED = PACKAGE / "web" / "static"


def test_no_module_of_the_package_passes_400_lines():
    modules = [p for p in PACKAGE.rglob("*.py") if VENDORED not in p.parents]
    assert len(modules) > 100  # the package itself was found, not an empty folder
    too_long = {str(p.relative_to(PACKAGE.parent)): n for p in modules
                if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_LINES}
    assert not too_long, f"split these modules by responsibility (at most {MAX_LINES} lines each): {too_long}"
