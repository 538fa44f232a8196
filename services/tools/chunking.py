"""Cut a document's text into chunks by its structure: sections, paragraphs, sentences.

A heading (Markdown `#` to `######`, never a line inside a ``` or ~~~ fenced code block)
starts a new section; its path keeps the headings above its level ("Billing > Reservations")
and each chunk of the section begins with it so that both keyword and semantic search see
what the passage is about. A fenced block is kept whole, blank lines included. Paragraphs
are packed into a chunk up to CHUNK_CHARS characters (about 200 of the embedding model's
tokens, under its 256-token window); a paragraph longer than that is cut between
sentences, then at whitespace. When a section spans several chunks, each one after the
first starts with the last OVERLAP_CHARS or so of the one before (whole sentences or
words), so an answer cut at a boundary is whole in one.

Linear in the length of the text: long paragraphs are walked with offsets, never re-sliced.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

CHUNK_CHARS = 900
OVERLAP_CHARS = 150
MIN_SECTION_CHARS = 200  # a section shorter than this shares its chunk with the next one
_HEADING = re.compile(r"^(#{1,6})[ \t]+(.+?)[ \t#]*$")
_FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")
_SPACE = re.compile(r"\s")


@dataclass
class _Section:
    """A heading path and the paragraphs under it."""

    path: str
    paragraphs: list[str] = field(default_factory=list)


def _fence(line: str) -> str | None:
    """The fence marker (a run of 3+ backticks or tildes) a line opens or closes a fenced code
    block with, or None."""
    match = _FENCE.match(line)
    return match.group(1) if match else None


def _heading(line: str, stack: list[tuple[int, str]]) -> str | None:
    """The heading path a heading line opens (the levels above it kept, any at its level or
    deeper closed), `stack` updated; None when the line is not a heading."""
    match = _HEADING.match(line.strip())
    if match is None:
        return None
    level = len(match.group(1))
    while stack and stack[-1][0] >= level:
        stack.pop()
    stack.append((level, match.group(2).strip()))
    return " > ".join(title for _, title in stack)


def _sections(content: str) -> list[_Section]:
    """The text's sections in order: a heading line opens one; text before any heading is a
    section with an empty path. A blank line ends a paragraph; lines inside a fenced code
    block are never headings and its blank lines do not end a paragraph, so it stays whole."""
    stack: list[tuple[int, str]] = []
    sections = [_Section("")]
    lines: list[str] = []
    fence = ""  # the marker of the open fenced block, "" outside one

    def end_paragraph() -> None:
        text = "\n".join(lines).strip()
        if text:
            sections[-1].paragraphs.append(text)
        lines.clear()

    for line in content.splitlines():
        marker = _fence(line)
        if fence:
            lines.append(line)
            if marker and marker[0] == fence[0] and len(marker) >= len(fence):
                if not line.strip().removeprefix(marker).strip():
                    fence = ""
            continue
        if marker:
            fence = marker
            lines.append(line)
        elif not line.strip():
            end_paragraph()
        elif (path := _heading(line, stack)) is not None:
            end_paragraph()
            sections.append(_Section(path))
        else:
            lines.append(line)
    end_paragraph()
    return [s for s in sections if s.paragraphs or s.path]


def _pieces(paragraph: str, size: int) -> list[str]:
    """`paragraph` cut into pieces of at most `size` characters: between sentences where it
    can, between words where a sentence is too long, anywhere for a word longer than `size`."""
    if len(paragraph) <= size:
        return [paragraph]
    pieces: list[str] = []
    start, end = 0, len(paragraph)
    while end - start > size:
        window_end = start + size
        cut = -1
        for match in _SENTENCE_END.finditer(paragraph, start + size // 2, window_end):
            cut = match.start()
        if cut < 0:
            for match in _SPACE.finditer(paragraph, start + size // 2, window_end):
                cut = match.start()
            cut = cut if cut > start else window_end
        pieces.append(paragraph[start:cut].strip())
        while cut < end and paragraph[cut].isspace():
            cut += 1
        start = cut
    if start < end:
        pieces.append(paragraph[start:])
    return pieces


def _tail(text: str, size: int) -> str:
    """The last `size` or so characters of `text`, starting at a sentence or word boundary."""
    if len(text) <= size:
        return text
    start = len(text) - size
    sentence = _SENTENCE_END.search(text, start)
    if sentence is not None and sentence.end() < len(text):
        return text[sentence.end() :]
    space = text.find(" ", start)
    return text[space + 1 :] if 0 <= space < len(text) - 1 else text[start:]


def _section_chunks(section: _Section, size: int, overlap: int) -> list[str]:
    """The chunks of one section: its paragraphs packed, each chunk after the first starting
    with the tail of the one before."""
    prefix = f"{section.path}\n\n" if section.path else ""
    room = max(size - len(prefix), size // 2)
    bodies: list[str] = []
    current = ""
    for paragraph in section.paragraphs:
        for piece in _pieces(paragraph, room - overlap):
            if current and len(current) + 2 + len(piece) > room:
                bodies.append(current)
                carried = _tail(current, overlap)
                current = f"{carried}\n\n{piece}" if carried != current else piece
            else:
                current = f"{current}\n\n{piece}" if current else piece
    if current or not bodies:
        bodies.append(current)
    return [(prefix + body).strip() for body in bodies if (prefix + body).strip()]


def chunk_text(content: str, size: int = CHUNK_CHARS, overlap: int = OVERLAP_CHARS) -> list[str]:
    """Cut `content` into chunks of about `size` characters (heading path included) by its
    structure, consecutive chunks of a section overlapping by about `overlap` characters.

    A section shorter than MIN_SECTION_CHARS (a title with one line under it) is joined to the
    next section's first chunk when both fit, so a document does not become a row of scraps.
    """
    chunks: list[str] = []
    pending = ""
    for section in _sections(content):
        pieces = _section_chunks(section, size, overlap)
        if not pieces:
            continue
        if pending and len(pending) + 2 + len(pieces[0]) <= size:
            pieces[0] = f"{pending}\n\n{pieces[0]}"
        elif pending:
            chunks.append(pending)
        pending = ""
        if len(pieces) == 1 and len(pieces[0]) < MIN_SECTION_CHARS:
            pending = pieces[0]
            continue
        chunks.extend(pieces)
    if pending:
        chunks.append(pending)
    return chunks
