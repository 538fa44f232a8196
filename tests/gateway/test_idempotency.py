"""Idempotency-Key on POST /assistant/chat (AIP-155)."""

from __future__ import annotations

from sqlalchemy import func, select

from services.orchestrator.models import Run
from tests.sse_client import read_frames


async def _runs(services) -> int:
    async with services.orchestrator.servicer.sessions() as session:
        return (await session.execute(select(func.count()).select_from(Run))).scalar()


async def test_retry_with_same_key_and_body_returns_original_and_starts_nothing(services):
    async with services.client() as client:
        headers = {"Idempotency-Key": "turn-1"}
        first = await client.post("/assistant/chat", json={"message": "hello"}, headers=headers)
        second = await client.post("/assistant/chat", json={"message": "hello"}, headers=headers)
        assert first.status_code == second.status_code == 200
        assert first.json() == second.json()
        assert second.headers["Idempotent-Replayed"] == "true"
        await read_frames(client, first.json()["stream_url"])
    assert await _runs(services) == 1


async def test_same_key_with_another_body_is_422(services):
    async with services.client() as client:
        headers = {"Idempotency-Key": "turn-2"}
        assert (
            await client.post("/assistant/chat", json={"message": "hello"}, headers=headers)
        ).status_code == 200
        other = await client.post("/assistant/chat", json={"message": "different"}, headers=headers)
    assert other.status_code == 422
    assert "Idempotency-Key" in other.json()["detail"]
    assert await _runs(services) == 1


async def test_failed_request_frees_its_key(services):
    import uuid

    async with services.client() as client:
        headers = {"Idempotency-Key": "turn-3"}
        missing = await client.post(
            "/assistant/chat", json={"message": "hi", "chat_id": str(uuid.uuid4())}, headers=headers
        )
        assert missing.status_code == 404
        again = await client.post(
            "/assistant/chat", json={"message": "hi", "chat_id": str(uuid.uuid4())}, headers=headers
        )
        assert again.status_code == 404


async def test_keys_are_scoped_to_the_caller(services):
    admin = await services.member("admin")
    async with services.client() as client:
        a = await client.post(
            "/assistant/chat", json={"message": "hello"}, headers={"Idempotency-Key": "shared"}
        )
        b = await client.post(
            "/assistant/chat",
            json={"message": "hello"},
            headers={"Idempotency-Key": "shared", **services.headers(api_key=admin["api_key"])},
        )
    assert a.status_code == b.status_code == 200
    assert a.json()["run_id"] != b.json()["run_id"]


async def test_a_key_whose_gateway_died_mid_request_can_be_retried_after_the_lease(services):
    """A key left "in progress" by a gateway killed mid-request (no answer stored, nobody to
    free it) is taken over after IN_PROGRESS_LEASE_S, so a retry on either gateway goes
    through instead of getting 409 for the whole 24 h TTL."""
    import datetime

    import orjson
    from sqlalchemy import update

    from services.gateway.idempotency import IN_PROGRESS_LEASE_S, body_hash
    from services.gateway.models import IdempotencyRecord

    route, body = "POST /assistant/chat", {"message": "hello"}
    store = services.gateway.idempotency
    # the dead gateway's claim: made, never answered, never freed
    assert (
        await store.claim(
            services.org_id,
            services.user_id,
            "turn-crash",
            route,
            body_hash(route, orjson.dumps(body, option=orjson.OPT_SORT_KEYS)),
        )
        is None
    )
    async with services.client() as client:
        headers = {"Idempotency-Key": "turn-crash"}
        assert (
            await client.post("/assistant/chat", json=body, headers=headers)
        ).status_code == 409  # it may still run
        async with store.sessions() as session, session.begin():
            old = datetime.datetime.now(datetime.UTC) - datetime.timedelta(
                seconds=IN_PROGRESS_LEASE_S + 1
            )
            await session.execute(
                update(IdempotencyRecord)
                .where(IdempotencyRecord.key == "turn-crash")
                .values(created_at=old)
            )
        assert (
            await client.post("/assistant/chat", json={"message": "another"}, headers=headers)
        ).status_code == 422
        retried = await client.post("/assistant/chat", json=body, headers=headers)
        assert retried.status_code == 200, retried.text
        replayed = await client.post("/assistant/chat", json=body, headers=headers)
        assert (
            replayed.json() == retried.json() and replayed.headers["Idempotent-Replayed"] == "true"
        )
        await read_frames(client, retried.json()["stream_url"])
    assert await _runs(services) == 1


def _lose_first_answer(services, monkeypatch) -> list[str]:
    """The orchestrator's first StartTurn answer is lost after its turn started (and was
    charged): it fails with UNAVAILABLE (503), later ones answer. Returns the list that gets
    the run id of the turn whose answer was lost."""
    import grpc

    from services.common.errors import RpcError

    servicer = services.orchestrator.servicer
    real = servicer._started
    lost: list[str] = []

    def answer_lost_once(chat_id: str, run_id: str):
        if not lost:
            lost.append(run_id)
            raise RpcError(
                grpc.StatusCode.UNAVAILABLE, "ANSWER_LOST", "the answer was lost on its way"
            )
        return real(chat_id, run_id)

    monkeypatch.setattr(servicer, "_started", answer_lost_once)
    return lost


async def test_a_retry_of_a_start_whose_answer_was_lost_answers_the_started_turn_charging_once(
    services, monkeypatch
):
    """The orchestrator starts (and charges) the turn, but its answer does not reach the gateway
    in time. The gateway passes the Idempotency-Key down as StartTurn's request_id (AIP-155), so
    the client's retry with the same key gets the turn already started, not a second charge."""
    from tests.orchestrator.helpers import billing_delivered

    lost = _lose_first_answer(services, monkeypatch)
    async with services.client() as client:
        headers = {"Idempotency-Key": "turn-lost"}
        first = await client.post("/assistant/chat", json={"message": "hello"}, headers=headers)
        assert first.status_code == 503, first.text
        retry = await client.post("/assistant/chat", json={"message": "hello"}, headers=headers)
        assert retry.status_code == 200, retry.text
        assert retry.json()["run_id"] == lost[0]
        await read_frames(client, retry.json()["stream_url"])
        other = await client.post(
            "/assistant/chat", json={"message": "hello"}, headers={"Idempotency-Key": "turn-other"}
        )
        assert (
            other.status_code == 200 and other.json()["run_id"] != lost[0]
        )  # another key: another turn
    assert await _runs(services) == 2
    await billing_delivered(services)
    from services.billing.models import LedgerEntry

    async with services.billing.store.sessions() as session:
        charges = await session.scalar(
            select(func.count()).select_from(LedgerEntry).where(LedgerEntry.kind == "run_charge")
        )
    assert charges == 2


async def test_a_request_id_longer_than_64_characters_is_refused(services):
    import grpc
    import pytest

    from loopline.assistant.v1 import assistant_pb2, assistant_pb2_grpc

    caller = assistant_pb2.Caller(organization_id=services.org_id, user_id=services.user_id)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{services.orchestrator.port}") as channel:
        stub = assistant_pb2_grpc.AssistantServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.StartTurn(
                assistant_pb2.StartTurnRequest(caller=caller, message="hi", request_id="x" * 65)
            )
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert await _runs(services) == 0


async def test_after_a_failure_of_unknown_outcome_the_key_stays_bound_to_its_body(
    services, monkeypatch
):
    """A failure whose outcome the gateway cannot know keeps the key bound to its body: a retry
    with another body is 422 (freeing the key would start and charge a second turn); the same
    body retries at once and gets the started turn."""
    lost = _lose_first_answer(services, monkeypatch)
    async with services.client() as client:
        headers = {"Idempotency-Key": "turn-unknown"}
        first = await client.post("/assistant/chat", json={"message": "hello"}, headers=headers)
        assert first.status_code == 503, first.text
        other = await client.post("/assistant/chat", json={"message": "hello v2"}, headers=headers)
        assert other.status_code == 422, other.text
        retry = await client.post("/assistant/chat", json={"message": "hello"}, headers=headers)
        assert retry.status_code == 200 and retry.json()["run_id"] == lost[0]
        await read_frames(client, retry.json()["stream_url"])
    assert await _runs(services) == 1


async def test_a_refused_request_frees_its_key_for_another_body(services):
    async with services.client() as client:
        headers = {"Idempotency-Key": "turn-refused"}
        refused = await client.post(
            "/assistant/chat",
            json={"message": "hi", "chat_id": "00000000-0000-4000-8000-000000000000"},
            headers=headers,
        )
        assert refused.status_code == 404
        other = await client.post("/assistant/chat", json={"message": "another"}, headers=headers)
        assert other.status_code == 200, other.text
        await read_frames(client, other.json()["stream_url"])
    assert await _runs(services) == 1


async def test_starts_sent_together_with_one_request_id_start_and_charge_one_turn(services):
    """Ten StartTurn calls sent together with the same request_id start and charge one turn: a
    start holds the request_id's claim, and the others wait for it and answer the turn it
    started (AIP-155). A lookup alone would run before any of them had stored its run."""
    import asyncio

    import grpc

    from loopline.assistant.v1 import assistant_pb2, assistant_pb2_grpc
    from services.billing.models import LedgerEntry
    from tests.orchestrator.helpers import billing_delivered

    caller = assistant_pb2.Caller(organization_id=services.org_id, user_id=services.user_id)
    request = assistant_pb2.StartTurnRequest(
        caller=caller, message="same body", request_id="together-1"
    )
    async with grpc.aio.insecure_channel(f"127.0.0.1:{services.orchestrator.port}") as channel:
        stub = assistant_pb2_grpc.AssistantServiceStub(channel)
        answers = await asyncio.gather(*(stub.StartTurn(request) for _ in range(10)))
    assert len({(a.chat_id, a.run_id) for a in answers}) == 1
    assert await _runs(services) == 1
    await billing_delivered(services)
    async with services.billing.store.sessions() as session:
        charges = await session.scalar(
            select(func.count()).select_from(LedgerEntry).where(LedgerEntry.kind == "run_charge")
        )
    assert charges == 1
