"""Secret redaction that knows the encodings a secret takes in an error or an echo.

The defence in depth behind the rule "client-visible text is built, never passed through"
(docs/security.md, "Client-visible text"): whatever text or JSON value may still carry a
stored secret (an error an integration built, a response body a server echoed, a log record)
is passed through `Redactor` with the secret it could hold. A secret shows in such text:

- raw, or with its surrounding whitespace stripped (a pasted token ending with a newline is
  sent stripped, and a server echoes it so);
- backslash-escaped: Python's `repr` of the text or of its bytes (`b'Bearer tok\\n'`, as
  h11 quotes an illegal header value), JSON string escapes (`\\n`, `\\u00e9`, `\\/`);
- URL-encoded (`%2B`, `+` for spaces, upper- or lower-case hex);
- base64, as inside `Authorization: Basic` (`user:password`), and, the other way round,
  the `user:password` (and the password) a `Basic <base64>` value holds;
- the token after `Bearer ` or `Basic `, and the password of a URL's user info
  (`postgresql://user:password@host`, also percent-decoded).

Every form of 4 characters or more is replaced by "***", longest first, in one regular
expression pass. Field names that hold no secret (`header_name`, `token_type`, `scope`) are
left out.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
import urllib.parse
from collections.abc import Iterable, Iterator
from typing import Any

MASK = "***"
MIN_LENGTH = 4
#: Fields of a credential's secret that hold no secret (a header's name, a token's type).
NOT_SECRET_FIELDS = frozenset({"header_name", "token_type", "scope"})
_AUTH_SCHEME = re.compile(r"(?i)^\s*(bearer|basic|token)\s+(\S+)\s*$")
_MAX_DEPTH = 32
_URL_PASSWORD_MIN = 3  # a URL's password is redacted from 3 characters (it is known to be one)


class _Short(str):
    """A part shorter than MIN_LENGTH that is still redacted (a URL's password)."""


def secret_strings(secret: Any, _depth: int = 0) -> Iterator[str]:
    """Every string leaf of a secret (a JSON value: nested objects such as an MCP server's
    `headers` included), fields in NOT_SECRET_FIELDS left out."""
    if _depth > _MAX_DEPTH:
        return
    if isinstance(secret, str):
        yield secret
    elif isinstance(secret, dict):
        for key, value in secret.items():
            if key not in NOT_SECRET_FIELDS:
                yield from secret_strings(value, _depth + 1)
    elif isinstance(secret, (list, tuple)):
        for value in secret:
            yield from secret_strings(value, _depth + 1)


def _parts(value: str) -> set[str]:
    """`value`, stripped, and the secrets inside it: an auth scheme's token (and what a Basic
    token decodes to), a URL's password (as written and percent-decoded; 3 characters are
    enough for it: `_URL_PASSWORD_MIN`)."""
    found = {value, value.strip()}
    scheme = _AUTH_SCHEME.match(value)
    if scheme:
        token = scheme.group(2)
        found.add(token)
        if scheme.group(1).lower() == "basic":
            try:
                decoded = base64.b64decode(token + "=" * (-len(token) % 4), validate=True).decode(
                    "utf-8"
                )
            except (binascii.Error, ValueError):
                decoded = ""
            if decoded:
                found.add(decoded)
                found.add(decoded.partition(":")[2])
    if "://" in value and "@" in value:
        userinfo = value.split("://", 1)[1].split("@", 1)[0]
        if ":" in userinfo:
            password = userinfo.split(":", 1)[1]
            for form in (password, urllib.parse.unquote(password)):
                found.add(
                    form
                    if len(form) >= MIN_LENGTH
                    else _Short(form)
                    if len(form) >= _URL_PASSWORD_MIN
                    else ""
                )
    found.discard("")
    return found


def _encodings(value: str) -> set[str]:
    """The forms `value` takes when an error quotes it, escapes it, URL-encodes it or base64-encodes
    it."""
    forms = {value}
    forms.add(
        repr(value)[1:-1]
    )  # Python's escapes (\n, \t, \x00, \\), as str() of a tuple or repr shows it
    try:
        forms.add(
            repr(value.encode("utf-8"))[2:-1]
        )  # the bytes' repr (h11: "Illegal header value b'…\\n'")
    except UnicodeEncodeError:  # a lone surrogate
        pass
    forms.add(json.dumps(value)[1:-1])  # JSON escapes, non-ASCII as \uXXXX
    forms.add(json.dumps(value, ensure_ascii=False)[1:-1])
    forms.add(json.dumps(value)[1:-1].replace("/", "\\/"))  # JSON writers that escape '/'
    for safe in ("", "/", ":@"):
        quoted = urllib.parse.quote(value, safe=safe)
        forms.update({quoted, re.sub(r"%[0-9A-F]{2}", lambda m: m.group().lower(), quoted)})
    forms.add(urllib.parse.quote_plus(value))
    try:
        raw = value.encode("utf-8")
    except UnicodeEncodeError:
        raw = b""
    if raw:
        for encoded in (base64.b64encode(raw), base64.urlsafe_b64encode(raw)):
            text = encoded.decode("ascii")
            forms.update({text, text.rstrip("=")})
    return forms


def secret_forms(secret: Any) -> list[str]:
    """Every form (`_parts`, then `_encodings`) of every string of `secret`, of MIN_LENGTH
    characters or more, longest first."""
    forms: set[str] = set()
    for value in secret_strings(secret):
        for part in _parts(value):
            short = isinstance(part, _Short)
            if short or len(part.strip()) >= MIN_LENGTH:
                forms.update(f for f in _encodings(str(part)) if short or len(f) >= MIN_LENGTH)
    return sorted(forms, key=lambda f: (-len(f), f))


class Redactor:
    """Replaces every form of a secret's values by "***" in text and in JSON values.

    Args:
        secret: a credential's secret (a JSON object), a list of secret strings, or None
            (then nothing is redacted).
    """

    def __init__(self, secret: Any) -> None:
        forms = secret_forms(secret) if secret else []
        self._pattern = re.compile("|".join(re.escape(f) for f in forms)) if forms else None

    def __bool__(self) -> bool:
        return self._pattern is not None

    def text(self, text: str) -> str:
        """`text` with every form of the secret replaced by "***"."""
        if self._pattern is None or not text:
            return text
        return self._pattern.sub(MASK, text)

    def value(self, value: Any, _depth: int = 0) -> Any:
        """A copy of the JSON value `value` with every string in it (object keys included)
        redacted; values deeper than 200 levels are returned as they are (the tools service
        clips its outputs far above that)."""
        if self._pattern is None:
            return value
        if isinstance(value, str):
            return self.text(value)
        if _depth > 200:
            return value
        if isinstance(value, dict):
            return {
                self.text(k) if isinstance(k, str) else k: self.value(v, _depth + 1)
                for k, v in value.items()
            }
        if isinstance(value, (list, tuple)):
            return [self.value(v, _depth + 1) for v in value]
        return value


def redact(text: str, secret: Any) -> str:
    """`text` with every form of every value of `secret` replaced by "***" (see the module)."""
    return Redactor(secret).text(text)


def redact_all(texts: Iterable[str], secret: Any) -> list[str]:
    """`redact` of several texts with one compiled pattern."""
    redactor = Redactor(secret)
    return [redactor.text(t) for t in texts]
