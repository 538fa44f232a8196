"""Text extraction for uploaded knowledge documents: txt, md, html, csv, json, pdf.

The file type comes from the file name's extension, else from the media type. Text
types are decoded as UTF-8 (a byte-order mark is dropped; invalid bytes are replaced);
HTML keeps only the visible text (no script, style or tags); JSON must parse and is
re-indented so that keys and values are separate words; PDF text is extracted page by
page with `pypdf`. Anything else raises `UnsupportedFileType`; a file that yields no
text raises `ExtractionError`.
"""

from __future__ import annotations

import codecs
import html.parser
import io
import json
import logging
import pathlib
from typing import Any

from services.common import pb

log = logging.getLogger(__name__)

SUPPORTED_TYPES = ("txt", "md", "html", "csv", "json", "pdf")

# Media type of each supported file type (what a document's content_type records).
MEDIA_TYPES = {
    "txt": "text/plain",
    "md": "text/markdown",
    "html": "text/html",
    "csv": "text/csv",
    "json": "application/json",
    "pdf": "application/pdf",
}

_EXTENSIONS = {
    "txt": "txt",
    "text": "txt",
    "md": "md",
    "markdown": "md",
    "html": "html",
    "htm": "html",
    "csv": "csv",
    "json": "json",
    "pdf": "pdf",
}
_BY_MEDIA_TYPE = {media: kind for kind, media in MEDIA_TYPES.items()} | {
    "application/xhtml+xml": "html",
    "text/x-markdown": "md",
}


class UnsupportedFileType(ValueError):
    """The file is none of SUPPORTED_TYPES."""


class ExtractionError(ValueError):
    """The file has a supported type but no usable text (empty, malformed JSON, unreadable PDF)."""


def file_type(name: str, content_type: str = "") -> str:
    """The file type ("txt", ..., "pdf") of a file called `name` with media type `content_type`.

    The extension wins; the media type is used when the name has no known extension. A name
    without an extension whose media type names nothing (absent, application/octet-stream:
    what curl and the SDK send for a file part) or another text/* type is read as txt (README).
    Raises UnsupportedFileType when neither names a supported type.
    """
    extension = pathlib.PurePosixPath(name or "").suffix.lower().lstrip(".")
    if extension in _EXTENSIONS:
        return _EXTENSIONS[extension]
    media = (content_type or "").split(";", 1)[0].strip().lower()
    if media in _BY_MEDIA_TYPE:
        return _BY_MEDIA_TYPE[media]
    if not extension and (media in ("", "application/octet-stream") or media.startswith("text/")):
        return "txt"
    shown = f".{extension}" if extension else (media or "unknown")
    raise UnsupportedFileType(
        f"Unsupported file type {shown!r}; supported: {', '.join(SUPPORTED_TYPES)}"
    )


class _VisibleText(html.parser.HTMLParser):
    _SKIP = {"script", "style", "noscript", "template", "head"}
    _BLOCK = {
        "p",
        "div",
        "br",
        "li",
        "tr",
        "h1",
        "h2",
        "h3",
        "h4",
        "h5",
        "h6",
        "section",
        "article",
        "pre",
        "table",
    }

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.parts: list[str] = []
        self._skipping = 0

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag in self._SKIP:
            self._skipping += 1
        elif tag in self._BLOCK:
            self.parts.append("\n\n")

    def handle_endtag(self, tag: str) -> None:
        if tag in self._SKIP and self._skipping:
            self._skipping -= 1
        elif tag in self._BLOCK:
            self.parts.append("\n\n")

    def handle_data(self, data: str) -> None:
        if not self._skipping:
            self.parts.append(data)


_BOMS = (
    (codecs.BOM_UTF32_LE, "utf-32"),
    (codecs.BOM_UTF32_BE, "utf-32"),
    (codecs.BOM_UTF8, "utf-8-sig"),
    (codecs.BOM_UTF16_LE, "utf-16"),
    (codecs.BOM_UTF16_BE, "utf-16"),
)  # UTF-32 LE first: it begins as UTF-16 LE's


def _decode(data: bytes) -> str:
    """The text of an uploaded text file: by its byte order mark when it has one (UTF-8, UTF-16,
    UTF-32), else UTF-8 when it is valid UTF-8, else Windows-1252 (the usual encoding of a
    text or CSV file that is not UTF-8: Latin-1's letters and more), as the WHATWG Encoding
    standard reads a legacy document: a UTF-16 file is not indexed as mojibake with its BOM,
    and a Latin-1 CSV keeps its accented letters ("café" is found)."""
    for bom, encoding in _BOMS:
        if data.startswith(bom):
            return data.decode(encoding, errors="replace")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return data.decode("cp1252", errors="replace")


def _no_constant(name: str) -> Any:
    raise ExtractionError(f"The JSON file does not parse ({name} is not JSON, RFC 8259)")


def _json_text(raw: str) -> str:
    """A JSON document's text, re-indented; as uploaded when it is nested deeper than json.loads
    or json.dumps go (about 1,000 levels: RecursionError), since a JSON document is still text,
    as the http integration returns such a body as text. ExtractionError when it is not JSON."""
    try:
        return json.dumps(
            json.loads(raw, parse_constant=_no_constant), ensure_ascii=False, indent=1
        )
    except json.JSONDecodeError as exc:
        raise ExtractionError(
            f"The JSON file does not parse (line {exc.lineno}, column {exc.colno})"
        ) from None
    except RecursionError:
        return raw


def extract_text(data: bytes, kind: str) -> str:
    """The text of a file of type `kind` (one of SUPPORTED_TYPES).

    Raises UnsupportedFileType for another kind, ExtractionError when no text comes out.
    """
    if kind in ("txt", "md", "csv"):
        text = _decode(data)
    elif kind == "html":
        parser = _VisibleText()
        parser.feed(_decode(data))
        parser.close()
        text = "".join(parser.parts)
    elif kind == "json":
        text = _json_text(_decode(data))
    elif kind == "pdf":
        text = _pdf_text(data)
    else:
        raise UnsupportedFileType(
            f"Unsupported file type {kind!r}; supported: {', '.join(SUPPORTED_TYPES)}"
        )
    text = pb.scrub(
        text.replace("\x00", "")
    )  # a JSON file's "\ud800" escape: U+FFFD, not a str no database stores
    if not text.strip():
        raise ExtractionError("The file contains no text")
    return text


def _pdf_text(data: bytes) -> str:
    from pypdf import PdfReader
    from pypdf.errors import PyPdfError

    try:
        reader = PdfReader(io.BytesIO(data))
        pages = [page.extract_text() or "" for page in reader.pages]
    except (PyPdfError, ValueError, KeyError, TypeError) as exc:
        raise ExtractionError(f"The PDF cannot be read ({type(exc).__name__})") from None
    return "\n\n".join(p.strip() for p in pages if p.strip())
