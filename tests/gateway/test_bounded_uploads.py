"""Document uploads stop reading at their limit and look the knowledge base up first; a client
that breaks its own body is answered 400 with at most one warning line.

Security: a chunked 200 MiB upload is not spooled to disk in full before the limit and the
knowledge base's existence are checked, and a malformed chunked body to POST /credentials logs
no ERROR traceback.
"""

from __future__ import annotations

import asyncio
import logging
import time

import pytest

from services.gateway.routes.knowledge import MAX_UPLOAD_BODY_BYTES, MAX_UPLOAD_BYTES

BOUNDARY = "loopline-test-boundary"
CHUNK = 256 * 1024


async def _open(services, path: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A connection that has sent the head of a chunked multipart upload to `path`."""
    port = int(services.base_url.rsplit(":", 1)[1])
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    headers = "".join(f"{k}: {v}\r\n" for k, v in services.headers().items())
    writer.write(
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n{headers}"
        f"Content-Type: multipart/form-data; boundary={BOUNDARY}\r\n"
        "Transfer-Encoding: chunked\r\n\r\n".encode()
    )
    part = (
        f"--{BOUNDARY}\r\n"
        'Content-Disposition: form-data; name="file"; filename="big.txt"\r\n'
        "Content-Type: text/plain\r\n\r\n"
    ).encode()
    writer.write(b"%x\r\n%s\r\n" % (len(part), part))
    await writer.drain()
    return reader, writer


def _status(head: bytes) -> int:
    return int(head.split(b"\r\n", 1)[0].split(b" ")[1])


async def test_a_chunked_upload_past_the_limit_is_413_before_the_body_ends(services):
    async with services.client() as client:
        kb = (await client.post("/knowledge-bases", json={"name": "Docs"})).json()
    reader, writer = await _open(services, f"/knowledge-bases/{kb['id']}/documents")
    answer = asyncio.ensure_future(reader.read(65536))
    sent, limit = 0, 8 * MAX_UPLOAD_BYTES  # 80 MiB offered; the server must stop long before
    data = b"%x\r\n%s\r\n" % (CHUNK, b"a" * CHUNK)
    try:
        while sent < limit and not answer.done():
            writer.write(data)
            try:
                await asyncio.wait_for(writer.drain(), 5)
            except (ConnectionError, TimeoutError):
                break  # the server stopped reading (or closed): the answer says which
            sent += CHUNK
        raw = await asyncio.wait_for(answer, 10)
    finally:
        writer.close()
    assert raw, f"no answer after {sent} bytes"
    assert _status(raw) == 413 and b"Upload exceeds" in raw
    assert sent < limit  # answered before the body was sent whole: reading stopped at the limit
    assert (
        sent < MAX_UPLOAD_BODY_BYTES + 16 * 1024 * 1024
    )  # the limit plus what socket buffers hold


async def test_an_upload_to_a_knowledge_base_that_does_not_exist_is_404_before_its_body_is_read(
    services,
):
    reader, writer = await _open(services, "/knowledge-bases/kb_missing/documents")
    writer.write(b"%x\r\n%s\r\n" % (CHUNK, b"a" * CHUNK))  # a body that never ends
    await writer.drain()
    started = time.monotonic()
    try:
        raw = await asyncio.wait_for(reader.read(65536), 10)
    finally:
        writer.close()
    assert _status(raw) == 404 and b"Knowledge base not found" in raw
    assert time.monotonic() - started < 5


async def test_an_upload_within_the_limit_is_still_indexed(services):
    async with services.client() as client:
        kb = (await client.post("/knowledge-bases", json={"name": "Docs"})).json()
        text = ("Walruses sleep in the water. " * 20_000).encode()  # ~580 KiB, several chunks
        response = await client.post(
            f"/knowledge-bases/{kb['id']}/documents", files={"file": ("w.txt", text, "text/plain")}
        )
        assert response.status_code == 201, response.text


@pytest.mark.parametrize(
    "broken",
    [
        b'5\r\n{"a":\r\nzz\r\n',  # a chunk size that is no number
        b"ffffffffffffffffffff\r\nabc",  # a chunk size past any limit
        b'3\r\n{"a\r\n',  # the client goes away in the middle of its body
    ],
)
async def test_a_client_that_breaks_its_own_body_gets_400_and_at_most_one_warning(
    services, caplog, broken
):
    caplog.set_level(logging.INFO)
    port = int(services.base_url.rsplit(":", 1)[1])
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    headers = "".join(f"{k}: {v}\r\n" for k, v in services.headers().items())
    writer.write(
        f"POST /credentials HTTP/1.1\r\nHost: x\r\n{headers}Content-Type: application/json\r\n"
        f"Transfer-Encoding: chunked\r\n\r\n".encode()
        + broken
    )
    await writer.drain()
    if broken.endswith(b'{"a\r\n'):
        writer.write_eof()  # half-close: the body will never end
    try:
        raw = await asyncio.wait_for(reader.read(65536), 10)
    finally:
        writer.close()
    await asyncio.sleep(0.3)  # the request's task finishes after the connection closed
    if raw:
        assert _status(raw) == 400
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    warnings = [
        r
        for r in caplog.records
        if r.levelno == logging.WARNING and "CREDENTIAL_KEY" not in r.getMessage()
    ]
    assert errors == [], [r.getMessage() for r in errors]
    assert len(warnings) <= 1, [r.getMessage() for r in warnings]
    assert not [r for r in caplog.records if r.exc_info]  # no traceback at any level


async def test_an_upload_declared_too_large_to_a_missing_knowledge_base_is_404(services):
    # an 11 MB upload (Content-Length) to a knowledge base that does not exist: 404, not 413
    port = int(services.base_url.rsplit(":", 1)[1])
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    headers = "".join(f"{k}: {v}\r\n" for k, v in services.headers().items())
    writer.write(
        f"POST /knowledge-bases/kb_missing/documents HTTP/1.1\r\nHost: 127.0.0.1\r\n{headers}"
        f"Content-Type: multipart/form-data; boundary={BOUNDARY}\r\n"
        f"Content-Length: {MAX_UPLOAD_BODY_BYTES + 1}\r\n\r\n".encode()
    )
    await writer.drain()
    try:
        head = await asyncio.wait_for(reader.read(65536), 10)
    finally:
        writer.close()
    assert _status(head) == 404, head[:200]
