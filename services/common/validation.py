"""Readable JSON Schema violation messages that never quote a submitted value.

One builder for every model- or user-supplied JSON that Loopline validates against a schema:
the tools service's credential `auth_data` (often a secret), its five tools' inputs and
integration actions' parameters, and the orchestrator's question tools' inputs
(`services/orchestrator/hitl.py`).
jsonschema's own messages quote the offending value (`'postgres://u:pw@h' does not match
...`), which may be a secret and may be arbitrarily long, so each violation is described
from the rule and the schema instead: the path to the field, the names of missing or
unexpected fields, and the schema's constraint (a type, a pattern, a bound, allowed
values). Every name echoed is cut to MAX_NAME_CHARS, a list of names to MAX_NAMES, a
schema value to MAX_NAME_CHARS, and the whole message to MAX_MESSAGE_CHARS.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable
from typing import Any

from jsonschema import Draft202012Validator
from jsonschema.exceptions import ValidationError

from services.common.errors import bounded

#: The longest field name (or schema value) echoed in a message; longer ones are cut with "…".
MAX_NAME_CHARS = 64
#: The most names listed for one violation ("… and N more" after them).
MAX_NAMES = 10
#: The most violations described in one message ("… and N more problems" after them).
MAX_PROBLEMS = 5
#: The longest message `schema_errors` returns.
MAX_MESSAGE_CHARS = 1000

Renderer = Callable[[list[str]], str]

_JSON_TYPES = (
    (bool, "boolean"),
    (int, "integer"),
    (float, "number"),
    (str, "string"),
    (list, "array"),
    (dict, "object"),
)
# In-place applicators: with one of them, properties declared elsewhere may be evaluated too.
_APPLICATORS = ("allOf", "anyOf", "oneOf", "if", "$ref", "$dynamicRef", "dependentSchemas")


def schema_errors(validator: Draft202012Validator, instance: Any, where: str) -> str | None:
    """A readable list of `instance`'s violations of `validator`'s schema, or None when it is valid.

    Args:
        validator: the compiled schema.
        instance: the submitted JSON value (never quoted in the result).
        where: the name of the whole instance, e.g. "auth_data" or "parameters".

    Returns:
        None, or "<where>[.path]: <problem>" parts joined with "; " (at most MAX_PROBLEMS,
        then "… and N more problems"), at most MAX_MESSAGE_CHARS long. Problems name fields
        ("'dsn' is required", "unexpected field(s) 'host' (allowed: 'dsn')"; unexpected
        names sorted, so the message does not depend on key order) and the schema's
        constraint ("must be of type integer (got string)", "must match the pattern ..."),
        never a submitted value. Raises nothing for any JSON instance.
    """
    problems: dict[tuple[str, str], tuple[Renderer | None, list[str]]] = {}
    for error in sorted(validator.iter_errors(instance), key=_path_key):
        at = _path(where, error.absolute_path)
        key, render, names = _describe(error)
        _render, merged = problems.setdefault((at, key), (render, []))
        merged.extend(
            n for n in names if n not in merged
        )  # "required" yields one error per missing field
    if not problems:
        return None
    parts = [
        f"{at}: {render(names) if render else key}"
        for (at, key), (render, names) in list(problems.items())[:MAX_PROBLEMS]
    ]
    if len(problems) > MAX_PROBLEMS:
        parts.append(f"… and {len(problems) - MAX_PROBLEMS} more problems")
    return bounded("; ".join(parts), MAX_MESSAGE_CHARS)


def _describe(error: ValidationError) -> tuple[str, Renderer | None, list[str]]:
    """(problem key, renderer, field names) of one error.

    Errors of one path with the same key are merged: their names are rendered together
    by `renderer(names)`. Without a renderer the key is the problem text itself.
    """
    rule = error.validator
    value = error.validator_value
    schema = error.schema if isinstance(error.schema, dict) else {}
    instance = error.instance
    if (
        "propertyNames" in error.relative_schema_path
    ):  # `instance` is a field name here, not a value
        return (
            f"field name {_quote(instance)} is not allowed: "
            f"{_describe_rule(rule, value, schema, instance)}",
            None,
            [],
        )
    if rule == "required" and isinstance(instance, dict) and isinstance(value, list):
        missing = [str(n) for n in value if n not in instance]
        return (
            "required",
            lambda names: f"{_names(names)} {'are' if len(names) > 1 else 'is'} required",
            missing,
        )
    if rule == "dependentRequired" and isinstance(instance, dict) and isinstance(value, dict):
        problems = []
        for present, needed in value.items():
            if present in instance and isinstance(needed, list):
                missing = [str(n) for n in needed if n not in instance]
                if missing:
                    problems.append(f"{_names(missing)} required when {_quote(present)} is given")
        return "; ".join(problems) or "a dependent field is missing", None, []
    if rule in ("additionalProperties", "unevaluatedProperties") and isinstance(instance, dict):
        allowed = [str(k) for k in (schema.get("properties") or {})]
        if rule == "unevaluatedProperties" and any(k in schema for k in _APPLICATORS):
            return "has fields the schema does not allow", None, []
        patterns = [p for p in (schema.get("patternProperties") or {}) if isinstance(p, str)]
        extras = sorted(
            str(k)
            for k in instance
            if k not in allowed and not any(_search(p, str(k)) for p in patterns)
        )
        if not extras:
            return "has fields the schema does not allow", None, []
        hint = f" (allowed: {_names(allowed)})" if allowed else " (no field is allowed here)"
        return (
            "unexpected" + hint,
            lambda names: f"unexpected field(s) {_names(names)}{hint}",
            extras,
        )
    return _describe_rule(rule, value, schema, instance), None, []


def _describe_rule(rule: Any, value: Any, schema: dict[str, Any], instance: Any) -> str:
    """The problem text of a rule about one value, from the rule, the schema and the value's JSON
    type only."""
    if rule is None:  # the `false` schema
        return "is not allowed"
    if rule == "type":
        types = value if isinstance(value, list) else [value]
        return f"must be of type {' or '.join(str(t) for t in types)} (got {_json_type(instance)})"
    if rule == "enum":
        shown = [_schema_value(v) for v in (value if isinstance(value, list) else [])[:MAX_NAMES]]
        more = (
            f" and {len(value) - MAX_NAMES} more"
            if isinstance(value, list) and len(value) > MAX_NAMES
            else ""
        )
        return f"must be one of {', '.join(shown)}{more}"
    if rule == "const":
        return f"must be {_schema_value(value)}"
    if rule == "pattern":
        return f"must match the pattern {_schema_value(value)}"
    if rule == "format":
        return f"must be a valid {bounded(str(value), MAX_NAME_CHARS)}"
    bounds = {
        "minLength": "must be at least {} character(s) long",
        "maxLength": "must be at most {} character(s) long",
        "minimum": "must be >= {}",
        "maximum": "must be <= {}",
        "exclusiveMinimum": "must be > {}",
        "exclusiveMaximum": "must be < {}",
        "multipleOf": "must be a multiple of {}",
        "minItems": "must have at least {} item(s)",
        "maxItems": "must have at most {} item(s)",
        "minProperties": "must have at least {} field(s)",
        "maxProperties": "must have at most {} field(s)",
        "minContains": "must contain at least {} matching item(s)",
        "maxContains": "must contain at most {} matching item(s)",
    }
    if rule in bounds:
        return bounds[rule].format(_schema_value(value))
    if rule == "uniqueItems":
        return "must not contain duplicate items"
    if rule == "contains":
        return "must contain at least one matching item"
    if rule in ("items", "additionalItems", "unevaluatedItems"):
        prefix = schema.get("prefixItems")
        if isinstance(prefix, list) and value is False:
            return f"must have at most {len(prefix)} item(s)"
        return "has items the schema does not allow"
    if rule == "anyOf":
        return "does not match any of the allowed forms"
    if rule == "oneOf":
        return "must match exactly one of the allowed forms"
    if rule == "not":
        return "matches a form that is not allowed"
    return f"{bounded(str(rule), MAX_NAME_CHARS)} rule failed"


def _path(where: str, path: Iterable[Any]) -> str:
    """`where` followed by ".name" for each field and "[i]" for each array index (names cut)."""
    text = where
    for part in path:
        text += f"[{part}]" if isinstance(part, int) else f".{_plain(str(part))}"
    return text


def _path_key(error: ValidationError) -> list[tuple[int, int, str]]:
    """A sort key for an error's path that never compares an index with a name."""
    return [(0, p, "") if isinstance(p, int) else (1, 0, str(p)) for p in error.absolute_path]


def _names(names: Iterable[str]) -> str:
    """ "'a', 'b'" for up to MAX_NAMES names (each cut), then "and N more"."""
    listed = list(dict.fromkeys(names))
    shown = ", ".join(_quote(n) for n in listed[:MAX_NAMES])
    return shown + (f" and {len(listed) - MAX_NAMES} more" if len(listed) > MAX_NAMES else "")


def _quote(name: Any) -> str:
    return f"'{_plain(str(name))}'"


def _plain(text: str) -> str:
    """`text` cut to MAX_NAME_CHARS, with control characters escaped (a name may be anything)."""
    text = bounded(text, MAX_NAME_CHARS)
    return "".join(
        c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text
    )


def _schema_value(value: Any) -> str:
    """A schema's constraint value (never a submitted one) as JSON, cut to MAX_NAME_CHARS."""
    try:
        text = json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        text = str(value)
    return _plain(text)


def _json_type(value: Any) -> str:
    """The JSON type name of `value` ("null" for None)."""
    if value is None:
        return "null"
    for kind, name in _JSON_TYPES:
        if isinstance(value, kind):
            return name
    return type(value).__name__


def _search(pattern: str, text: str) -> bool:
    try:
        return re.search(pattern, text) is not None
    except re.error:
        return False


# RFC 9110 section 5.1: a field name is a token (section 5.6.2: tchar); section 5.5: a field value
# is visible characters, spaces and tabs. obs-text (bytes 0x80-0xFF) is refused too: HTTP clients
# encode header values as ASCII (httpx raised UnicodeEncodeError on "café").
_HEADER_NAME = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_HEADER_VALUE = re.compile(r"[\t\x20-\x7e]*")


def header_fields_problem(headers: dict[str, Any], where: str = "headers") -> str | None:
    """Why `headers` (names to values) cannot be sent as HTTP header fields, or None.

    Names must be tokens (RFC 9110 section 5.1) and values strings of visible ASCII, spaces and
    tabs (section 5.5: no CR, LF or NUL, which would split or end the header block). Values are
    never quoted (an `Authorization` value is a secret); names are, cut and escaped. Used for an
    MCP server's headers by the gateway and the tools service, so that a server registered with
    `{"Bad Header": "v"}` is refused at once instead of failing every call.
    """
    for name, value in headers.items():
        if not isinstance(value, str):
            return f"{where} must map header names to strings"
        if not _HEADER_NAME.fullmatch(name):
            return (
                f"{where}: {_quote(name)} is not a header name "
                "(letters, digits and !#$%&'*+-.^_`|~ only; RFC 9110 section 5.1)"
            )
        if not _HEADER_VALUE.fullmatch(value):
            return (
                f"{where}: the value of {_quote(name)} holds a character a header cannot carry "
                "(visible ASCII, spaces and tabs only; RFC 9110 section 5.5)"
            )
    return None
