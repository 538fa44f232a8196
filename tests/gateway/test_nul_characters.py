"""U+0000 in text the API stores: the same answer on SQLite and PostgreSQL.

PostgreSQL's text types cannot hold U+0000: `POST /assistant/chat` with "hi\\u0000there" would
be a 500 there (asyncpg CharacterNotInRepertoireError writing the chat title) and a 200 on
SQLite. Every JSON body goes through `services.gateway.bodies.json_object`, which refuses a
string holding U+0000 with a 400; query parameters that reach a text column say the same.
"""

from __future__ import annotations

import pytest

from services.gateway.bodies import json_object
from services.gateway.errors import BodyError

NUL_MESSAGE = (
    "Request body contains a NUL character (\\u0000) in a string; text fields cannot hold it"
)


async def test_a_turn_whose_message_holds_nul_is_400_and_nothing_is_written_or_charged(services):
    async with services.client() as client:
        refused = await client.post(
            "/assistant/chat",
            content=b'{"message": "hi\\u0000there"}',
            headers={"content-type": "application/json"},
        )
        assert refused.status_code == 400, refused.text
        assert refused.json() == {"detail": NUL_MESSAGE}
        assert (await client.get("/assistant/chats")).json()["items"] == []
        created = await client.post("/knowledge-bases", json={"name": "a\x00b"})
        assert created.status_code == 400 and created.json() == {"detail": NUL_MESSAGE}
        fine = await client.post(
            "/assistant/chat", json={"message": "a backslash then u0000: \\u0000"}
        )
        assert fine.status_code == 200, fine.text  # the text \u0000 (escaped backslash) is no NUL


@pytest.mark.parametrize(
    "body", [b'{"a": "\\u0000"}', b'{"a\\u0000": 1}', b'{"a": [{"b": ["x\\u0000"]}]}']
)
def test_json_object_refuses_nul_in_any_string_or_key(body):
    with pytest.raises(BodyError) as refused:
        json_object(body)
    assert refused.value.status == 400 and refused.value.message == NUL_MESSAGE


@pytest.mark.parametrize(
    "method,url",
    [
        ("GET", "/credentials?integration_name=a%00"),
        ("GET", "/credentials/x%00"),
        ("DELETE", "/credentials/x%00"),
        ("POST", "/credentials/x%00/set-default"),
        ("GET", "/knowledge-bases/x%00/documents/y%00"),
        ("GET", "/knowledge-bases/x%00/documents/y%00/status"),
        ("GET", "/assistant/chat/x%00/listen/y"),
    ],
)
async def test_a_nul_in_a_path_or_query_value_is_400(services, method, url):
    """Every route answers a NUL in a path or query value with 400 before anything is looked
    up, on SQLite and PostgreSQL alike (PostgreSQL refuses a NUL in a WHERE clause: a 500)."""
    async with services.client() as client:
        response = await client.request(method, url)
    assert response.status_code == 400, response.text
    assert response.json() == {
        "detail": "A path or query value contains a NUL character (%00);"
        " ids and text values cannot hold it"
    }
