"""Bad input gets the documented 4xx with {"detail": ...} and writes nothing (spec "Start the
turn")."""

from __future__ import annotations

import uuid

import pytest
from sqlalchemy import func, select

from services.gateway.bodies import json_object
from services.orchestrator.models import Chat, Message, Run


async def _counts(services) -> tuple[int, int, int]:
    async with services.orchestrator.servicer.sessions() as session:
        return tuple(
            [
                (await session.execute(select(func.count()).select_from(m))).scalar()
                for m in (Chat, Message, Run)
            ]
        )


@pytest.mark.parametrize("message", [42, 1.5, ["hi"], {"text": "hi"}, None, True])
async def test_non_string_message_is_400_and_writes_nothing(services, message):
    async with services.client() as client:
        response = await client.post("/assistant/chat", json={"message": message})
    assert response.status_code == 400
    assert isinstance(response.json()["detail"], str)
    assert await _counts(services) == (0, 0, 0)


@pytest.mark.parametrize(
    "content", [b"not json", b"[1, 2]", b'"just a string"', b"", b"null", b'{"message": "\\ud800"}']
)
async def test_body_not_a_json_object_is_400(services, content):
    async with services.client() as client:
        response = await client.post(
            "/assistant/chat", content=content, headers={"Content-Type": "application/json"}
        )
    assert response.status_code == 400
    assert "detail" in response.json()
    assert await _counts(services) == (0, 0, 0)


async def test_missing_message_and_unknown_fields_are_400(services):
    async with services.client() as client:
        assert (await client.post("/assistant/chat", json={})).status_code == 400
        assert (
            await client.post("/assistant/chat", json={"message": "hi", "surprise": 1})
        ).status_code == 400
        assert (
            await client.post("/assistant/chat", json={"message": "hi", "llm": "gpt-4o"})
        ).status_code == 400
    assert await _counts(services) == (0, 0, 0)


async def test_huge_body_is_413(services):
    async with services.client() as client:
        response = await client.post("/assistant/chat", json={"message": "x" * (2 * 1024 * 1024)})
    assert response.status_code == 413
    assert await _counts(services) == (0, 0, 0)


async def test_unknown_chat_id_is_404_and_writes_nothing(services):
    async with services.client() as client:
        for chat_id in (str(uuid.uuid4()), "not-a-uuid"):
            response = await client.post(
                "/assistant/chat", json={"message": "hi", "chat_id": chat_id}
            )
            assert response.status_code == 404
            assert response.json() == {"detail": "Chat not found"}
    assert await _counts(services) == (0, 0, 0)


async def test_unknown_provider_is_400_before_anything_is_written(services):
    async with services.client() as client:
        response = await client.post(
            "/assistant/chat",
            json={
                "message": "hi",
                "llm": {"integration_name": "x", "provider_id": "nope", "model_id": "m"},
            },
        )
    assert response.status_code == 400
    assert await _counts(services) == (0, 0, 0)


async def test_scripted_model_outside_its_list_is_400(services):
    async with services.client() as client:
        response = await client.post(
            "/assistant/chat",
            json={
                "message": "hi",
                "llm": {
                    "integration_name": "loopline",
                    "provider_id": "scripted",
                    "model_id": "gpt-99",
                },
            },
        )
    assert response.status_code == 400
    assert await _counts(services) == (0, 0, 0)


async def test_out_of_range_integers_are_400_not_500(services):
    import uuid

    async with services.client() as client:
        listen = await client.get(
            f"/assistant/chat/{uuid.uuid4()}/listen/{uuid.uuid4()}", params={"after": str(2**63)}
        )
        creds = await client.get("/credentials", params={"offset": "99999999999999999999"})
        chats = await client.get("/assistant/chats", params={"limit": str(2**70)})
    assert (listen.status_code, creds.status_code, chats.status_code) == (400, 400, 400)
    assert "detail" in listen.json() and "detail" in creds.json()


@pytest.mark.parametrize("field", ["model_id", "provider_id"])
async def test_a_huge_field_quoted_by_an_error_is_400_with_a_bounded_detail(services, field):
    """An error quoting a huge field (a 17,000-character model id) is a 400 with a bounded
    detail (services.common.errors.bounded): the gateway's channel refuses oversized status
    metadata, which would reach the client as 429 "Stream removed". A status without ErrorInfo
    is never a 4xx."""
    llm = {"integration_name": "scripted", "provider_id": "scripted", "model_id": "default"}
    llm[field] = "d" * 17_000
    async with services.client() as client:
        response = await client.post("/assistant/chat", json={"message": "hi", "llm": llm})
        settings = await client.put("/organizations/settings/composer-llm", json=llm)
    for answer in (response, settings):
        assert answer.status_code == 400, answer.text
        assert len(answer.json()["detail"]) <= 1000
        assert "metadata" not in answer.json()["detail"]
    assert await _counts(services) == (0, 0, 0)


async def test_an_unknown_field_with_a_huge_name_gets_a_bounded_detail(services):
    # "Unknown field(s): ..." shortens a huge field name instead of quoting it in full
    async with services.client() as client:
        response = await client.post("/assistant/chat", json={"message": "hi", "f" * 5_000: 1})
        nested = await client.post(
            "/assistant/chat",
            json={"message": "hi", "llm": {"provider_id": "scripted", "g" * 5_000: 1}},
        )
    for answer in (response, nested):
        assert answer.status_code == 400 and len(answer.json()["detail"]) <= 1000
    assert await _counts(services) == (0, 0, 0)


@pytest.mark.parametrize(
    "content",
    [
        b'{"message": "hi", "message": "ho"}',
        b'{"message": "hi", "metadata": {"a": 1, "a": 2}}',
        b'{"message": "hi", "metadata": {"l": [{"\xc3\xa9": 1, "\xc3\xa9": 2}]}}',
    ],
)
async def test_a_name_given_twice_in_an_object_is_400_not_its_last_value(services, content):
    # {"message": "hi", "message": "ho"} must not start a turn with "ho" (RFC 8259 §4, RFC 7493
    # §2.3)
    async with services.client() as client:
        response = await client.post(
            "/assistant/chat", content=content, headers={"Content-Type": "application/json"}
        )
        assert response.status_code == 400
        assert response.json()["detail"].startswith("Request body gives the name ")
        assert response.json()["detail"].endswith(" more than once in one object; give it once")
        credential = await client.post(
            "/credentials",
            content=b'{"integration_name": "http", "integration_name": "postgresql"}',
            headers={"Content-Type": "application/json"},
        )  # a FastAPI route reads bodies the same way
        assert (
            credential.status_code == 400
            and '"integration_name" more than once' in credential.json()["detail"]
        )
    assert await _counts(services) == (0, 0, 0)


async def test_the_same_name_in_different_objects_and_colons_in_strings_are_fine(services):
    nested = b'{"a": {"a": {"a": 1}}, "b": [{"a": 1}, {"a": 2}], "c": "x: y: z"}'
    assert json_object(nested) == {"a": {"a": {"a": 1}}, "b": [{"a": 1}, {"a": 2}], "c": "x: y: z"}
    async with services.client() as client:
        response = await client.post(
            "/assistant/chat",
            content=b'{"message": "a: b: c", "chat_id": null}',
            headers={"Content-Type": "application/json"},
        )
    assert response.status_code == 200, response.text
