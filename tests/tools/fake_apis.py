"""Local fakes of the APIs some community integrations call, for tests without the internet.

`make_test_ca(folder, hosts)` makes a CA and a server certificate for `hosts` (the integrations'
fixed host names, e.g. api.github.com); the tests serve the fakes over HTTPS on 127.0.0.1 with
it, trust the CA through SSL_CERT_FILE, and send the names there with
LOOPLINE_TOOLS_INTEGRATION_HOSTS. Each fake records the requests it saw in `seen`.
"""

from __future__ import annotations

import datetime
import ipaddress
from collections.abc import Container
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route


def make_test_ca(folder: Path, hosts: list[str]) -> tuple[str, str, str]:
    """(CA certificate file, server certificate file, server key file) for `hosts`."""
    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "loopline test CA")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(False, False, False, False, False, True, True, False, False),
            critical=True,
        )
        .add_extension(
            x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False
        )
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    names: list[x509.GeneralName] = [x509.DNSName(h) for h in hosts]
    names.append(x509.IPAddress(ipaddress.ip_address("127.0.0.1")))
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hosts[0])]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    paths = (folder / "ca.pem", folder / "server.pem", folder / "server.key")
    paths[0].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths[1].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    paths[2].write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return str(paths[0]), str(paths[1]), str(paths[2])


def _record(seen: list[dict[str, Any]], request: Request, body: Any = None) -> None:
    seen.append(
        {
            "host": request.headers.get("host"),
            "method": request.method,
            "path": request.url.path,
            "query": dict(request.query_params),
            "authorization": request.headers.get("authorization"),
            "api_key": request.headers.get("api-key"),
            "body": body,
        }
    )


def github_app(
    seen: list[dict[str, Any]], *tokens: str, accepted: Container[str] = ()
) -> Starlette:
    """GitHub's REST API, the parts the tests call: a repository, its issues; `tokens` are the
    bearer tokens it accepts, and whatever is in `accepted` when asked (e.g. an authorization
    server's live tokens)."""

    def allowed(request: Request) -> bool:
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        return scheme == "Bearer" and (token in tokens or token in accepted)

    async def repository(request: Request) -> JSONResponse:
        _record(seen, request)
        if not allowed(request):
            return JSONResponse({"message": "Bad credentials"}, status_code=401)
        owner, repo = request.path_params["owner"], request.path_params["repo"]
        if repo == "missing":
            return JSONResponse({"message": "Not Found"}, status_code=404)
        return JSONResponse(
            {
                "id": 1296269,
                "name": repo,
                "full_name": f"{owner}/{repo}",
                "private": False,
                "html_url": f"https://github.com/{owner}/{repo}",
                "description": "A fake repository",
                "default_branch": "main",
                "stargazers_count": 42,
                "owner": {"login": owner},
            }
        )

    async def create_issue(request: Request) -> JSONResponse:
        body = await request.json()
        _record(seen, request, body)
        if not allowed(request):
            return JSONResponse({"message": "Bad credentials"}, status_code=401)
        return JSONResponse(
            {
                "id": 1,
                "number": 7,
                "title": body.get("title"),
                "body": body.get("body"),
                "state": "open",
                "html_url": "https://github.com/o/r/issues/7",
                "user": {"login": "octo"},
                "labels": [],
                "assignees": [],
                "created_at": "2026-12-04T00:00:00Z",
                "updated_at": "2026-12-04T00:00:00Z",
            },
            status_code=201,
        )

    return Starlette(
        routes=[
            Route("/repos/{owner}/{repo}", repository),
            Route("/repos/{owner}/{repo}/issues", create_issue, methods=["POST"]),
        ]
    )


def airtable_app(seen: list[dict[str, Any]], key: str) -> Starlette:
    """Airtable's metadata API: the bases a personal access token sees."""

    async def bases(request: Request) -> JSONResponse:
        _record(seen, request)
        if request.headers.get("authorization") != f"Bearer {key}":
            return JSONResponse({"error": {"type": "AUTHENTICATION_REQUIRED"}}, status_code=401)
        return JSONResponse(
            {"bases": [{"id": "appFake1", "name": "Roadmap", "permissionLevel": "create"}]}
        )

    return Starlette(routes=[Route("/v0/meta/bases", bases)])


def qdrant_app(seen: list[dict[str, Any]], key: str) -> Starlette:
    """A Qdrant server (its host comes from the credential): the collections it holds."""

    async def collections(request: Request) -> JSONResponse:
        _record(seen, request)
        if request.headers.get("api-key") != key:
            return JSONResponse({"status": {"error": "forbidden"}}, status_code=403)
        return JSONResponse(
            {"result": {"collections": [{"name": "docs"}, {"name": "faq"}]}, "status": "ok"}
        )

    return Starlette(routes=[Route("/collections", collections)])


def recorder_app(seen: list[dict[str, Any]], answer: Any) -> Starlette:
    """Any API: records every request (with its headers in `headers`) and answers `answer`."""

    async def any_path(request: Request) -> JSONResponse:
        _record(seen, request)
        seen[-1]["headers"] = dict(request.headers)
        return JSONResponse(answer)

    return Starlette(routes=[Route("/{path:path}", any_path, methods=["GET", "POST"])])
