"""A hypothesis state machine over the gRPC API: admit, charge, release, retry, expire.

Invariants after every step: no balance is negative or over its limit, each
reservation is resolved at most once (one ledger posting at most), replays return
identical results, and the account's balances equal what the ledger says.
"""

from __future__ import annotations

import asyncio
import datetime
import pathlib
import uuid

import grpc
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
    run_state_machine_as_test,
)
from sqlalchemy import func, select, update

from loopline.billing.v1 import billing_pb2 as pb
from loopline.billing.v1 import billing_pb2_grpc
from services.billing.models import Account, LedgerEntry, Reservation
from services.billing.server import BillingServer
from services.common.errors import status_details
from tests.billing.helpers import admit_request, make_settings

KEYS = [f"chat:{i}" for i in range(6)]
ALLOWANCE = 3  # plan "machine": 3 run credits, then the wallet at 5 minor units a credit
PRICE = 5
WALLET = 12  # two wallet-funded runs fit, a third does not

STATE = {
    pb.RESERVATION_STATE_HELD: "held",
    pb.RESERVATION_STATE_CHARGED: "charged",
    pb.RESERVATION_STATE_RELEASED: "released",
    pb.RESERVATION_STATE_EXPIRED: "expired",
}


class Harness:
    """One event loop, one server, one channel, shared by every example (each uses a new org)."""

    def __init__(self, tmp_path: pathlib.Path) -> None:
        self.runner = asyncio.Runner()
        self.server: BillingServer = self.runner.run(BillingServer.start(make_settings(tmp_path)))
        self.channel = self.runner.run(self._channel())
        self.stub = billing_pb2_grpc.BillingServiceStub(self.channel)

    async def _channel(self) -> grpc.aio.Channel:
        return grpc.aio.insecure_channel(f"127.0.0.1:{self.server.port}")

    def run(self, awaitable):  # noqa: ANN001, ANN201
        """Await a coroutine or a grpc.aio call on the harness loop."""

        async def wait():  # noqa: ANN202
            return await awaitable

        return self.runner.run(wait())

    def close(self) -> None:
        self.run(self.channel.close())
        self.run(self.server.stop(0))
        self.runner.close()


class BillingMachine(RuleBasedStateMachine):
    harness: Harness

    @initialize()
    def new_account(self) -> None:
        self.org = f"org_{uuid.uuid4().hex[:12]}"
        admin = self.harness.server.admin
        self.harness.run(admin.set_plan(self.org, "machine"))
        self.harness.run(admin.top_up(self.org, WALLET))
        # model: key -> (reservation_id, funding, state); charge entry per reservation
        self.reservations: dict[str, dict] = {}
        self.entries: dict[str, str] = {}

    # ---------------------------------------------------------------- model helpers

    def _held(self, funding: str) -> int:
        return sum(
            1
            for r in self.reservations.values()
            if r["funding"] == funding and r["state"] == "held"
        )

    def _charged(self, funding: str) -> int:
        return sum(
            1
            for r in self.reservations.values()
            if r["funding"] == funding and r["state"] == "charged"
        )

    # ---------------------------------------------------------------- rules

    @rule(key=st.sampled_from(KEYS))
    def admit(self, key: str) -> None:
        known = self.reservations.get(key)
        try:
            response = self.harness.run(self.harness.stub.Admit(admit_request(self.org, key)))
        except grpc.aio.AioRpcError as error:
            assert known is None, "a replay must never be denied"
            allowance_left = ALLOWANCE - self._held("allowance") - self._charged("allowance")
            wallet_left = WALLET - PRICE * (self._held("wallet") + self._charged("wallet"))
            assert allowance_left < 1 and wallet_left < PRICE
            assert status_details(error).reason == "WALLET_INSUFFICIENT_FUNDS"
            return
        if known is not None:
            assert response.replayed
            assert response.reservation_id == known["id"] and response.credits == 1
            assert STATE[response.state] == known["state"]
            return
        assert not response.replayed and response.state == pb.RESERVATION_STATE_HELD
        funding = (
            "allowance"
            if self._held("allowance") + self._charged("allowance") < ALLOWANCE
            else "wallet"
        )
        self.reservations[key] = {
            "id": response.reservation_id,
            "funding": funding,
            "state": "held",
        }

    @rule(key=st.sampled_from(KEYS))
    def charge(self, key: str) -> None:
        known = self.reservations.get(key)
        if known is None:
            return
        try:
            response = self.harness.run(
                self.harness.stub.Charge(pb.ChargeRequest(reservation_id=known["id"]))
            )
        except grpc.aio.AioRpcError as error:
            assert known["state"] in ("released", "expired")
            assert status_details(error).reason == f"RESERVATION_{known['state'].upper()}"
            return
        assert known["state"] in ("held", "charged")
        if known["state"] == "charged":
            assert response.ledger_entry_id == self.entries[known["id"]]  # retry: the same entry
        known["state"] = "charged"
        self.entries[known["id"]] = response.ledger_entry_id

    @rule(key=st.sampled_from(KEYS))
    def release(self, key: str) -> None:
        known = self.reservations.get(key)
        if known is None:
            return
        response = self.harness.run(
            self.harness.stub.Release(pb.ReleaseRequest(reservation_id=known["id"]))
        )
        if known["state"] == "held":
            known["state"] = "released"
        assert STATE[response.state] == known["state"]

    @rule(key=st.sampled_from(KEYS))
    def expire(self, key: str) -> None:
        known = self.reservations.get(key)
        if known is None:
            return
        server = self.harness.server
        past = datetime.datetime.now(datetime.UTC) - datetime.timedelta(seconds=1)

        async def backdate() -> int:
            async with server.store.sessions() as session, session.begin():
                await session.execute(
                    update(Reservation).where(Reservation.id == known["id"]).values(expires_at=past)
                )
            return await server.ledger.expire_holds()

        expired = self.harness.run(backdate())
        assert expired == (1 if known["state"] == "held" else 0)
        if known["state"] == "held":
            known["state"] = "expired"

    # ---------------------------------------------------------------- invariants

    @invariant()
    def balances_match_the_model_and_the_ledger(self) -> None:
        if not hasattr(self, "org"):
            return
        store = self.harness.server.store

        async def read() -> tuple:
            async with store.sessions() as session:
                account = await session.get(Account, self.org)
                entries = (
                    (
                        await session.execute(
                            select(LedgerEntry).where(LedgerEntry.org_id == self.org)
                        )
                    )
                    .scalars()
                    .all()
                )
                postings = (
                    await session.execute(
                        select(LedgerEntry.reservation_id, func.count())
                        .where(
                            LedgerEntry.org_id == self.org, LedgerEntry.reservation_id.is_not(None)
                        )
                        .group_by(LedgerEntry.reservation_id)
                    )
                ).all()
            return account, entries, postings

        account, entries, postings = self.harness.run(read())
        for value in (
            account.allowance_used,
            account.allowance_reserved,
            account.wallet_balance_minor,
            account.wallet_reserved_minor,
        ):
            assert value >= 0
        assert (
            account.allowance_used + account.allowance_reserved
            <= account.period_allowance
            == ALLOWANCE
        )
        assert account.wallet_reserved_minor <= account.wallet_balance_minor
        assert account.allowance_used == self._charged("allowance")
        assert account.allowance_reserved == self._held("allowance")
        assert account.wallet_balance_minor == WALLET - PRICE * self._charged("wallet")
        assert account.wallet_reserved_minor == PRICE * self._held("wallet")
        # ledger balanced with the account
        assert account.allowance_used == -sum(
            e.amount for e in entries if e.kind == "run_charge" and e.unit == "credit"
        )
        assert account.wallet_balance_minor == sum(e.amount for e in entries if e.unit == "minor")
        # each reservation posted at most once
        assert all(count == 1 for _, count in postings)
        assert len(postings) == self._charged("allowance") + self._charged("wallet")


def test_billing_state_machine_keeps_its_invariants(tmp_path):
    harness = Harness(tmp_path)
    BillingMachine.harness = harness
    try:
        run_state_machine_as_test(
            BillingMachine,
            settings=settings(
                max_examples=30,
                stateful_step_count=20,
                deadline=None,
                suppress_health_check=[HealthCheck.too_slow],
            ),
        )
    finally:
        harness.close()
