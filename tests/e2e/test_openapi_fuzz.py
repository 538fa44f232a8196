"""Schemathesis against the gateway's OpenAPI document: no 5xx, no undocumented status."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import httpx
import pytest

from tests.e2e.conftest import start_deployment, stop_deployment

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    """The module's deployment (conftest's) with rate limits raised past what the run sends: ~1,500
    requests in ~10 s with one key, and schemathesis' probes without or with a wrong key
    (`ignored_auth`), which the defaults (600 requests per key, 30 failed authentications per
    client a minute) would answer 429 (documented, but then the run would test little else)."""
    data = tmp_path_factory.mktemp("fuzz")
    started = start_deployment(
        data,
        data / "logs",
        env={
            "LOOPLINE_KEY_REQUESTS_PER_MINUTE": "1000000",
            "LOOPLINE_FAILED_AUTHS_PER_MINUTE": "1000000",
        },
    )
    yield started
    stop_deployment(started)


def test_openapi_documents_every_route_and_status(deployment):
    schema = httpx.get(f"{deployment.base_url}/openapi.json").json()
    paths = schema["paths"]
    assert "/assistant/chat" in paths and "/assistant/chat/{chat_id}/listen/{run_id}" in paths
    for path, methods in paths.items():
        for method, operation in methods.items():
            codes = set(operation["responses"])
            if path == "/system/health":  # open, no key, no body: it only answers 200
                assert codes == {"200"}, codes
                continue
            assert {"400", "401", "403", "503"} <= codes, (method, path, codes)


def test_schemathesis_finds_no_server_error_or_undocumented_status(deployment):
    """positive_data_acceptance is excluded: a schema-valid cancel on an idle chat is a documented
    400, and allow_header_conformance because Starlette's 405 lists only the first matching
    route's methods. ensure_resource_availability too: a link schemathesis infers from the
    response schemas may fill a call only in part (a multi-search naming generated ids after a
    knowledge base was created), and it reads the documented 404 that follows as a created
    resource gone.
    One worker: CPython 3.11's ast.parse is not thread-safe ("AST constructor recursion depth
    mismatch"), and hypothesis parses lambdas while schemathesis generates cases in threads."""
    command = [
        str(pathlib.Path(sys.executable).parent / "schemathesis"),
        "run",
        f"{deployment.base_url}/openapi.json",
        "-H",
        f"Authorization: Bearer {deployment.api_key}",
        "-H",
        f"X-Organization-ID: {deployment.org_id}",
        "--checks",
        "all",
        "--exclude-checks",
        "positive_data_acceptance,allow_header_conformance,ensure_resource_availability",
        "--max-examples",
        "15",
        "--phases",
        "coverage,fuzzing,stateful",
        "--workers",
        "1",
        "--seed",
        "20261130",
    ]
    result = subprocess.run(
        command,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "NO_COLOR": "1"},
    )
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
