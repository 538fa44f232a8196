"""README.md lists every LOOPLINE_* setting of every service (issue 2)."""

from __future__ import annotations

import pathlib

from scripts.settings_table import rows, table

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_readme_lists_every_setting():
    readme = (ROOT / "README.md").read_text()
    missing = [variable for variable, *_ in rows() if f"`{variable}`" not in readme]
    assert missing == [], f"run `python scripts/settings_table.py` and update README.md: {missing}"


def test_readme_gives_every_setting_its_default_and_range():
    """The README's table is the generated one, so each range shown is the one enforced at start."""
    lines = (ROOT / "README.md").read_text().splitlines()
    stale = [line for line in table() if line not in lines]
    assert stale == [], f"run `python scripts/settings_table.py` and update README.md: {stale}"


def test_readme_gives_the_test_command():
    assert "make test" in (ROOT / "README.md").read_text()
