"""API-key auth and roles: owner/admin may use the assistant; others 403; missing/unknown key
401."""

from __future__ import annotations

import asyncio

import httpx

from services.gateway.identity import hash_key


async def test_missing_key_is_401(services):
    async with httpx.AsyncClient(base_url=services.base_url) as client:
        response = await client.post(
            "/assistant/chat",
            json={"message": "hi"},
            headers={"X-Organization-ID": services.org_id},
        )
    assert response.status_code == 401
    assert "detail" in response.json()


async def test_unknown_key_is_401(services):
    async with httpx.AsyncClient(base_url=services.base_url) as client:
        response = await client.post(
            "/assistant/chat",
            json={"message": "hi"},
            headers=services.headers(api_key="mx_live_nope"),
        )
    assert response.status_code == 401


async def test_member_role_is_403_and_admin_is_allowed(services):
    member = await services.member("member")
    admin = await services.member("admin")
    async with httpx.AsyncClient(base_url=services.base_url) as client:
        denied = await client.post(
            "/assistant/chat",
            json={"message": "hi"},
            headers=services.headers(api_key=member["api_key"]),
        )
        allowed = await client.post(
            "/assistant/chat",
            json={"message": "hi"},
            headers=services.headers(api_key=admin["api_key"]),
        )
    assert denied.status_code == 403
    assert denied.json() == {
        "detail": "This requires the owner or admin role in this organization"
    }  # fits every route
    assert allowed.status_code == 200


async def test_key_of_another_organization_is_403(services):
    outsider = await services.member("owner", org_id="org_other")
    async with httpx.AsyncClient(base_url=services.base_url) as client:
        response = await client.get(
            "/assistant/chats", headers=services.headers(api_key=outsider["api_key"])
        )
    assert response.status_code == 403


async def test_keys_are_stored_only_as_hashes(services):
    from sqlalchemy import select

    from services.gateway.models import ApiKey

    async with services.gateway.sessions() as session:
        rows = (await session.execute(select(ApiKey))).scalars().all()
    assert all(services.api_key not in (row.key_hash, row.prefix) for row in rows)
    assert any(row.key_hash == hash_key(services.api_key) for row in rows)


async def test_another_organizations_chat_is_404(services):
    other = await services.member("owner", org_id="org_second")
    async with services.client() as client:
        chat_id = (await client.post("/assistant/chat", json={"message": "hello"})).json()[
            "chat_id"
        ]
    async with httpx.AsyncClient(
        base_url=services.base_url, headers=services.headers(other["api_key"], "org_second")
    ) as client:
        for response in (
            await client.post("/assistant/chat", json={"message": "hi", "chat_id": chat_id}),
            await client.get(f"/assistant/chat/{chat_id}"),
            await client.get(f"/assistant/chat/{chat_id}/status"),
            await client.post(f"/assistant/chat/{chat_id}/cancel"),
        ):
            assert response.status_code == 404, response.text


async def test_an_organization_id_no_organization_can_have_is_400_on_every_route_not_403(services):
    # 129 characters, non-ASCII and an inner space: 400, not 403 "requires owner or admin"
    async with httpx.AsyncClient(base_url=services.base_url) as client:
        for org_id in ("o" * 129, "örg", "org one"):
            headers = {**services.headers(), "X-Organization-ID": org_id}
            for method, path in (
                ("POST", "/assistant/chat"),
                ("GET", "/assistant/chats"),
                ("GET", "/credentials"),
                ("GET", "/assistant/chat/x/listen/y"),
            ):
                response = await client.request(
                    method,
                    path,
                    json={"message": "hi"} if method == "POST" else None,
                    headers={
                        k: v.encode() if k == "X-Organization-ID" else v for k, v in headers.items()
                    },
                )
                assert response.status_code == 400, (org_id, path, response.text)
                assert "X-Organization-ID" in response.json()["detail"]
        ok = await client.get("/assistant/chats", headers=services.headers(org_id="o" * 128))
        assert ok.status_code == 403  # well-formed, just not an organization the key's user is in
    url = httpx.URL(services.base_url)
    for padded in (
        services.org_id + " ",
        services.org_id + "\t",
        " \t" + services.org_id,
    ):  # RFC 9110: not part of the value
        for path, expected in (
            ("/assistant/chats", b" 200 "),
            ("/assistant/chat/x/listen/y", b" 404 "),
        ):
            reader, writer = await asyncio.open_connection(
                url.host, url.port
            )  # httpx refuses to send such a header
            writer.write(
                f"GET {path} HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer {services.api_key}\r\n"
                f"X-Organization-ID: {padded}\r\nConnection: close\r\n\r\n".encode()
            )
            status = await reader.readline()
            writer.close()
            assert expected in status, (repr(padded), path, status)
