"""The README is a front door: short, with the test command; docs/settings.md lists every
LOOPLINE_* setting of every service; every relative link of the README and docs/ resolves."""

from __future__ import annotations

import pathlib
import re

import pytest

from scripts.settings_table import rows, table

ROOT = pathlib.Path(__file__).resolve().parents[1]
SETTINGS = ROOT / "docs" / "settings.md"
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# [text](target) outside code spans; the target up to a space, `#` or `)`
LINK = re.compile(r"\[[^\]]*\]\(([^)\s#]*)(#[^)\s]*)?\)")


def test_settings_page_lists_every_setting():
    page = SETTINGS.read_text()
    missing = [variable for variable, *_ in rows() if f"`{variable}`" not in page]
    assert missing == [], (
        f"run `python scripts/settings_table.py` and update docs/settings.md: {missing}"
    )


def test_settings_page_gives_every_setting_its_default_and_range():
    """The page's table is the generated one, so each range shown is the one enforced at start."""
    lines = SETTINGS.read_text().splitlines()
    stale = [line for line in table() if line not in lines]
    assert stale == [], (
        f"run `python scripts/settings_table.py` and update docs/settings.md: {stale}"
    )


def test_readme_gives_the_test_command():
    assert "make test" in (ROOT / "README.md").read_text()


def test_readme_is_at_most_250_lines():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 250


def _headings(page: pathlib.Path) -> set[str]:
    """The GitHub anchors of a page's headings: lower case, punctuation dropped, spaces to `-`."""
    anchors = set()
    for line in page.read_text().splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            anchors.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return anchors


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_points_at_a_file_that_exists(page):
    broken = []
    for target, anchor in LINK.findall(page.read_text()):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        path = (page.parent / target).resolve() if target else page
        if not path.exists():
            broken.append(target)
        elif anchor and path.suffix == ".md" and anchor[1:] not in _headings(path):
            broken.append(target + anchor)
    assert broken == []
