"""Knowledge routes over HTTP and the SDK, and a turn that searches an uploaded document.

Shapes: the SDK's `modulex/types/knowledge.py`. Owner/admin only; no organization sees
another's documents. An upload answers "processing" (keyword-searchable at once) and becomes
"completed" once embedded: the tests of what was extracted search by keyword
(`search_type: keyword`), the others wait for the embeddings (`settled`).
"""

from __future__ import annotations

import asyncio
import io
import time

import httpx
import pytest
from modulex import Modulex
from modulex._exceptions import NotFoundError

from tests.orchestrator.helpers import run_turn


def make_pdf(text: str) -> bytes:
    """A one-page PDF (Helvetica) showing `text`, with a correct cross-reference table."""
    stream = f"BT /F1 12 Tf 72 720 Td ({text}) Tj ET".encode()
    objects = [
        b"<< /Type /Catalog /Pages 2 0 R >>",
        b"<< /Type /Pages /Kids [3 0 R] /Count 1 >>",
        b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Contents 4 0 R"
        b" /Resources << /Font << /F1 5 0 R >> >> >>",
        b"<< /Length %d >>\nstream\n" % len(stream) + stream + b"\nendstream",
        b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>",
    ]
    out = io.BytesIO()
    out.write(b"%PDF-1.4\n")
    offsets = []
    for number, body in enumerate(objects, start=1):
        offsets.append(out.tell())
        out.write(b"%d 0 obj\n" % number + body + b"\nendobj\n")
    xref = out.tell()
    out.write(b"xref\n0 %d\n0000000000 65535 f \n" % (len(objects) + 1))
    for offset in offsets:
        out.write(b"%010d 00000 n \n" % offset)
    out.write(
        b"trailer\n<< /Size %d /Root 1 0 R >>\nstartxref\n%d\n%%%%EOF\n" % (len(objects) + 1, xref)
    )
    return out.getvalue()


UPLOADS = {
    "notes.txt": (b"The aurora borealis is visible from Tromso in winter.", "text/plain", "aurora"),
    "guide.md": (
        b"# Guide\n\nThe **kettlebell** swing trains the hips.",
        "text/markdown",
        "kettlebell",
    ),
    "page.html": (
        b"<html><head><script>var hidden='zzsecretzz';</script></head>"
        b"<body><p>Marmalade recipe</p></body></html>",
        "text/html",
        "marmalade",
    ),
    "table.csv": (b"city,river\nBudapest,Danube\n", "text/csv", "danube"),
    "data.json": (
        b'{"instrument": "theremin", "inventor": "Leon"}',
        "application/json",
        "theremin",
    ),
    "paper.pdf": (
        make_pdf("Quasicrystals have aperiodic order"),
        "application/pdf",
        "quasicrystals",
    ),
}


async def _base(client: httpx.AsyncClient, name: str = "Docs") -> dict:
    response = await client.post("/knowledge-bases", json={"name": name, "description": "test"})
    assert response.status_code == 201, response.text
    return response.json()


async def settled(client: httpx.AsyncClient, kb_id: str, timeout: float = 120.0) -> list[dict]:
    """The knowledge base's documents once none is "processing" (GET .../documents)."""
    deadline = time.monotonic() + timeout
    while True:
        response = await client.get(f"/knowledge-bases/{kb_id}/documents")
        assert response.status_code == 200, response.text
        documents = response.json()
        if all(d["status"] != "processing" for d in documents):
            return documents
        assert time.monotonic() < deadline, documents
        await asyncio.sleep(0.1)


def keyword(query: str, **fields: object) -> dict:
    """A search body that finds the query's words (not what the embeddings say is close)."""
    return {"query": query, "search_type": "keyword", **fields}


async def test_upload_every_supported_type_then_search_it(services):
    async with services.client() as client:
        kb = await _base(client)
        assert (
            kb["status"] == "active"
            and kb["document_count"] == 0
            and kb["organization_id"] == services.org_id
        )
        for filename, (data, media, word) in UPLOADS.items():
            response = await client.post(
                f"/knowledge-bases/{kb['id']}/documents", files={"file": (filename, data, media)}
            )
            assert response.status_code == 201, (filename, response.text)
            document = response.json()
            assert document["filename"] == filename and document["status"] == "processing"
            assert document["file_type"] == filename.rsplit(".", 1)[1] and document[
                "file_size_bytes"
            ] == len(data)
            assert document["chunk_count"] >= 1 and document["token_count"] >= 1
            status = (
                await client.get(f"/knowledge-bases/{kb['id']}/documents/{document['id']}/status")
            ).json()
            assert status["document_id"] == document["id"]
            assert status["status"] in ("processing", "completed")
            found = (
                await client.post(f"/knowledge-bases/{kb['id']}/search", json=keyword(word))
            ).json()
            assert found["knowledge_base_id"] == kb["id"] and found["total_matches"] >= 1, (
                filename,
                found,
            )
            top = found["matches"][0]
            assert top["document_id"] == document["id"] and top["document_filename"] == filename
            assert word in top["content"].lower() and top["score"] > 0
        hidden = (
            await client.post(f"/knowledge-bases/{kb['id']}/search", json=keyword("zzsecretzz"))
        ).json()
        assert hidden["total_matches"] == 0  # script text is not indexed
        documents = await settled(client, kb["id"])
        assert {d["status"] for d in documents} == {"completed"}
        assert {d["filename"] for d in documents} == set(UPLOADS)
        listed = (await client.get("/knowledge-bases")).json()
        assert [b["id"] for b in listed] == [kb["id"]] and listed[0]["document_count"] == len(
            UPLOADS
        )
        assert listed[0]["total_chunks"] >= len(UPLOADS)


async def test_a_file_name_without_an_extension_is_read_as_txt_unless_its_media_type_says_otherwise(
    services,
):
    # curl's and the SDK's default media type (application/octet-stream) is taken, not 415
    async with services.client() as client:
        kb = await _base(client)
        url = f"/knowledge-bases/{kb['id']}/documents"
        for name, media in (
            ("noext", "application/octet-stream"),
            ("document", "text/x-log"),
            ("notes", "text/markdown"),
        ):
            response = await client.post(url, files={"file": (name, b"about lemurs", media)})
            assert response.status_code == 201, (name, response.text)
            assert response.json()["file_type"] == ("md" if media == "text/markdown" else "txt")
        image = await client.post(url, files={"file": ("picture", b"\x89PNG\r\n", "image/png")})
        assert image.status_code == 415 and "image/png" in image.json()["detail"]
        found = (
            await client.post(f"/knowledge-bases/{kb['id']}/search", json=keyword("lemurs"))
        ).json()
        assert found["total_matches"] >= 3


async def test_a_json_upload_with_a_lone_surrogate_escape_is_indexed_not_a_500(services):
    # {"a": "\ud800"} is valid JSON but a str no database stores: indexed, not a 500
    async with services.client() as client:
        kb = await _base(client)
        response = await client.post(
            f"/knowledge-bases/{kb['id']}/documents",
            files={"file": ("d.json", b'{"a": "lemur \\ud800 here"}', "application/json")},
        )
        assert response.status_code == 201, response.text
        found = (
            await client.post(f"/knowledge-bases/{kb['id']}/search", json=keyword("lemur"))
        ).json()
        assert found["total_matches"] == 1 and "\ufffd" in found["matches"][0]["content"]


async def test_unsupported_or_empty_uploads_are_refused(services):
    async with services.client() as client:
        kb = await _base(client)
        url = f"/knowledge-bases/{kb['id']}/documents"
        exe = await client.post(
            url, files={"file": ("tool.exe", b"MZ\x90\x00", "application/octet-stream")}
        )
        assert exe.status_code == 415 and "Unsupported file type" in exe.json()["detail"]
        empty = await client.post(url, files={"file": ("empty.txt", b"", "text/plain")})
        assert empty.status_code == 400
        blank = await client.post(url, files={"file": ("blank.md", b"   \n\n  ", "text/markdown")})
        assert blank.status_code == 400 and "no text" in blank.json()["detail"]
        bad_json = await client.post(url, files={"file": ("x.json", b"{nope", "application/json")})
        assert bad_json.status_code == 400 and "JSON" in bad_json.json()["detail"]
        not_multipart = await client.post(url, json={"file": "x"})
        assert not_multipart.status_code == 400
        no_file = await client.post(url, files={"other": ("a.txt", b"text", "text/plain")})
        assert no_file.status_code == 400
        missing = await client.post(
            "/knowledge-bases/nope/documents", files={"file": ("a.txt", b"text", "text/plain")}
        )
        assert missing.status_code == 404


async def test_multi_search_ranks_across_bases_and_bad_input_is_400(services):
    async with services.client() as client:
        first, second = await _base(client, "One"), await _base(client, "Two")
        await client.post(
            f"/knowledge-bases/{first['id']}/documents",
            files={"file": ("a.txt", b"Saffron is a spice from crocus flowers.", "text/plain")},
        )
        await client.post(
            f"/knowledge-bases/{second['id']}/documents",
            files={
                "file": ("b.txt", b"Saffron saffron saffron: the costliest spice.", "text/plain")
            },
        )
        both = (
            await client.post(
                "/knowledge-bases/search",
                json=keyword("saffron", knowledge_base_ids=[first["id"], second["id"]], top_k=5),
            )
        ).json()
        assert (
            both["knowledge_bases_searched"] == 2
            and both["total_matches"] == 2
            and both["top_k"] == 5
        )
        assert {m["metadata"]["knowledge_base_id"] for m in both["matches"]} == {
            first["id"],
            second["id"],
        }
        assert both["matches"][0]["score"] >= both["matches"][1]["score"]
        # 1.0 is the integer 1 (JSON Schema's `integer`); the answer says it as an integer
        one = await client.post(
            "/knowledge-bases/search",
            json=keyword("saffron", knowledge_base_ids=[first["id"], second["id"]], top_k=1.0),
        )
        assert (
            one.status_code == 200 and '"top_k":1,' in one.text and one.json()["total_matches"] == 1
        ), one.text
        await settled(client, first["id"])
        only_one = (
            await client.post(
                "/knowledge-bases/search",
                json={"knowledge_base_ids": [first["id"]], "query": "saffron"},
            )
        ).json()  # semantic (the default): whatever the embeddings say, only that base's chunk
        assert [m["document_filename"] for m in only_one["matches"]] == ["a.txt"]
        for body in (
            {"knowledge_base_ids": [], "query": "x"},
            {"knowledge_base_ids": [first["id"]]},
            {"knowledge_base_ids": [first["id"]], "query": "x", "top_k": 0},
            {"knowledge_base_ids": "x", "query": "x"},
        ):
            assert (await client.post("/knowledge-bases/search", json=body)).status_code == 400, (
                body
            )
        assert (await client.post("/knowledge-bases", json={"name": ""})).status_code == 400
        assert (
            await client.post("/knowledge-bases", json={"name": "x", "color": "red"})
        ).status_code == 400
        unknown = await client.post(
            "/knowledge-bases/search", json={"knowledge_base_ids": ["nope"], "query": "saffron"}
        )
        assert unknown.status_code == 404


async def test_oversized_knowledge_fields_are_400_naming_the_limit_and_nothing_is_stored(services):
    """Names are at most 200 characters (the tools service's column), descriptions 10,000, a
    search query 2,048; a multi-search names at most 100 knowledge bases. Without these limits
    only the 1 MiB body cap applies."""
    async with services.client() as client:
        kept = await client.post(
            "/knowledge-bases", json={"name": "n" * 200, "description": "d" * 10_000}
        )
        assert kept.status_code == 201, kept.text[:300]
        kb_id = kept.json()["id"]
        cases = [
            ("/knowledge-bases", {"name": "n" * 201}, "name must be at most 200 characters"),
            ("/knowledge-bases", {"name": "n" * 200_000}, "name must be at most 200 characters"),
            (
                "/knowledge-bases",
                {"name": "ok", "description": "d" * 10_001},
                "description must be at most 10000 characters",
            ),
            (
                f"/knowledge-bases/{kb_id}/search",
                {"query": "q" * 2049},
                "query must be at most 2048 characters",
            ),
            (
                "/knowledge-bases/search",
                {"knowledge_base_ids": [kb_id], "query": "q" * 2049},
                "query must be at most 2048 characters",
            ),
            (
                "/knowledge-bases/search",
                {"knowledge_base_ids": [kb_id] * 101, "query": "q"},
                "at most 100 knowledge bases",
            ),
            (
                "/knowledge-bases/search",
                {"knowledge_base_ids": ["i" * 65], "query": "q"},
                "at most 64 characters each",
            ),
        ]
        for path, body, expected in cases:
            response = await client.post(path, json=body)
            assert response.status_code == 400, (path, response.text[:300])
            assert expected in response.json()["detail"], response.text[:300]
            assert len(response.text) < 300
        assert [kb["id"] for kb in (await client.get("/knowledge-bases")).json()] == [
            kb_id
        ]  # nothing else stored


async def test_no_organization_sees_another_organizations_documents(services):
    outsider = await services.member("owner", org_id="org_other_kb")
    member = await services.member("member")
    async with services.client() as client:
        kb = await _base(client)
        doc = (
            await client.post(
                f"/knowledge-bases/{kb['id']}/documents",
                files={"file": ("s.txt", b"Confidential walrus plans", "text/plain")},
            )
        ).json()
    headers = services.headers(outsider["api_key"], "org_other_kb")
    async with httpx.AsyncClient(base_url=services.base_url, headers=headers) as other:
        assert (await other.get("/knowledge-bases")).json() == []
        assert (
            await other.post(f"/knowledge-bases/{kb['id']}/search", json={"query": "walrus"})
        ).status_code == 404
        assert (
            await other.get(f"/knowledge-bases/{kb['id']}/documents/{doc['id']}/status")
        ).status_code == 404
        upload = await other.post(
            f"/knowledge-bases/{kb['id']}/documents", files={"file": ("x.txt", b"x", "text/plain")}
        )
        assert upload.status_code == 404
        own = (await other.post("/knowledge-bases", json={"name": "Mine"})).json()
        assert (
            await other.post(
                "/knowledge-bases/search",
                json={"knowledge_base_ids": [own["id"]], "query": "walrus"},
            )
        ).json()["total_matches"] == 0
    async with httpx.AsyncClient(
        base_url=services.base_url, headers=services.headers(member["api_key"])
    ) as weak:
        assert (await weak.get("/knowledge-bases")).status_code == 403
        assert (
            await weak.post(f"/knowledge-bases/{kb['id']}/search", json={"query": "walrus"})
        ).status_code == 403


async def test_knowledge_through_the_sdk(services, tmp_path):
    client = Modulex(
        api_key=services.api_key, organization_id=services.org_id, base_url=services.base_url
    )
    try:
        kb = await client.knowledge.create("SDK base", description="from the SDK")
        path = tmp_path / "facts.md"
        path.write_text("# Facts\n\nThe okapi is a relative of the giraffe.")
        document = await client.knowledge.upload_document(
            kb.id, file_path=str(path), metadata={"source": "test"}
        )
        assert document.status == "processing" and document.filename == "facts.md"
        deadline = time.monotonic() + 120
        while (status := await client.knowledge.document_status(kb.id, document.id)).status == (
            "processing"
        ):
            assert time.monotonic() < deadline
            await asyncio.sleep(0.1)
        assert status.status == "completed" and status.chunk_count == 1
        result = await client.knowledge.search(kb.id, "okapi giraffe", top_k=3)
        assert result.total_matches == 1 and result.matches[0].document_id == document.id
        multi = await client.knowledge.multi_search([kb.id], "okapi")
        assert (
            multi.knowledge_bases_searched == 1
            and multi.matches[0].chunk_id == result.matches[0].chunk_id
        )
        assert [b.id for b in await client.knowledge.list()] == [kb.id]
        with pytest.raises(NotFoundError):
            await client.knowledge.document_status(kb.id, "missing")
    finally:
        await client.close()


async def test_turn_searches_an_uploaded_document(services):
    async with services.client() as client:
        kb = await _base(client)
        upload = await client.post(
            f"/knowledge-bases/{kb['id']}/documents",
            files={
                "file": (
                    "handbook.md",
                    b"# Handbook\n\nRefunds are processed within 14 days.\n\n"
                    b"Shipping is free over 50 EUR.",
                    "text/markdown",
                )
            },
        )
        assert upload.status_code == 201
        _body, frames = await run_turn(
            client,
            {"tool": "search_knowledge", "input": {"query": "refunds days", "top_k": 3}},
            {"say": "14 days."},
        )
    result = next(f["data"] for f in frames if f["type"] == "tool_result")
    assert result["tool"] == "search_knowledge"
    hits = result["output"]["results"]
    assert hits and hits[0]["document_name"] == "handbook.md" and "14 days" in hits[0]["content"]
    assert frames[-1]["type"] == "done" and frames[-1]["data"]["response"] == "14 days."
    assert result["output"]["count"] == len(hits) == 1  # the short handbook is one chunk


async def test_a_knowledge_base_names_its_creator_in_every_answer(services):
    """The creator is stored with a knowledge base, so POST and GET /knowledge-bases both
    answer the caller as `created_by_user_id`."""
    async with services.client() as client:
        created = await client.post("/knowledge-bases", json={"name": "Handbook"})
        assert created.status_code == 201, created.text
        assert created.json()["created_by_user_id"] == services.user_id
        listed = (await client.get("/knowledge-bases")).json()
        assert [(kb["id"], kb["created_by_user_id"]) for kb in listed] == [
            (created.json()["id"], services.user_id)
        ]


async def test_the_status_filter_takes_the_sdk_statuses_and_refuses_others(services):
    """A status outside the SDK's KnowledgeBaseStatus is 400, so a typo such as
    `status=activ` is not an empty list that looks like an organization without bases."""
    async with services.client() as client:
        created = await client.post("/knowledge-bases", json={"name": "Handbook"})
        assert created.status_code == 201, created.text
        active = await client.get("/knowledge-bases", params={"status": "active"})
        assert [kb["id"] for kb in active.json()] == [created.json()["id"]]
        assert (await client.get("/knowledge-bases", params={"status": "archived"})).json() == []
        refused = await client.get("/knowledge-bases", params={"status": "activ"})
        assert refused.status_code == 400
        assert refused.json() == {
            "detail": "status must be one of active, processing, error, archived"
        }
