"""The plan catalogue: read from a TOML file and upserted into the `plans` table.

The file (`services/billing/plans.toml` by default, LOOPLINE_BILLING_PLANS_PATH) is the
source of truth for plan terms; `sync_plans` runs at server start and in `admin seed-dev`.
"""

from __future__ import annotations

import importlib
import pathlib
from dataclasses import dataclass, field

from limits import parse
from sqlalchemy.ext.asyncio import async_sessionmaker

from services.billing.models import Plan, utcnow
from services.common.config import read_toml_file


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
    """Parse the plan file at `path` (LOOPLINE_BILLING_PLANS_PATH) into {name: PlanTerms}.

    Raises ValueError, its message naming the file (and the plan): the file cannot be read
    or is not TOML (`read_toml_file`), `plans` or a plan or its `rate_limits` is not a table,
    `monthly_run_credits` is missing, a number is not an integer, a rate limit is not in
    `limits` notation, an amount is negative, wallet overage has no positive price, or no
    plan is defined. The format is the shipped services/billing/plans.toml.
    """
    data = read_toml_file(path, "plan file", "LOOPLINE_BILLING_PLANS_PATH")
    table = data.get("plans", {})
    if not isinstance(table, dict):
        raise ValueError(f"plan file {path}: `plans` must be a table of plans ([plans.<name>])")
    plans: dict[str, PlanTerms] = {}
    for name, row in table.items():
        try:
            terms = _plan_terms(name, row)
        except ValueError as exc:
            raise ValueError(f"plan file {path}: plan {name}: {exc}") from None
        plans[name] = terms
    if not plans:
        raise ValueError(f"plan file {path} defines no plans")
    return plans


def _plan_terms(name: str, row: object) -> PlanTerms:
    """The PlanTerms of plan `name` from its table `row`; raises ValueError saying what is wrong."""
    if not isinstance(row, dict):
        raise ValueError("must be a table ([plans.<name>])")
    raw_limits = row.get("rate_limits", {})
    if not isinstance(raw_limits, dict):
        raise ValueError('rate_limits must be a table of rate class = "N/period"')
    rate_limits = {str(k): str(v) for k, v in raw_limits.items()}
    for rate_class, expression in rate_limits.items():
        try:
            parse(expression)
        except ValueError:
            raise ValueError(f"bad rate limit {rate_class}={expression!r}") from None
    if "monthly_run_credits" not in row:
        raise ValueError("monthly_run_credits is missing")
    terms = PlanTerms(
        name=name,
        monthly_run_credits=_integer(row, "monthly_run_credits"),
        max_runs_per_day=_integer(row, "max_runs_per_day") if "max_runs_per_day" in row else None,
        wallet_overage=bool(row.get("wallet_overage", False)),
        wallet_price_minor=_integer(row, "wallet_price_minor", 0),
        rate_limits=rate_limits,
    )
    if terms.monthly_run_credits < 0 or terms.wallet_price_minor < 0:
        raise ValueError("credits and prices must be non-negative")
    if terms.wallet_overage and terms.wallet_price_minor <= 0:
        raise ValueError("wallet overage needs a positive wallet_price_minor")
    return terms


def _integer(row: dict[str, object], field_name: str, default: int | None = None) -> int:
    """`row[field_name]` (or `default` when absent) as an int; ValueError when it is not one."""
    value = row.get(field_name, default)
    try:
        if not isinstance(value, int | float | str):
            raise TypeError(field_name)
        return int(value)
    except (TypeError, ValueError):
        raise ValueError(f"{field_name} must be an integer") from None


async def sync_plans(sessions: async_sessionmaker, plans: dict[str, PlanTerms]) -> None:
    """Insert or update every plan of `plans` in the `plans` table (plans not listed are kept).

    One `INSERT ... ON CONFLICT (name) DO UPDATE` per plan, so billing replicas that start
    together (Procfile.scale) may each write the same file's plans without one of them failing
    on `plans_pkey`."""
    async with sessions() as session, session.begin():
        dialect = session.bind.dialect.name
        if dialect not in ("sqlite", "postgresql"):
            raise ValueError(f"unsupported database dialect {dialect!r} (sqlite or postgresql)")
        insert = importlib.import_module(f"sqlalchemy.dialects.{dialect}").insert
        for terms in plans.values():
            values = {
                "monthly_run_credits": terms.monthly_run_credits,
                "max_runs_per_day": terms.max_runs_per_day,
                "rate_limits": dict(terms.rate_limits),
                "wallet_overage": terms.wallet_overage,
                "wallet_price_minor": terms.wallet_price_minor,
                "updated_at": utcnow(),
            }
            statement = insert(Plan).values(name=terms.name, **values)
            await session.execute(
                statement.on_conflict_do_update(index_elements=["name"], set_=values)
            )
