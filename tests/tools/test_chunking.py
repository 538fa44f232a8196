"""Chunking by structure: sections carry their heading path, long sections overlap, no text
is lost, and any input (whitespace of every kind, huge words) is cut within the size."""

from __future__ import annotations

import random
import re

from services.tools.chunking import CHUNK_CHARS, OVERLAP_CHARS, chunk_text
from tests.tools.test_knowledge import _messy_text

GUIDE = """# Guide

Welcome to the guide.

## Refunds

Customers can ask for a refund within 30 days of purchase.

## Shipping

""" + "\n\n".join(
    f"Parcel rule {i}: orders ship from the Lyon warehouse in two days." for i in range(40)
)


def test_each_chunk_starts_with_its_heading_path():
    chunks = chunk_text(GUIDE)
    refunds = next(c for c in chunks if "refund within 30 days" in c)
    assert refunds.startswith("Guide > Refunds\n\n") or "Guide > Refunds\n\n" in refunds
    shipping = [c for c in chunks if "Parcel rule" in c]
    assert len(shipping) > 2
    assert all(c.startswith("Guide > Shipping\n\n") for c in shipping)


def test_consecutive_chunks_of_a_section_overlap():
    shipping = [c for c in chunk_text(GUIDE) if c.startswith("Guide > Shipping")]
    for before, after in zip(shipping, shipping[1:], strict=False):
        body = after.removeprefix("Guide > Shipping\n\n")
        first_rule = re.match(r"Parcel rule (\d+)", body)
        assert first_rule is not None
        # the chunk begins with a rule the one before already held (the overlap)
        assert f"Parcel rule {first_rule.group(1)}:" in before


def test_a_short_title_section_shares_the_next_chunk():
    chunks = chunk_text("# Title\n\nOne line.\n\n## Part\n\nA paragraph of the part.")
    assert chunks == ["Title\n\nOne line.\n\nTitle > Part\n\nA paragraph of the part."]


def test_plain_text_without_headings_is_packed_by_paragraphs():
    text = "\n\n".join(["short paragraph"] * 3 + ["word " * 500])
    chunks = chunk_text(text, size=200, overlap=40)
    assert chunks[0].startswith("short paragraph\n\nshort paragraph\n\nshort paragraph")
    assert all(len(c) <= 200 + 40 for c in chunks)
    assert sum(c.count("word") for c in chunks) >= 500  # overlap repeats some, loses none


def test_any_text_is_cut_within_the_size_and_loses_no_word():
    rnd = random.Random(6)
    for _ in range(200):
        content = _messy_text(rnd, rnd.randint(0, 6000))
        for size, overlap in ((CHUNK_CHARS, OVERLAP_CHARS), (200, 40), (80, 10)):
            chunks = chunk_text(content, size, overlap)
            assert all(c and c == c.strip() for c in chunks)
            assert all(len(c) <= size + overlap + 2 for c in chunks)
            # a run without whitespace is cut only when longer than half a piece
            kept = set(" ".join(chunks).split())
            short = {w for w in content.split() if len(w) <= (size - overlap) // 2}
            assert short <= kept


def test_a_heading_of_the_same_level_replaces_the_one_before():
    refunds = "Customers get money back within 30 days of purchase, to the card they paid with."
    chunks = chunk_text(f"## Refunds\n\n{refunds}\n\n## Shipping\n\nOrders ship in two days.")
    # the short Refunds section shares its chunk with the next one
    assert chunks == [f"Refunds\n\n{refunds}\n\nShipping\n\nOrders ship in two days."]


def test_the_heading_path_follows_the_heading_levels():
    body = "A paragraph long enough to stand as a chunk of its own. " * 5
    headings = ("# A", "## B", "## C", "# D", "### E", "### F", "## G")
    text = "\n\n".join(f"{h}\n\n{body}" for h in headings)
    paths = [c.split("\n\n")[0] for c in chunk_text(text)]
    # a heading closes those of its level or deeper, even when a level was skipped (E, F)
    assert paths == ["A", "A > B", "A > C", "D", "D > E", "D > F", "D > G"]


def test_a_fenced_code_block_is_kept_whole_and_holds_no_heading():
    fence = "```bash\n# install the package\npip install x\n\n# then run it\n\nx --help\n```"
    tilde = "~~~\n## not a heading\n\n~~~"
    text = f"# Setup\n\nInstall it:\n\n{fence}\n\nThen:\n\n{tilde}\n\nDone."
    chunks = chunk_text(text)
    assert chunks == [f"Setup\n\nInstall it:\n\n{fence}\n\nThen:\n\n{tilde}\n\nDone."]


def test_a_heading_after_a_closed_fence_opens_a_section():
    body = "Body of two. " * 20
    text = f"# One\n\n````\n```\n# inside\n````\n\n## Two\n\n{body}"
    # the shorter ``` line does not close the ```` fence; the ```` line does
    assert chunk_text(text) == [f"One\n\n````\n```\n# inside\n````\n\nOne > Two\n\n{body.strip()}"]
