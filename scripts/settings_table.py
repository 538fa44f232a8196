"""Print the Markdown table of every LOOPLINE_* setting of every service (for docs/settings.md).

`python scripts/settings_table.py` prints it; tests/test_readme.py checks that docs/settings.md
lists every setting with its range, so the table cannot fall behind the code. The range
column is read from each field's pydantic constraints (a value outside it stops the
service at start).
"""

from __future__ import annotations

import re
import sys
from typing import Any

import annotated_types
from pydantic import StringConstraints
from pydantic_settings import BaseSettings

from services.billing.config import BillingSettings
from services.gateway.config import GatewaySettings
from services.orchestrator.config import OrchestratorSettings
from services.tools.config import ToolsSettings

SERVICES: list[tuple[str, type[BaseSettings]]] = [
    ("gateway", GatewaySettings),
    ("orchestrator", OrchestratorSettings),
    ("billing", BillingSettings),
    ("tools", ToolsSettings),
]


def allowed(metadata: list[Any]) -> str:
    """The values a field's constraints allow, for the table: "≥ 0", "> 0, ≤ 3,153,600,000",
    "0 to 65,535", the names a string pattern lists ("DEBUG, INFO, ..."); "" when unconstrained."""
    low = high = ""
    for item in metadata:
        if isinstance(item, annotated_types.Ge):
            low = f"≥ {item.ge:,}"
        elif isinstance(item, annotated_types.Gt):
            low = f"> {item.gt:,}"
        elif isinstance(item, annotated_types.Le):
            high = f"≤ {item.le:,}"
        elif isinstance(item, annotated_types.Lt):
            high = f"< {item.lt:,}"
        elif isinstance(item, StringConstraints) and item.pattern:
            names = re.search(r"\(([A-Z|]+)\)", str(item.pattern))
            return (
                ", ".join(names.group(1).split("|")) + (" (any case)" if item.to_upper else "")
                if names
                else ""
            )
    if low.startswith("≥ ") and high.startswith("≤ "):
        return f"{low[2:]} to {high[2:]}"
    return ", ".join(part for part in (low, high) if part)


def rows() -> list[tuple[str, str, str, str]]:
    """(variable, default, range, services) for every setting; one row per variable."""
    import pathlib

    root = pathlib.Path(__file__).resolve().parent.parent
    found: dict[str, tuple[str, str, list[str]]] = {}
    for name, cls in SERVICES:
        for field, info in cls.model_fields.items():
            variable = f"LOOPLINE_{field.upper()}"
            default = info.default
            if isinstance(default, pathlib.Path) and default.is_absolute():
                default = default.relative_to(root)
            shown = "(empty)" if default in ("", None) else str(default)
            found.setdefault(variable, (shown, allowed(info.metadata), []))[2].append(name)
    everyone = len(SERVICES)
    return [
        (v, d, r, "all" if len(o) == everyone else ", ".join(o)) for v, (d, r, o) in found.items()
    ]


def table() -> list[str]:
    """The table's lines: header, then one row per variable (shared ones first)."""
    lines = ["| variable | default | range | service |", "|---|---|---|---|"]
    for variable, default, allowed_values, owner in sorted(
        rows(), key=lambda r: (r[3] != "all", r[3], r[0])
    ):
        lines.append(f"| `{variable}` | `{default}` | {allowed_values} | {owner} |")
    return lines


def main() -> int:
    """Print the table."""
    print("\n".join(table()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
