"""The plan catalogue: read from a TOML file and upserted into the `plans` table.

The file (`services/billing/plans.toml` by default, LOOPLINE_BILLING_PLANS_PATH) is the
source of truth for plan terms; `sync_plans` runs at server start and in `admin seed-dev`.
"""

from __future__ import annotations

import pathlib
import tomllib
from dataclasses import dataclass, field

from limits import parse
from sqlalchemy.ext.asyncio import async_sessionmaker

from services.billing.models import Plan, utcnow


@dataclass(frozen=True)
class PlanTerms:
    """One plan's terms as written in plans.toml (credits and minor units are integers)."""

    name: str
    monthly_run_credits: int
    max_runs_per_day: int | None
    wallet_overage: bool
    wallet_price_minor: int
    rate_limits: dict[str, str] = field(default_factory=dict)


def load_plans(path: pathlib.Path) -> dict[str, PlanTerms]:
    """Parse the plan file at `path`; raises ValueError on a malformed plan or rate limit."""
    data = tomllib.loads(pathlib.Path(path).read_text())
    plans: dict[str, PlanTerms] = {}
    for name, row in data.get("plans", {}).items():
        rate_limits = {str(k): str(v) for k, v in row.get("rate_limits", {}).items()}
        for rate_class, expression in rate_limits.items():
            try:
                parse(expression)
            except ValueError as exc:
                raise ValueError(f"plan {name}: bad rate limit {rate_class}={expression!r}") from exc
        terms = PlanTerms(
            name=name,
            monthly_run_credits=int(row["monthly_run_credits"]),
            max_runs_per_day=int(row["max_runs_per_day"]) if "max_runs_per_day" in row else None,
            wallet_overage=bool(row.get("wallet_overage", False)),
            wallet_price_minor=int(row.get("wallet_price_minor", 0)),
            rate_limits=rate_limits,
        )
        if terms.monthly_run_credits < 0 or terms.wallet_price_minor < 0:
            raise ValueError(f"plan {name}: credits and prices must be non-negative")
        if terms.wallet_overage and terms.wallet_price_minor <= 0:
            raise ValueError(f"plan {name}: wallet overage needs a positive wallet_price_minor")
        plans[name] = terms
    if not plans:
        raise ValueError(f"plan file {path} defines no plans")
    return plans


async def sync_plans(sessions: async_sessionmaker, plans: dict[str, PlanTerms]) -> None:
    """Insert or update every plan of `plans` in the `plans` table (plans not listed are kept)."""
    async with sessions() as session, session.begin():
        for terms in plans.values():
            row = await session.get(Plan, terms.name)
            if row is None:
                row = Plan(name=terms.name)
                session.add(row)
            row.monthly_run_credits = terms.monthly_run_credits
            row.max_runs_per_day = terms.max_runs_per_day
            row.rate_limits = dict(terms.rate_limits)
            row.wallet_overage = terms.wallet_overage
            row.wallet_price_minor = terms.wallet_price_minor
            row.updated_at = utcnow()
