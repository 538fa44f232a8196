"""Error messages safe to show a client: no traceback, secret, host name, path or SQL."""

from __future__ import annotations

import re

from services.common import pb

_PATTERNS = [
    (re.compile(r"(?i)\b(bearer|basic)\s+[A-Za-z0-9._~+/=-]+"), r"\1 [redacted]"),
    (re.compile(r"\b(sk|mx_live|mx_test|pk|rk|xox[abp])[-_][A-Za-z0-9_-]{6,}"), "[redacted]"),
    (re.compile(r"(?i)(api[_-]?key|token|secret|password|passwd|pwd)(\s*[=:]\s*)\S+"), r"\1\2[redacted]"),
    (re.compile(r"[a-z][a-z0-9+.-]*://[^\s'\"]+"), "[url]"),
    (re.compile(r"\b(?:\d{1,3}\.){3}\d{1,3}(?::\d+)?\b"), "[address]"),
    (re.compile(r"\b[\w-]+(?:\.[\w-]+)*\.(?:internal|local|lan|svc|cluster\.local|corp)\b"), "[host]"),
    (re.compile(r"(?:/[\w.-]+){2,}"), "[path]"),
    (re.compile(r"(?is)\b(select|insert|update|delete)\b.+\b(from|into|set|where)\b.*"), "[query]"),
]

MAX_LENGTH = 300
# What is left of the C0 and C1 control characters once whitespace is folded (NUL among them:
# PostgreSQL's text cannot hold it)
UNPRINTABLE = re.compile("[\x00-\x1f\x7f-\x9f]")


def sanitize(message: str) -> str:
    """`message` with secrets, URLs, addresses, host names, paths and SQL replaced; one line of
    printable text (control characters dropped, lone surrogates as U+FFFD), ≤ 300 chars.

    The result is stored with the run (`runs.error`) and streamed in its `error` event, on
    either backend: a model's failure text with a NUL failed the run's end on PostgreSQL
    (fresh-eyes test)."""
    text = " ".join(str(message).split())
    text = pb.scrub(UNPRINTABLE.sub("", text))  # lone surrogates (no UTF-8 encoding: no database takes them) as U+FFFD
    for pattern, replacement in _PATTERNS:
        text = pattern.sub(replacement, text)
    if "Traceback" in text:
        text = text.split("Traceback", 1)[0].strip() or "internal error"
    return text[:MAX_LENGTH]
