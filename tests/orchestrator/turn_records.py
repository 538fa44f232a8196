"""What a turn start left in the stack's databases, for tests that check what a failed one
writes and charges.
"""

from __future__ import annotations

from sqlalchemy import func, select

from services.billing.models import LedgerEntry, Reservation
from services.orchestrator.models import Chat, Run


async def counts(services) -> tuple[int, int, list[str], int]:
    """(chats, runs, reservation states, "charge:" ledger entries) of the stack's organization."""
    async with services.orchestrator.servicer.sessions() as session:
        chats = await session.scalar(
            select(func.count()).select_from(Chat).where(Chat.organization_id == services.org_id)
        )
        runs = await session.scalar(
            select(func.count()).select_from(Run).where(Run.organization_id == services.org_id)
        )
    async with services.billing.store.sessions() as session:
        states = (
            await session.scalars(
                select(Reservation.state).where(Reservation.org_id == services.org_id)
            )
        ).all()
        charges = await session.scalar(
            select(func.count())
            .select_from(LedgerEntry)
            .where(
                LedgerEntry.org_id == services.org_id, LedgerEntry.idempotency_key.like("charge:%")
            )
        )
    return chats, runs, sorted(states), charges
