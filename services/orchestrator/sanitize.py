"""Error messages safe to show a client: no traceback, secret, host name, path or SQL.

The rule (docs/security.md "Client-visible text"): a message that reaches a client,
a stream frame, a stored message or a model call is built from a closed set of kinds and safe
fields (the provider's name, an HTTP status, a tool's name, a count), never passed through from
an exception. `model_failure` builds a failed model call's message that way; `sanitize` stays
as the defence in depth every such message still goes through (a pattern-based scrub alone let
`db-internal-7`, a host name without a dotted suffix, through); `for_log` redacts what goes to
the log only.
"""

from __future__ import annotations

import logging
import re
from typing import Any

from services.common import pb

log = logging.getLogger(__name__)

_PATTERNS = [
    (re.compile(r"(?i)\b(bearer|basic)\s+[A-Za-z0-9._~+/=-]+"), r"\1 [redacted]"),
    (re.compile(r"\b(sk|mx_live|mx_test|pk|rk|xox[abp])[-_][A-Za-z0-9_-]{6,}"), "[redacted]"),
    (
        re.compile(r"(?i)(api[_-]?key|token|secret|password|passwd|pwd)(\s*[=:]\s*)\S+"),
        r"\1\2[redacted]",
    ),
    (re.compile(r"[a-z][a-z0-9+.-]*://[^\s'\"]+"), "[url]"),
    (re.compile(r"\b(?:\d{1,3}\.){3}\d{1,3}(?::\d+)?\b"), "[address]"),
    (
        re.compile(r"\b[\w-]+(?:\.[\w-]+)*\.(?:internal|local|lan|svc|cluster\.local|corp)\b"),
        "[host]",
    ),
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
    either backend, so it must be text every database holds (PostgreSQL refuses a NUL)."""
    text = " ".join(str(message).split())
    # lone surrogates (no UTF-8 encoding: no database takes them) as U+FFFD
    text = pb.scrub(UNPRINTABLE.sub("", text))
    for pattern, replacement in _PATTERNS:
        text = pattern.sub(replacement, text)
    if "Traceback" in text:
        text = text.split("Traceback", 1)[0].strip() or "internal error"
    return text[:MAX_LENGTH]


#: The patterns of `_PATTERNS` that match secrets (auth schemes, known key prefixes, key=value).
_SECRET_PATTERNS = _PATTERNS[:3]
LOG_LENGTH = 500


def for_log(text: str) -> str:
    """`text` for a log record: secrets (auth-scheme tokens, known key prefixes, `key=value`
    secrets) replaced, one line without control characters, at most LOG_LENGTH characters.
    Host names, addresses and paths stay: the operator needs them."""
    text = pb.scrub(UNPRINTABLE.sub("", " ".join(str(text).split())))
    for pattern, replacement in _SECRET_PATTERNS:
        text = pattern.sub(replacement, text)
    return text[:LOG_LENGTH]


def model_failure(provider: str, failure: Any) -> str:
    """What a client is told about a failed model call (a `ModelError`): its `public` text,
    built by the raiser from known fields (e.g. "openai: rate limited (429) after 3
    attempts"), or "<provider>: the model call failed" when it has none; through `sanitize`
    all the same. The failure's own text is logged (`for_log`), never returned."""
    log.warning(
        "the model call failed; the run fails",
        extra={
            "fields": {
                "provider": provider,
                "error_class": type(failure).__name__,
                "error": for_log(str(failure)),
            }
        },
    )
    public = getattr(failure, "public", None)
    return sanitize(
        public if isinstance(public, str) and public else f"{provider}: the model call failed"
    )
