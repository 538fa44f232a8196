"""The prebuilt SQL of billing's general transactions (`store.BillingStore`).

Built once at import as SQLAlchemy Core with bound parameters named `p_*`, and executed on a
plain connection: no ORM session and no statement construction per call. On SQLite the
transaction runner compiles each to raw SQL once. Every balance change is a conditional
UPDATE, so a balance never goes negative and a reservation resolves only from `held`.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import Date, Table, and_, bindparam, case, insert, select, update

from services.billing.models import (
    CHARGED,
    EXPIRED,
    HELD,
    Account,
    LedgerEntry,
    Plan,
    Reservation,
    UsageRecord,
    UTCDateTime,
)


def _table(model: Any) -> Table:
    table = model.__table__
    assert isinstance(table, Table)
    return table


_A = _table(Account)
_R = _table(Reservation)
_L = _table(LedgerEntry)
_U = _table(UsageRecord)
_P = _table(Plan)


def _bp(name: str, type_: Any = None) -> Any:
    return bindparam(name, type_=type_)


_DATETIME = UTCDateTime()
_DATE = Date()

SEL_ACCOUNT = select(_A).where(_A.c.org_id == _bp("p_org"))
SEL_PLANS = select(_P)
SEL_RESERVATION = select(_R).where(_R.c.org_id == _bp("p_org"), _R.c.turn_key == _bp("p_turn_key"))
INS_RESERVATION = insert(_R)
INS_LEDGER = insert(_L)

ROLL_PERIOD = (
    update(_A)
    .where(_A.c.org_id == _bp("p_org"), _A.c.period_start < _bp("p_period", _DATE))
    .values(
        period_start=_bp("p_period", _DATE),
        period_allowance=select(_P.c.monthly_run_credits)
        .where(_P.c.name == _A.c.plan)
        .scalar_subquery(),
        granted_credits=0,
        allowance_used=0,
        usage_millicredits=0,
    )
)

_RUNS_TODAY = case((_A.c.quota_day == _bp("p_today"), _A.c.runs_today), else_=0)
_QUOTA_VALUES = {
    "runs_today": case((_A.c.quota_day == _bp("p_today"), _A.c.runs_today + 1), else_=1),
    "quota_day": _bp("p_today"),
}
_ALLOWANCE_FITS = (
    _A.c.allowance_used + _A.c.allowance_reserved + _bp("p_credits") <= _A.c.period_allowance
)


def _fast_reserve_stmt(counts_runs: bool, has_quota: bool) -> Any:
    """The merged quota + allowance UPDATE of the common admission (plan and period as cached)."""
    where = [
        _A.c.org_id == _bp("p_org"),
        _A.c.plan == _bp("p_plan"),
        _A.c.period_start >= _bp("p_period", _DATE),
        _ALLOWANCE_FITS,
    ]
    values: dict[str, Any] = {"allowance_reserved": _A.c.allowance_reserved + _bp("p_credits")}
    if counts_runs:
        if has_quota:
            where.append(_RUNS_TODAY + 1 <= _bp("p_max_runs"))
        values.update(_QUOTA_VALUES)
    return update(_A).where(*where).values(**values)


FAST_RESERVE = {(c, q): _fast_reserve_stmt(c, q) for c in (False, True) for q in (False, True)}
QUOTA_UPDATE = {
    False: update(_A).where(_A.c.org_id == _bp("p_org")).values(**_QUOTA_VALUES),
    True: update(_A)
    .where(_A.c.org_id == _bp("p_org"), _RUNS_TODAY + 1 <= _bp("p_max_runs"))
    .values(**_QUOTA_VALUES),
}
ALLOWANCE_UPDATE = (
    update(_A)
    .where(_A.c.org_id == _bp("p_org"), _ALLOWANCE_FITS)
    .values(allowance_reserved=_A.c.allowance_reserved + _bp("p_credits"))
)
WALLET_UPDATE = (
    update(_A)
    .where(
        _A.c.org_id == _bp("p_org"),
        _A.c.wallet_balance_minor - _A.c.wallet_reserved_minor >= _bp("p_cost"),
    )
    .values(wallet_reserved_minor=_A.c.wallet_reserved_minor + _bp("p_cost"))
)

_RESOLVED = (
    _R.c.org_id,
    _R.c.credits,
    _R.c.funding,
    _R.c.wallet_minor,
    _R.c.usage_type,
    _R.c.quota_day,
)
CHARGE_RESERVATION = (
    update(_R)
    .where(_R.c.id == _bp("p_id"), _R.c.state == HELD)
    .values(state=CHARGED, resolved_at=_bp("p_now", _DATETIME))
    .returning(*_RESOLVED)
)
# A late charge (ChargeBatch): the hold had expired, so its credits were given back; they are
# taken from the allowance or the wallet as they stand (`BillingStore._charge_txn`).
CHARGE_EXPIRED = (
    update(_R)
    .where(_R.c.id == _bp("p_id"), _R.c.state == EXPIRED)
    .values(state=CHARGED, resolved_at=_bp("p_now", _DATETIME))
    .returning(*_RESOLVED)
)
VOID_RESERVATION = (
    update(_R)
    .where(_R.c.id == _bp("p_id"), _R.c.state == HELD)
    .values(
        state=_bp("p_state"), resolved_at=_bp("p_now", _DATETIME), release_reason=_bp("p_reason")
    )
    .returning(*_RESOLVED)
)
_IN_PERIOD = (_A.c.org_id == _bp("p_org"), _A.c.period_start >= _bp("p_period", _DATE))
CHARGE_ALLOWANCE = (
    update(_A)
    .where(*_IN_PERIOD)
    .values(
        allowance_reserved=_A.c.allowance_reserved - _bp("p_n"),
        allowance_used=_A.c.allowance_used + _bp("p_n"),
    )
)
CHARGE_WALLET = (
    update(_A)
    .where(*_IN_PERIOD)
    .values(
        wallet_reserved_minor=_A.c.wallet_reserved_minor - _bp("p_n"),
        wallet_balance_minor=_A.c.wallet_balance_minor - _bp("p_n"),
    )
)
CHARGE_ALLOWANCE_LATE = (
    update(_A).where(*_IN_PERIOD).values(allowance_used=_A.c.allowance_used + _bp("p_n"))
)
# the run an expired hold gave back to the daily quota counts again (only if still that day)
RETAKE_QUOTA = (
    update(_A)
    .where(_A.c.org_id == _bp("p_org"), _A.c.quota_day == _bp("p_quota_day"))
    .values(runs_today=_A.c.runs_today + 1)
)
CHARGE_WALLET_LATE = (
    update(_A)
    .where(*_IN_PERIOD)
    .values(wallet_balance_minor=_A.c.wallet_balance_minor - _bp("p_n"))
)
VOID_ACCOUNT = (
    update(_A)
    .where(_A.c.org_id == _bp("p_org"))
    .values(
        allowance_reserved=_A.c.allowance_reserved - _bp("p_allowance"),
        wallet_reserved_minor=_A.c.wallet_reserved_minor - _bp("p_wallet"),
        # Give the voided run back to the daily quota (only if still the same day).
        runs_today=case(
            (and_(_A.c.quota_day == _bp("p_quota_day"), _A.c.runs_today > 0), _A.c.runs_today - 1),
            else_=_A.c.runs_today,
        ),
    )
)
SET_PLAN = (
    update(_A)
    .where(_A.c.org_id == _bp("p_org"))
    .values(plan=_bp("p_plan"), period_allowance=_A.c.granted_credits + _bp("p_credits"))
)
GRANT_CREDITS = (
    update(_A)
    .where(_A.c.org_id == _bp("p_org"))
    .values(
        granted_credits=_A.c.granted_credits + _bp("p_n"),
        period_allowance=_A.c.period_allowance + _bp("p_n"),
    )
)
TOP_UP = (
    update(_A)
    .where(_A.c.org_id == _bp("p_org"))
    .values(wallet_balance_minor=_A.c.wallet_balance_minor + _bp("p_n"))
)
ADD_USAGE = (
    update(_A).where(*_IN_PERIOD).values(usage_millicredits=_A.c.usage_millicredits + _bp("p_n"))
)
SEL_CHARGE_STATE = (
    select(_R.c.state, _L.c.id)
    .select_from(_R.outerjoin(_L, _L.c.idempotency_key == _bp("p_key")))
    .where(_R.c.id == _bp("p_id"))
)
SEL_RESERVATION_STATE = select(_R.c.state).where(_R.c.id == _bp("p_id"))
SEL_USAGE = select(_U.c.id, _U.c.org_id, _U.c.millicredits).where(
    _U.c.run_id == _bp("p_run"), _U.c.call_index == _bp("p_call")
)
SEL_LEDGER_BY_KEY = select(_L.c.id, _L.c.org_id, _L.c.kind, _L.c.amount).where(
    _L.c.idempotency_key == _bp("p_key")
)
SEL_EXPIRED = (
    select(_R.c.id)
    .where(_R.c.state == HELD, _R.c.expires_at <= _bp("p_now", _DATETIME))
    .order_by(_R.c.expires_at)
    .limit(_bp("p_batch"))
)
