"""Reading what services log: the structured fields a record carries."""

from __future__ import annotations

import logging
from typing import Any


def fields_of(record: logging.LogRecord) -> dict[str, Any]:
    """The `fields` a record was logged with (`extra={"fields": {...}}`), which the JSON
    formatter merges into the line; LogRecord declares no such attribute, so it is read here."""
    fields = vars(record)["fields"]
    assert isinstance(fields, dict)
    return fields
