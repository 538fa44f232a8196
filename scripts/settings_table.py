"""Print the Markdown table of every LOOPLINE_* setting of every service (for README.md).

`python scripts/settings_table.py` prints it; tests/test_readme.py checks that README.md
lists every setting, so the table cannot fall behind the code.
"""

from __future__ import annotations

import sys

from services.billing.config import BillingSettings
from services.gateway.config import GatewaySettings
from services.orchestrator.config import OrchestratorSettings
from services.tools.config import ToolsSettings

SERVICES = [
    ("all", None),
    ("gateway", GatewaySettings),
    ("orchestrator", OrchestratorSettings),
    ("billing", BillingSettings),
    ("tools", ToolsSettings),
]


def rows() -> list[tuple[str, str, str]]:
    """(variable, default, services) for every setting; one row per variable."""
    import pathlib

    root = pathlib.Path(__file__).resolve().parent.parent
    found: dict[str, tuple[str, list[str]]] = {}
    for name, cls in SERVICES[1:]:
        for field, info in cls.model_fields.items():
            variable = f"LOOPLINE_{field.upper()}"
            default = info.default
            if isinstance(default, pathlib.Path) and default.is_absolute():
                default = default.relative_to(root)
            shown = "(empty)" if default in ("", None) else str(default)
            found.setdefault(variable, (shown, []))[1].append(name)
    everyone = len(SERVICES) - 1
    return [(v, d, "all" if len(o) == everyone else ", ".join(o)) for v, (d, o) in found.items()]


def main() -> int:
    """Print the table."""
    print("| variable | default | service |")
    print("|---|---|---|")
    for variable, default, owner in sorted(rows(), key=lambda r: (r[2] != "all", r[2], r[0])):
        print(f"| `{variable}` | `{default}` | {owner} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
