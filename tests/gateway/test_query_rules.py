"""Query strings: integers as digits only, booleans as true/false, one value per parameter
(services/gateway/query.py).

So `?after=1_0` is refused, not read as 10 (pydantic's lax int also reads "+1", " 1",
"1.0"), and `?after=3&after=5` is refused, not read as 5 (FastAPI takes the last value).
"""

from __future__ import annotations

import pytest

from tests.orchestrator.helpers import run_turn

# (path, the route's integer parameter) for every route that takes one
ROUTES = [
    ("/assistant/chat/{chat}/listen/{run}", "after"),
    ("/assistant/chats", "limit"),
    ("/credentials", "limit"),
    ("/credentials", "offset"),
    ("/knowledge-bases", "limit"),
    ("/knowledge-bases", "offset"),
]


@pytest.mark.parametrize("written", ["1_0", "+1", " 1", "1.0", "0x1", "1e1", "\uff11", ""])
async def test_an_integer_query_parameter_is_decimal_digits_only(services, written):
    async with services.client() as client:
        body, _ = await run_turn(client, {"say": "one two three"})
        for path, name in ROUTES:
            response = await client.get(
                path.format(chat=body["chat_id"], run=body["run_id"]), params={name: written}
            )
            assert response.status_code == 400, (path, name, response.text)
            assert response.json() == {
                "detail": f"{name}: Input should be a whole number in digits"
            }


async def test_digits_still_work_and_a_negative_number_gets_its_range_error(services):
    async with services.client() as client:
        body, frames = await run_turn(client, {"say": "one two three"})
        for path, name in ROUTES:
            url = path.format(chat=body["chat_id"], run=body["run_id"])
            assert (await client.get(url, params={name: "1"})).status_code == 200
            negative = await client.get(url, params={name: "-1"})
            assert negative.status_code == 400 and negative.json()["detail"].startswith(
                f"{name}: Input should be greater than or equal to"
            )
        replay = await client.get(body["stream_url"], params={"after": "2"})
        assert replay.text.count("data: ") == len(frames) - 2


async def test_a_query_parameter_given_twice_is_400_naming_it(services):
    async with services.client() as client:
        body, _ = await run_turn(client, {"say": "one two three"})
        for url, name in [
            (f"{body['stream_url']}?after=3&after=5", "after"),
            ("/assistant/chats?limit=1&limit=2", "limit"),
            ("/credentials?integration_name=http&integration_name=postgresql", "integration_name"),
            (f"/assistant/chat/{body['chat_id']}?permanent=true&permanent=false", "permanent"),
        ]:
            method = client.delete if "permanent" in url else client.get
            response = await method(url)
            assert response.status_code == 400 and response.json() == {
                "detail": f"{name}: given more than once; give it once"
            }, url
        assert (
            await client.get(f"/assistant/chat/{body['chat_id']}")
        ).status_code == 200  # nothing was deleted


@pytest.mark.parametrize("written", ["yes", "1", "on", "True", "t", "no", "0", ""])
async def test_a_boolean_query_parameter_is_true_or_false_only(services, written):
    # a lax boolean (?permanent=yes) must not delete a chat for good: only true or false
    async with services.client() as client:
        body, _ = await run_turn(client, {"say": "one two three"})
        deleted = await client.delete(
            f"/assistant/chat/{body['chat_id']}", params={"permanent": written}
        )
        assert deleted.status_code == 400 and deleted.json() == {
            "detail": "permanent: Input should be true or false"
        }
        masked = await client.get("/credentials/cred_unknown", params={"include_masked": written})
        assert masked.status_code == 400 and masked.json() == {
            "detail": "include_masked: Input should be true or false"
        }
        assert (
            await client.get(f"/assistant/chat/{body['chat_id']}")
        ).status_code == 200  # nothing was deleted
        assert (
            await client.delete(f"/assistant/chat/{body['chat_id']}", params={"permanent": "false"})
        ).status_code == 200
        assert (
            await client.get("/credentials/cred_unknown", params={"include_masked": "true"})
        ).status_code == 404
