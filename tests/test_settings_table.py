"""The README's settings table lists every setting swarm/config.py reads, and no other SWARM_* variable; where the
table gives a number as the default, it is config.py's."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from swarm import config
from swarm.config import Settings

ROOT = Path(__file__).resolve().parent.parent


def readme_table() -> dict[str, str]:
    """SWARM_* variable -> the default its row of the README's settings table gives."""
    text = (ROOT / "README.md").read_text()
    section = text.split("\n## Settings\n", 1)[1].split("\n## ", 1)[0]
    rows: dict[str, str] = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not line.startswith("|") or len(cells) < 3:
            continue
        for name in re.findall(r"`(SWARM_[A-Z0-9_]+)`", cells[0]):
            assert name not in rows, f"{name} has two rows in the README's settings table"
            rows[name] = cells[1]
    return rows


def test_the_readme_lists_every_setting_config_reads_and_no_other():
    read = set(Settings.variables().values())
    listed = set(readme_table())
    assert read - listed == set(), f"config.py reads these, the README's settings table lacks them: {read - listed}"
    assert listed - read == set(), f"the README's settings table lists these, config.py reads none: {listed - read}"
    # and every SWARM_* variable config.py's text names (comments, messages) is one it reads
    named = set(re.findall(r"\bSWARM_[A-Z0-9_]+\b", Path(config.__file__).read_text()))
    assert named - read == set(), named - read


def test_the_readmes_numeric_defaults_are_configs():
    rows = readme_table()
    names = Settings.variables()
    checked = 0
    for field in dataclasses.fields(Settings):
        given = rows[names[field.name]]
        if not re.fullmatch(r"-?\d+(\.\d+)?", given):
            continue  # words ("auto", "the leader's port", "—") are the table's to explain
        default = field.default
        want = int(default) if isinstance(default, bool) else default
        assert float(given) == float(want), f"{names[field.name]}: the README says {given}, config.py {default}"
        checked += 1
    assert checked >= 20


def test_no_module_names_a_setting_config_does_not_read():
    """Settings are read in config.py and nowhere else: a SWARM_* name anywhere in the package's code is one config.py
    reads, so the README's table (checked above) lists it too. (The installers' own variables -- SWARM_HOME,
    SWARM_PYTHON, ... -- live in their shell scripts, not in Python.)"""
    package = Path(config.__file__).parent
    named = {name for path in package.rglob("*.py")
             for name in re.findall(r"\bSWARM_[A-Z0-9_]+\b", path.read_text(encoding="utf-8"))}
    read = set(Settings.variables().values())
    assert named - read == set(), f"named in swarm/ but not read by config.py: {named - read}"
